"""Benchmarks: side-by-side measurements in one run (ratios, real tokens/s, peak memory), never timed tests."""
