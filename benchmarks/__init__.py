"""Benchmark programs: our engine against Hugging Face transformers, each scheduling feature, the scheduler alone.

Run them as modules from the repository root, e.g. ``python -m benchmarks.benchmark_comparison``.
They measure; they never assert speed (tests/test_benchmarks.py only checks that the figures
are produced and well-formed).
"""
