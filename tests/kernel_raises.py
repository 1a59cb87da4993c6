"""The kernels' argument errors (TORCH_CHECK), raised by dvllm's ops called directly. Run as a script, each case
in a process of its own (tests/test_state_ops.py), so that a crash while raising (the H200's segfault of
2026-12-04) fails one test instead of ending the suite; tests/gpu/kernel_errors.sh imports it to replay the
suite's history in one process.
    python tests/kernel_raises.py arguments cpu|cuda
    python tests/kernel_raises.py block_ids
"""
from __future__ import annotations

import re
import sys
from typing import Callable

import torch

from dvllm import _extension
from dvllm.ops import NUM_COEFFS


def expect_error(call: Callable[[], object], pattern: str) -> None:
    try:
        call()
    except RuntimeError as e:
        if not re.search(pattern, str(e)):
            raise AssertionError(f"expected an error matching {pattern!r}, got: {e}") from None
        return
    raise AssertionError(f"expected a RuntimeError matching {pattern!r}; nothing was raised")


def _ops(device: str):
    """torch.ops.dvllm with the kernels for `device` loaded (they load on first use)."""
    if not _extension.custom_ops_available(device):
        raise RuntimeError(f"dvllm's custom ops are not built for {device}")
    return torch.ops.dvllm


def check_arguments(device: str) -> None:
    """Called directly, the ops check what the wrappers would (RuntimeError from TORCH_CHECK)."""
    ops = _ops(device)
    pool, table = torch.zeros(8, 16, device=device), torch.zeros(2, 2, dtype=torch.int32, device=device)
    out, coeffs = torch.zeros(2, 20, device=device), torch.zeros(2, NUM_COEFFS, device=device)
    expect_error(lambda: ops.gather_blocks(out, pool, table.long()), "block_table must be int32")
    expect_error(lambda: ops.scatter_blocks(out, pool, table[:, :1]), r"block_table must have shape \[2, 2\]")
    expect_error(lambda: ops.scatter_update(pool, table, out, coeffs[:, :4], None, None, False),
                 rf"coeffs must have shape \[2, {NUM_COEFFS}\]")
    expect_error(lambda: ops.scatter_update(pool, table, out, coeffs, None, out.double(), False),
                 "noise must be float32 or the pool's dtype")


def check_block_ids() -> None:
    """The CPU kernels refuse a block id outside the pool, and a -1 inside a history row."""
    ops = _ops("cpu")
    pool, out = torch.zeros(8, 16), torch.zeros(2, 20)
    coeffs, table = torch.zeros(2, NUM_COEFFS), torch.tensor([[0, 1], [2, 8]], dtype=torch.int32)
    expect_error(lambda: ops.gather_blocks(out, pool, table), r"block_table\[1, 1\] = 8 is not a block of the pool")
    expect_error(lambda: ops.scatter_blocks(out, pool, table), r"block_table\[1, 1\] = 8")
    history = torch.tensor([[-1, -1], [3, -1]], dtype=torch.int32)  # a row of -1 is fine; a -1 inside a row is not
    expect_error(lambda: ops.scatter_update(pool, table.clamp(max=7), out, coeffs, history[:, None], None, False),
                 r"history_table\[1, 1\] = -1")
    expect_error(lambda: ops.scatter_update(pool, table.clamp(max=7), out, coeffs, history, None, False),
                 r"history_table must be 3-D \[R, K, nb\]")


def main(argv: list[str]) -> int:
    case, device = argv[0], (argv[1] if len(argv) > 1 else "cpu")
    if not _extension.custom_ops_available(device):
        print(f"custom ops not built for {device}", file=sys.stderr)
        return 3
    if case == "arguments":
        check_arguments(device)
    elif case == "block_ids":
        check_block_ids()
    else:
        print(f"unknown case {case!r}", file=sys.stderr)
        return 2
    print(f"{case} {device}: raised as expected", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
