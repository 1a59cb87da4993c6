"""Serving benchmark: an async HTTP load generator for any server speaking dvllm's Images API.

The same as `dvllm bench serve` (the code lives in dvllm/benchmarks/serving.py so the installed
command can run it); see `python benchmarks/benchmark_serving.py --help`.

    python benchmarks/benchmark_serving.py --base-url http://127.0.0.1:8000 --num-requests 64 --request-rate 8
"""
import sys

from dvllm.benchmarks.serving import cli

if __name__ == "__main__":
    sys.exit(cli())
