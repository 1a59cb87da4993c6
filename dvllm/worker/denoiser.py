"""The denoiser forward as the runner calls it: eager, torch.compile'd, or replayed from CUDA graphs.

Bucketing pads a batch up to the next bucket (1, 2, 4, 8, then multiples of 8) by repeating its last row
(real data, so no NaN or overflow can come from padding) and drops the extra rows after: each row's output
depends on its own inputs only, so padding changes no result. Not powers of two all the way: a diffusion
forward is compute-bound, and 17 rows padded to 32 would waste 47% of it (to 24: 29%).
"""
from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Any

import torch

from dvllm.config import EngineConfig
from dvllm.models.base import Conditions, ModelAdapter
from dvllm.models.layout import BatchLayout

logger = logging.getLogger(__name__)


BUCKET_STEP = 8


def batch_buckets(max_rows: int) -> list[int]:
    """1, 2, 4, 8, then multiples of 8, up to the first one that holds max_rows (CFG doubles a request's rows)."""
    buckets = [1]
    while buckets[-1] < max_rows:
        last = buckets[-1]
        buckets.append(last * 2 if last < BUCKET_STEP else last + BUCKET_STEP)
    return buckets


class Denoiser:
    def __init__(self, adapter: ModelAdapter, config: EngineConfig) -> None:
        self.adapter = adapter
        self.buckets = batch_buckets(2 * config.max_batch_size)
        self.pad = config.compile == "bucketed" or config.cuda_graph
        self.compiled = None
        if config.compile != "off":
            self.compiled = torch.compile(adapter.denoise, dynamic=config.compile == "dynamic")
        if config.cuda_graph and adapter.device.type != "cuda":
            raise ValueError(f"cuda_graph needs a CUDA device, but the model is on {adapter.device}")
        # Captured graphs, least recently used first; all share one memory pool, so together they hold about
        # one forward's activations (memory_profile.py holds that back), and at most max_cuda_graphs are kept.
        self.graphs: OrderedDict[tuple, _Graph | None] | None = OrderedDict() if config.cuda_graph else None
        self.max_graphs = config.max_cuda_graphs
        self.graph_pool = torch.cuda.graph_pool_handle() if config.cuda_graph else None

    @property
    def fn(self) -> Any:
        return self.compiled or self.adapter.denoise  # looked up per call: the adapter's own, as it is now

    def __call__(self, latents: torch.Tensor, timesteps: torch.Tensor, conditions: Conditions,
                 guidance: torch.Tensor, layout: BatchLayout) -> torch.Tensor:
        if not self.pad:
            return self.fn(latents, timesteps, conditions, guidance, layout)
        rows = len(latents)
        bucket = next((b for b in self.buckets if b >= rows), rows)
        layout = layout.padded(bucket)

        def padded() -> tuple:
            return (_pad(latents, bucket), _pad(timesteps, bucket),
                    {k: _pad(v, bucket) for k, v in conditions.items()}, _pad(guidance, bucket))

        if self.graphs is None:
            return self.fn(*padded(), layout)[:rows]
        key = (bucket, tuple(latents.shape[1:]), self.adapter.graph_key(layout),
               tuple((k, v.shape[1:]) for k, v in conditions.items()))
        if key not in self.graphs:
            if len(self.graphs) >= self.max_graphs:
                self.graphs.popitem(last=False)
            try:
                self.graphs[key] = _Graph.capture(self.fn, padded(), layout, self.graph_pool)
            except Exception:  # e.g. a host-to-device copy inside the forward: not capturable
                logger.warning("cannot capture a CUDA graph for %s; running it eagerly", key, exc_info=True)
                self.graphs[key] = None
        self.graphs.move_to_end(key)
        graph = self.graphs[key]
        if graph is None:
            return self.fn(*padded(), layout)[:rows]
        return graph.replay((latents, timesteps, conditions, guidance))[:rows]


def _pad(t: torch.Tensor, rows: int) -> torch.Tensor:
    if len(t) == rows:
        return t
    return torch.cat([t, t[-1:].expand(rows - len(t), *t.shape[1:])])


class _Graph:
    """One captured forward: static input buffers, the graph, its output buffer."""

    def __init__(self, graph: torch.cuda.CUDAGraph, inputs: list[torch.Tensor], output: torch.Tensor) -> None:
        self.graph, self.inputs, self.output = graph, inputs, output

    @classmethod
    def capture(cls, fn: Any, args: tuple, layout: BatchLayout, pool: Any = None) -> "_Graph":
        latents, timesteps, conditions, guidance = (a.clone() if torch.is_tensor(a) else
                                                    {k: v.clone() for k, v in a.items()} for a in args)
        inputs = [latents, timesteps, guidance, *conditions.values()]
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm up off the capture: allocator, cuBLAS handles, autotuning
            for _ in range(2):
                fn(latents, timesteps, conditions, guidance, layout)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            output = fn(latents, timesteps, conditions, guidance, layout)
        logger.info("captured a CUDA graph for %d rows of %s", len(latents), tuple(latents.shape[1:]))
        return cls(graph, inputs, output)

    def replay(self, args: tuple) -> torch.Tensor:
        """The forward on `args` (rows up to the bucket): each input is copied once, straight into its static
        buffer, and the rows past it filled with its last row (no padded copy in between). Returns the
        graph's own output buffer, without a copy: it holds until the next replay, and a step uses it before
        then (denoise_batch copies it where a diffusers scheduler might keep it)."""
        latents, timesteps, conditions, guidance = args
        for buffer, value in zip(self.inputs, [latents, timesteps, guidance, *conditions.values()]):
            n = len(value)
            buffer[:n].copy_(value)
            if n < len(buffer):
                buffer[n:].copy_(value[-1:].expand(len(buffer) - n, *value.shape[1:]))
        self.graph.replay()
        return self.output
