"""State-pool ops: dvllm's custom kernels vs their pure-torch references vs no pool at all.

Three contenders per case, run side by side in one process, interleaved round by round,
median of the rounds:

    custom  dvllm.ops.* through the custom op (csrc/)
    ref     dvllm.ops.*_ref (flat-index gathers, what runs when the extension is not built)
    dense   no pool: each request owns its own tensors; a batch is torch.stack of them, and
            results are copied back request by request (the update is stack + sampler_update
            + copies back, unfused)

Cases are SD 1.5-like: 4x64x64 latents, 77x768 prompt embeddings, batches 1, 4, 16, 64,
in blocks of 4096 elements (what dvllm.worker.state_pool picks for SD 1.5), laid out in
shuffled blocks as a long-running pool would be. GB/s is the bytes an op must move (read
+ written) over its time; the plain copy bandwidth of the device is printed for scale.

    python benchmarks/kernels/benchmark_state_ops.py                  # CPU
    python benchmarks/kernels/benchmark_state_ops.py --device cuda --dtypes fp16
"""
from __future__ import annotations

import argparse
import platform
import statistics
import time
from collections.abc import Callable

import torch

from dvllm import ops
from dvllm._extension import custom_ops_available

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
STATES = {"latents": 4 * 64 * 64, "embeds": 77 * 768}
CONTENDERS = ("custom", "ref", "dense")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtypes", default="fp32,fp16", help=f"comma-separated, of {','.join(DTYPES)}")
    p.add_argument("--batches", default="1,4,16,64")
    p.add_argument("--block-numel", type=int, default=4096)
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds; the median is reported")
    p.add_argument("--min-time", type=float, default=0.02, help="seconds each timing runs for at least")
    return p.parse_args()


class Case:
    """One op on one batch, with a callable per contender and the bytes the op must move."""

    def __init__(self, op: str, state: str, dtype: torch.dtype, batch: int, block_numel: int, device: str) -> None:
        self.label = (op, state, str(dtype).removeprefix("torch."), batch)
        numel = STATES[state]
        nb = -(-numel // block_numel)
        gen = torch.Generator().manual_seed(batch)
        pool = torch.randn(2 * batch * nb + 8, block_numel, generator=gen).to(device, dtype)
        blocks = torch.randperm(pool.shape[0], generator=gen)[: 2 * batch * nb].to(torch.int32)
        table, history_table = (t.reshape(batch, nb).to(device) for t in blocks.chunk(2))
        per_request = [torch.randn(numel, generator=gen).to(device, dtype) for _ in range(batch)]
        per_request_history = [torch.randn(numel, generator=gen).to(device, dtype) for _ in range(batch)]
        batch_values = torch.randn(batch, numel, generator=gen).to(device, dtype)
        # AX, AM, CLIP, CS, CM, CX, CH, CN, CH1, CH2: a contraction, so repeated steps keep values bounded and normal.
        coeffs = torch.tensor([[0.9, 0.1, float("inf"), 0.5, 0.05, 0.2, 0.25, 0.0, 0.0, 0.0]],
                              device=device).expand(batch, -1).contiguous()
        es = pool.element_size()

        if op == "gather":
            self.bytes = 2 * batch * numel * es
            self.run: dict[str, Callable[[], object]] = {
                "custom": lambda: ops.gather_blocks(pool, table, numel),
                "ref": lambda: ops.gather_blocks_ref(pool, table, numel),
                "dense": lambda: torch.stack(per_request),
            }
        elif op == "scatter":
            self.bytes = 2 * batch * numel * es

            def dense_scatter() -> None:
                for dst, row in zip(per_request, batch_values, strict=True):
                    dst.copy_(row)
            self.run = {
                "custom": lambda: ops.scatter_blocks(batch_values, pool, table),
                "ref": lambda: ops.scatter_blocks_ref(batch_values, pool, table),
                "dense": dense_scatter,
            }
        else:  # "update": a multistep (DPM-Solver++ 2M-like) step: reads latents, history and the
            # model output, writes latents and history.
            self.bytes = 5 * batch * numel * es
            mo = batch_values

            def dense_update() -> None:
                prev, x0 = ops.sampler_update(torch.stack(per_request)[:, None, None], mo[:, None, None], coeffs,
                                              [torch.stack(per_request_history)[:, None, None]])
                for i in range(batch):
                    per_request[i].copy_(prev[i].view(-1))
                    per_request_history[i].copy_(x0[i].view(-1))
            self.run = {
                "custom": lambda: ops.scatter_update(pool, table, mo, coeffs, history_table),
                "ref": lambda: ops.scatter_update_ref(pool, table, mo, coeffs, history_table),
                "dense": dense_update,
            }


def timed(fn: Callable[[], object], iters: int, device: str) -> float:
    """Seconds per call."""
    synchronize(device)
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    synchronize(device)
    return (time.perf_counter() - start) / iters


def synchronize(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidth(device: str, rounds: int) -> float:
    """GB/s of a plain 256 MiB tensor.copy_ (bytes read + written)."""
    src = torch.ones(64 * 2**20, device=device)
    dst = torch.empty_like(src)
    timed(lambda: dst.copy_(src), 2, device)
    seconds = statistics.median(timed(lambda: dst.copy_(src), 3, device) for _ in range(rounds))
    return 2 * src.numel() * src.element_size() / seconds / 1e9


def main() -> None:
    args = parse_args()
    if not custom_ops_available(args.device):
        raise SystemExit(f"dvllm's custom ops have no {args.device} kernels here (see the warning above)")
    cases = [Case(op, state, DTYPES[d], b, args.block_numel, args.device)
             for d in args.dtypes.split(",") for op, state in [("gather", "latents"), ("gather", "embeds"),
                                                                ("scatter", "latents"), ("update", "latents")]
             for b in (int(x) for x in args.batches.split(","))]
    # Warm up every contender once and size its timing loop to run for about --min-time.
    iters = {}
    for case in cases:
        for name in CONTENDERS:
            once = timed(case.run[name], 1, args.device)
            iters[case.label, name] = max(1, int(args.min_time / max(once, 1e-7)))
    times: dict[tuple, list[float]] = {key: [] for key in iters}
    for _ in range(args.rounds):  # interleaved: machine noise hits every contender alike
        for case in cases:
            for name in CONTENDERS:
                times[case.label, name].append(timed(case.run[name], iters[case.label, name], args.device))

    print(f"{platform.machine()} {args.device}, {torch.get_num_threads()} threads, torch {torch.__version__}, "
          f"block_numel {args.block_numel}; median of {args.rounds} interleaved rounds")
    print(f"plain copy bandwidth (tensor.copy_, 256 MiB): {copy_bandwidth(args.device, args.rounds):.1f} GB/s\n")
    head = f"{'op':<8}{'state':<9}{'dtype':<9}{'batch':>5}"
    head += "".join(f"{name + ' us':>12}{'GB/s':>7}" for name in CONTENDERS)
    print(head + f"{'ref/custom':>12}{'dense/custom':>13}")
    for case in cases:
        median = {name: statistics.median(times[case.label, name]) for name in CONTENDERS}
        op, state, dtype, batch = case.label
        row = f"{op:<8}{state:<9}{dtype:<9}{batch:>5}"
        row += "".join(f"{median[n] * 1e6:>12.1f}{case.bytes / median[n] / 1e9:>7.1f}" for n in CONTENDERS)
        print(row + f"{median['ref'] / median['custom']:>11.2f}x{median['dense'] / median['custom']:>12.2f}x")


if __name__ == "__main__":
    main()
