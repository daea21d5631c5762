"""Benchmarks: each measures kvtier and its baseline in one run and prints ratios as JSON."""
