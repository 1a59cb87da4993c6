"""Parallelism for one request across several workers (issue: worker groups, CFG and sequence parallel)."""
