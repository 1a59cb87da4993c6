"""The elastic group policy's view of time: how long a running request's remaining steps take at the present pace
and alone, from the worker's recent step and decode times, and so which requests are late."""
from __future__ import annotations

import math
import time
from typing import Any

from dvllm.core.request import Request
from dvllm.core.scheduler_output import RunnerOutput


def _average(last: float | None, now: float) -> float:
    return now if last is None else 0.5 * (last + now)


class Pace:
    def __init__(self) -> None:
        # Per latent shape: the recent steps' seconds per row on the worker (a moving average)
        self.row_seconds: dict[tuple[int, int], float] = {}
        self.decode_seconds_per_pixel: float | None = None  # the recent decodes'
        self.late_steps = 0  # steps run for late requests ahead of the rest

    def measure(self, batch: list[Request], rows: int, runner_out: RunnerOutput, requests: dict[str, Any]) -> None:
        """A step's seconds per row (for its shape: its denoise stage's seconds, without the step's encodes and
        decodes, which the decode's own rate counts), and the decode's seconds per pixel from the images this
        output brings and the decode time it reports."""
        denoise = runner_out.stages.seconds.get("denoise", 0.0)
        if batch and rows and denoise > 0:
            shape = batch[0].shape_key
            self.row_seconds[shape] = _average(self.row_seconds.get(shape), denoise / rows)
        seconds = sum(runner_out.stages.seconds.get(stage, 0.0) for stage in ("decode", "decode_stage"))
        pixels = sum(math.prod(r.params.size) * len(images) for r, images in
                     ((requests.get(rid), images) for rid, images in runner_out.images.items()) if r is not None)
        if seconds > 0 and pixels:
            self.decode_seconds_per_pixel = _average(self.decode_seconds_per_pixel, seconds / pixels)

    def late(self, groups: dict[tuple[int, int], list[Request]]) -> list[Request]:
        """Requests that would miss their deadline at the present pace (each step of theirs waits for one step
        of every shape's ready rows, at the recent seconds per row; then its decode) but would meet it stepping
        alone."""
        if not self.row_seconds:
            return []
        known = max(self.row_seconds.values())  # a shape not measured yet: as slow as the slowest
        per_row = {shape: self.row_seconds.get(shape, known) for shape in groups}
        pace = sum(per_row[shape] * sum(r.rows for r in group) for shape, group in groups.items())
        now, late = time.time(), []
        for shape, group in groups.items():
            for r in group:
                due, left = r.deadline_time, r.num_steps - r.steps_scheduled
                if due is None:
                    continue
                decode = r.params.n * shape[0] * shape[1] * (self.decode_seconds_per_pixel or 0.0)
                if now + left * r.rows * per_row[shape] + decode <= due < now + left * pace + decode:
                    late.append(r)
        return late
