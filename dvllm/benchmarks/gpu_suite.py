"""The GPU suite: sd15 (fp16, 512x512, 25 steps) and sd-turbo (1 and 4 steps), serial vs best static
batch vs dvllm at 8 and 32 concurrent requests, with and without CUDA graphs. One table, one JSON.

    python -m dvllm.benchmarks.gpu_suite --output-json suite.json
    python -m dvllm.benchmarks.gpu_suite --dry-run          # the same code on the CPU with tiny-sd, in seconds
Run through benchmarks/gpu/run_suite.sh, which also builds and tests the CUDA kernels.
"""
from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass

from dvllm.benchmarks import throughput


@dataclass(frozen=True)
class Case:
    model: str
    size: str
    steps: int
    guidance: float


GPU_CASES = [Case("sd15", "512x512", 25, 7.5), Case("sd-turbo", "512x512", 1, 0.0), Case("sd-turbo", "512x512", 4, 0.0)]
DRY_CASES = [Case("tiny-sd", "16x16", 3, 7.5), Case("tiny-sd", "16x16", 1, 0.0)]


def case_args(case: Case, requests: int, cuda_graph: bool, dry: bool) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    throughput.add_arguments(parser)
    return parser.parse_args([
        "--model", case.model, "--load-format", "dummy", "--device", "cpu" if dry else "cuda",
        "--dtype", "float32" if dry else "float16", "--size", case.size, "--steps", str(case.steps),
        "--guidance", str(case.guidance), "--num-requests", str(requests), "--rounds", "1",
        "--static-batch-sizes", "4,8,16,32", *(["--cuda-graph"] if cuda_graph else []),
    ])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true", help="tiny-sd on the CPU, to check the script itself")
    parser.add_argument("--output-json", default="gpu_suite.json")
    args = parser.parse_args(argv)
    cases, concurrency = (DRY_CASES, [2, 4]) if args.dry_run else (GPU_CASES, [8, 32])
    graphs = [False] if args.dry_run else [False, True]
    rows, results, start = [], [], time.perf_counter()
    for case in cases:
        for cuda_graph in graphs:
            engine = None  # one engine (one model load) per case and graph mode, sized for the largest run
            for requests in concurrency:
                run_args = case_args(case, requests, cuda_graph, args.dry_run)
                engine = engine or throughput.make_engine(run_args, 2 * max(concurrency))
                result = throughput.run(run_args, engine)
                results.append(result)
                ips = result["images_per_s"]
                rows.append((case, requests, cuda_graph, ips["serial"], ips[result["best_static"]],
                             result["best_static"], ips["dvllm"]))
                print(f"[{time.perf_counter() - start:6.0f}s] {case.model} {case.steps} steps, {requests} concurrent, "
                      f"cuda_graph={cuda_graph}: dvllm {ips['dvllm']:.2f} img/s", flush=True)
    print(f"\n{results[0]['machine']}")
    print(f"{'model':<10}{'steps':>6}{'conc':>6}{'graph':>7}{'serial':>9}{'static':>9}{'(best)':>12}{'dvllm':>9}"
          f"{'vs serial':>11}{'vs static':>11}")
    for case, requests, graph, serial, static, best, dvllm in rows:
        print(f"{case.model:<10}{case.steps:>6}{requests:>6}{str(graph):>7}{serial:>9.2f}{static:>9.2f}{best:>12}"
              f"{dvllm:>9.2f}{dvllm / serial:>10.2f}x{dvllm / static:>10.2f}x")
    with open(args.output_json, "w") as f:
        json.dump(results, f, indent=2)
    print(f"\nwrote {args.output_json} ({time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    main()
