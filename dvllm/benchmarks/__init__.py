"""Benchmarks that ship with the package, so the installed `dvllm bench` command can run them."""
