"""Plots of `dvllm bench run` results and step profiles. The code lives in dvllm/benchmarks/plot.py; see --help.

    python benchmarks/plot.py run.json --output-dir benchmarks/results
"""
from dvllm.benchmarks.plot import main

if __name__ == "__main__":
    raise SystemExit(main())
