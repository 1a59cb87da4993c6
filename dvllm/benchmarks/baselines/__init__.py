"""Baseline servers speaking dvllm's HTTP API: `serial` and `static` (see server.py)."""
