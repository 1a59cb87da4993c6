"""Per-phase step timing, for `--profile`: where an engine step's time goes besides the forward.

Off by default: timing a phase synchronizes the device, which costs throughput.
"""
from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager

import torch

# The phases of one step, in order; "bookkeeping" is what the others leave of the step's wall time.
PHASES = ("schedule", "encode", "gather", "forward", "update_scatter", "decode", "bookkeeping")


class PhaseTimer:
    def __init__(self, enabled: bool, device: torch.device | None = None) -> None:
        self.enabled = enabled
        self.sync = device is not None and device.type == "cuda"
        self.seconds: dict[str, float] = defaultdict(float)

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if not self.enabled:
            yield
            return
        self._synchronize()
        start = time.perf_counter()
        try:
            yield
        finally:
            self._synchronize()
            self.seconds[name] += time.perf_counter() - start

    def _synchronize(self) -> None:
        if self.sync:
            torch.cuda.synchronize()

    def snapshot(self) -> dict[str, float]:
        return dict(self.seconds)


def breakdown(phase_seconds: dict[str, float], total_seconds: float, steps: int) -> dict:
    """Shares of the step time per phase, with bookkeeping as the remainder."""
    seconds = {p: phase_seconds.get(p, 0.0) for p in PHASES if p != "bookkeeping"}
    seconds["bookkeeping"] = max(0.0, total_seconds - sum(seconds.values()))
    outside = total_seconds - seconds["forward"]
    # The engine's own cost: what is neither the denoiser nor the text encoder and VAE it serves.
    engine = sum(seconds[p] for p in ("schedule", "gather", "update_scatter", "bookkeeping"))
    return {
        "steps": steps,
        "total_seconds": total_seconds,
        "seconds": seconds,
        "ms_per_step": {p: 1000 * s / max(steps, 1) for p, s in seconds.items()},
        "share_outside_forward": outside / total_seconds if total_seconds else 0.0,
        "share_engine_overhead": engine / total_seconds if total_seconds else 0.0,
    }
