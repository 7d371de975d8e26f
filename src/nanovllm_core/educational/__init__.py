"""educational"""
