"""speculative"""
