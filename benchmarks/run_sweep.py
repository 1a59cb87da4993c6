"""The serving sweep: dvllm serve and the serial/static baselines under the same load, then plots.

The code lives in dvllm/benchmarks/sweep.py (one home for benchmark code); see --help.

    python benchmarks/run_sweep.py                       # tiny-sd, 16x16, 20 steps, guidance 7.5
"""
import sys

from dvllm.benchmarks.sweep import main

if __name__ == "__main__":
    sys.exit(main())
