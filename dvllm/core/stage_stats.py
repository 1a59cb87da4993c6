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


@dataclass
class StageStats:
    """Busy seconds and items (requests encoded, rows denoised, images decoded) per stage; always on (a clock
    read per stage and step: no device synchronization, so on CUDA the loop's stages count the host's time)."""

    seconds: dict[str, float] = field(default_factory=dict)
    items: dict[str, int] = field(default_factory=dict)
    # Restarts of a stage's parts: "<stage>.thread" (a stage thread that died) and "<stage>.process" (a decode or
    # encode worker process that died), counted where they happen and reported once
    restarts: dict[str, int] = field(default_factory=dict)

    def add(self, stage: str, seconds: float, items: int) -> None:
        self.seconds[stage] = self.seconds.get(stage, 0.0) + seconds
        self.items[stage] = self.items.get(stage, 0) + items

    def merge(self, other: StageStats) -> None:
        for stage, seconds in other.seconds.items():
            self.add(stage, seconds, other.items.get(stage, 0))
        for part, count in other.restarts.items():
            self.restarts[part] = self.restarts.get(part, 0) + count

    @contextmanager
    def timing(self, stage: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add(stage, time.perf_counter() - start, 0)
