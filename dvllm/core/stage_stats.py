"""Per-stage busy time and item counts of the workers' steps: the stage metrics (queue, occupancy, time)."""
from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

# The stages a request goes through, as the metrics name them: "encode" and "decode" are the text-encoder and VAE
# work the loop ran itself, "encode_stage" and "decode_stage" what the worker's threads ran
# (dvllm.worker.encode_stage, dvllm.worker.decode_stage).
STAGES = ("encode", "encode_stage", "denoise", "decode", "decode_stage")
# How a worker group ran its denoiser forwards: every row's tokens split, the rows split (CFG-parallel, an elastic
# rows step, or a mesh's row groups), or on the worker alone (a forward with step-cached rows)
GROUP_SPLITS = ("tokens", "rows", "alone")


@dataclass
class StageStats:
    """Busy seconds and items (requests encoded, rows denoised, images decoded) per stage; always on (a clock
    read per stage and step: no device synchronization, so on CUDA the loop's stages count the host's time)."""

    seconds: dict[str, float] = field(default_factory=dict)
    items: dict[str, int] = field(default_factory=dict)
    # Restarts of a stage's parts: "<stage>.thread" (a stage thread that died) and "<stage>.process" (a decode or
    # encode worker process that died), counted where they happen and reported once
    restarts: dict[str, int] = field(default_factory=dict)
    # Of those, the processes that passed a call's bound (stopped, wedged) and were killed, by the same keys
    timeouts: dict[str, int] = field(default_factory=dict)
    group_forwards: dict[str, int] = field(default_factory=dict)  # a worker group's forwards, by GROUP_SPLITS

    def add(self, stage: str, seconds: float, items: int) -> None:
        self.seconds[stage] = self.seconds.get(stage, 0.0) + seconds
        self.items[stage] = self.items.get(stage, 0) + items

    def merge(self, other: StageStats) -> None:
        for stage, seconds in other.seconds.items():
            self.add(stage, seconds, other.items.get(stage, 0))
        for counts, more in ((self.restarts, other.restarts), (self.timeouts, other.timeouts),
                             (self.group_forwards, other.group_forwards)):
            for part, count in more.items():
                counts[part] = counts.get(part, 0) + count

    @contextmanager
    def timing(self, stage: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add(stage, time.perf_counter() - start, 0)
