"""Benchmark helpers: statistics and result reports."""
