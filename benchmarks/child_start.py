"""Start-up with child processes, the fork server against fresh interpreters, side by side.

Each run is a new Python process (nothing warm) that starts an engine whose core runs in a process of its own with
decode and encode workers, generates one image with the built-in model and shuts down; the two modes alternate, and
the figure is the ratio of their medians of the time to the first image (from the interpreter's start, imports
included). The children's imports are most of a start on a CPU machine; on a GPU host, CUDA's own initialisation
adds the same to both.

    python benchmarks/child_start.py [--repeats 3] [--decode-workers 2] [--encode-workers 1]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

RUN = """
import asyncio, json, time
t0 = time.perf_counter()
from dvllm import AsyncDiffusionEngine, SamplingParams

async def main():
    engine = AsyncDiffusionEngine(model="tiny-shapes", device="cpu", engine_core_process=True,
                                  decode_workers={decode}, encode_workers={encode})
    engine.start()
    async for out in engine.generate("a red circle", SamplingParams(num_inference_steps=2, seed=0), "r0"):
        pass
    first = time.perf_counter() - t0
    await engine.shutdown(5)
    return first

print(json.dumps({{"first_image_s": asyncio.run(main())}}))
"""


def run_once(fork_server: bool, decode: int, encode: int) -> dict[str, float]:
    env = {**os.environ, "DVLLM_FORK_SERVER": "" if fork_server else "0", "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", RUN.format(decode=decode, encode=encode)], env=env, check=True,
                         capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--decode-workers", type=int, default=2)
    parser.add_argument("--encode-workers", type=int, default=1)
    args = parser.parse_args()
    runs: dict[bool, list[dict[str, float]]] = {True: [], False: []}
    for _ in range(args.repeats):
        for fork_server in (False, True):
            runs[fork_server].append(run_once(fork_server, args.decode_workers, args.encode_workers))
    children = 1 + args.decode_workers + args.encode_workers
    print(f"an engine with {children} child processes (core, {args.decode_workers} decode, "
          f"{args.encode_workers} encode), median of {args.repeats}:")
    fresh = statistics.median(r["first_image_s"] for r in runs[False])
    forked = statistics.median(r["first_image_s"] for r in runs[True])
    print(f"  time to the first image: fresh interpreters {fresh:.1f} s, fork server {forked:.1f} s, "
          f"ratio {fresh / forked:.2f}x")


if __name__ == "__main__":
    main()
