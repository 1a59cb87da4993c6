"""Benchmarks and baselines (a package so `python -m benchmarks.baselines.server` runs from the repo root)."""
