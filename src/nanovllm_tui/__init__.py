"""The nanovllm-tui app."""
