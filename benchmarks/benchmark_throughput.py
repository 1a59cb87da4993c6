"""Offline throughput, serial vs static batching vs dvllm: see dvllm/benchmarks/throughput.py.

    python benchmarks/benchmark_throughput.py                              # tiny-sd, 8 requests, 20 steps, CFG, 16x16
    python benchmarks/benchmark_throughput.py --workload mixed --num-requests 16
    python benchmarks/benchmark_throughput.py --num-requests 32 --profile  # where dvllm's step time goes
    python benchmarks/benchmark_throughput.py --model sd15 --load-format dummy --size 512x512 --num-requests 32
    python benchmarks/benchmark_throughput.py --executor ray --num-workers 2   # in-process vs 1 and 2 Ray workers
    python benchmarks/benchmark_throughput.py --model flux-cpu --size 32x32 --num-requests 16 --loras 8  # multi-LoRA
(also `dvllm bench throughput ...`)
"""
from dvllm.benchmarks.throughput import main

if __name__ == "__main__":
    main()
