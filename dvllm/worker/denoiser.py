"""The denoiser forward as the runner calls it: eager, torch.compile'd, or replayed from CUDA graphs.

Bucketing pads a batch up to the next bucket (1, 2, 4, 8, then multiples of 8) by repeating its last row
(real data, so no NaN or overflow can come from padding) and drops the extra rows after: each row's output
depends on its own inputs only, so padding changes no result. Not powers of two all the way: a diffusion
forward is compute-bound, and 17 rows padded to 32 would waste 47% of it (to 24: 29%).

The forward is compiled whole (compile dynamic or bucketed), or by its repeated blocks (regional, switched on
around the forwards without LoRA rows; regional_compile.py). Graphs are captured on a key's first forward, or,
with warm_up, at start for every bucket at the model's default size (warm_up.py) and never while serving:
a forward of another key then runs compiled without a graph.

A forward runs in two moves: `plan` says, from the host's layout alone, how many rows it runs and which
captured graph (if any) replays it; the gather then writes the inputs straight into that graph's static
buffers (`Forward.buffers`), and `__call__` replays it. A forward with LoRA rows is captured too (lazily): which
layers run and how is fixed by the rows' adapter structure (the graph's key), while the slots and weights
are data in the plan's tables, copied into the captured plan's before a replay.
"""
from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Protocol

import torch

from dvllm.config import EngineConfig
from dvllm.models.base import Conditions, ModelAdapter, denoisers_of
from dvllm.models.layout import BatchLayout
from dvllm.worker.forward_context import ForwardContext, ForwardHooks
from dvllm.worker.lora_layers import LoraLayers, LoraPlan
from dvllm.worker.regional_compile import RegionalCompile

logger = logging.getLogger(__name__)


BUCKET_STEP = 8


def batch_buckets(max_rows: int) -> list[int]:
    """1, 2, 4, 8, then multiples of 8, up to the first one that holds max_rows (CFG doubles a request's rows)."""
    buckets = [1]
    while buckets[-1] < max_rows:
        last = buckets[-1]
        buckets.append(last * 2 if last < BUCKET_STEP else last + BUCKET_STEP)
    return buckets


@dataclass
class ForwardInputs:
    """One forward's inputs, each [rows, ...]. `flat` is the [rows, numel] tensor whose views the pool's
    conditions are (one gather fills them all); the rest of `conditions` are tensors of their own."""

    latents: torch.Tensor
    timesteps: torch.Tensor
    guidance: torch.Tensor
    conditions: Conditions
    flat: torch.Tensor | None = None

    def args(self) -> tuple:
        return self.latents, self.timesteps, self.conditions, self.guidance


class Replayable(Protocol):
    def replay(self) -> None: ...


# (run the forward once, the graphs' shared memory pool) -> (the captured graph, its output buffer)
Capture = Callable[[Callable[[], torch.Tensor], Any], tuple[Replayable, torch.Tensor]]


def cuda_capture(run: Callable[[], torch.Tensor], pool: Any) -> tuple[Replayable, torch.Tensor]:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm up off the capture: allocator, cuBLAS handles, autotuning
        for _ in range(2):
            run()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    # thread_local: the encode and decode stages' threads go on using CUDA while the step loop captures (under
    # the default, global, any of their calls would break the capture, or fail)
    with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
        output = run()
    return graph, output


@dataclass
class _Graph:
    """One captured forward: its static inputs (the gather writes into them), the graph, its output buffer
    and, for LoRA rows, the plan whose slot and weight tables the graph reads."""

    graph: Replayable
    inputs: ForwardInputs
    output: torch.Tensor
    lora: LoraPlan | None


@dataclass
class Forward:
    """One forward as the denoiser will run it, planned on the host before its inputs are gathered."""

    layout: BatchLayout            # padded to the bucket where the denoiser pads
    rows: int                      # the real rows: the output's
    lora: LoraPlan | None          # the rows' adapters (None: no row has any)
    key: tuple | None = None       # its graph's key (None: not run from a graph)
    graph: _Graph | None = None    # a captured graph for it
    cache: Any = None              # step caching's groups (step_cache_hooks.ForwardCache; None: no row caches)
    control: Any = None            # its controls (controlnets.ControlPlan; None: none acts in it)
    image_prompt: Any = None       # its image prompts (image_prompts.ImagePromptPlan; None: no row has one)

    def context(self) -> ForwardContext | None:
        """A new context for one run of it, given to its hooks (None: no hook has anything to do in it)."""
        if self.lora is None and self.cache is None and self.control is None and self.image_prompt is None:
            return None
        return ForwardContext(layout=self.layout, lora=self.lora, cache=self.cache, control=self.control,
                              image_prompt=self.image_prompt)

    @property
    def buffers(self) -> ForwardInputs | None:
        """Where the gather writes this forward's inputs (None: into tensors of its own)."""
        return None if self.graph is None else self.graph.inputs


class Denoiser:
    def __init__(self, adapter: ModelAdapter, config: EngineConfig, capture: Capture | None = None) -> None:
        """`capture`: how a forward is captured (CUDA's graphs with config.cuda_graph; tests pass a stand-in)."""
        self.adapter = adapter
        self.buckets = batch_buckets(2 * config.max_batch_size)
        self.compiled = None
        backend = config.compile_backend or "inductor"
        if config.compile == "regional":
            self.compiled = RegionalCompile(denoisers_of(adapter.pipeline), backend).wrap(lambda: self.adapter.denoise)
        elif config.compile not in (None, "off"):
            self.compiled = torch.compile(adapter.denoise, dynamic=config.compile == "dynamic", backend=backend)
        if config.cuda_graph and adapter.device.type != "cuda":
            raise ValueError(f"cuda_graph needs a CUDA device, but the model is on {adapter.device}")
        self.capture = capture or (cuda_capture if config.cuda_graph else None)
        self.capture_lazily = not config.warm_up  # warmed up: every graph was captured at start
        self.pad = config.compile == "bucketed" or self.capture is not None
        # Captured graphs, least recently used first; all share one memory pool, so together they hold about
        # one forward's activations (memory_profile.py holds that back), and at most max_cuda_graphs are kept.
        self.graphs: OrderedDict[tuple, _Graph | None] | None = OrderedDict() if self.capture else None
        self.max_graphs = config.max_cuda_graphs
        self.graph_pool = torch.cuda.graph_pool_handle() if config.cuda_graph else None

    @property
    def fn(self) -> Any:
        return self.compiled or self.adapter.denoise  # looked up per call: the adapter's own, as it is now

    def plan(self, layout: BatchLayout, shapes: tuple, lora: LoraLayers, cache: Any = None,
             control: Any = None, image_prompt: Any = None) -> Forward:
        """How `layout`'s forward runs. `shapes`: its inputs' shapes past the rows (part of a graph's key).
        `cache`: its step caching's groups, which decide inside the adapter's own forward, and `control`: its
        controls, whose controlnets run per group in a hook, and `image_prompt`: its IP-Adapter rows, which its
        attention processors read: all eager, unpadded."""
        rows = layout.num_rows
        if cache is not None or control is not None or image_prompt is not None or not self.pad:
            return Forward(layout, rows, lora.plan(layout.row_loras), cache=cache, control=control,
                           image_prompt=image_prompt)
        padded = layout.padded(next((b for b in self.buckets if b >= rows), rows))
        plan = lora.plan(padded.row_loras)
        if self.graphs is None:
            return Forward(padded, rows, plan)
        key = (padded.num_rows, shapes, self.adapter.graph_key(padded), None if plan is None else plan.graph_key)
        graph = self.graphs.get(key)
        if graph is not None:
            self.graphs.move_to_end(key)
        return Forward(padded, rows, plan, key, graph)

    def __call__(self, forward: Forward, inputs: ForwardInputs, hooks: ForwardHooks) -> torch.Tensor:
        """The forward's output on its real rows (`hooks`: those on the pipeline's modules, given the forward's
        context). From a graph, that is a view of the graph's own output buffer: it holds until the next replay
        (denoise_batch copies it where a diffusers scheduler might keep it)."""
        if forward.key is None or (forward.graph is None and not self._captures(forward)):
            return self._run(forward, inputs, hooks)[:forward.rows]  # (no graph: its capture failed, or not now)
        graph = forward.graph or self._capture(forward, inputs, hooks)
        if graph is None:
            return self._run(forward, inputs, hooks)[:forward.rows]
        if inputs is not graph.inputs:  # (only the forward that captured it: the gather wrote its own tensors)
            raise RuntimeError("a graph's inputs must be gathered into its buffers (Forward.buffers)")
        if graph.lora is not None:
            graph.lora.take_values(forward.lora)
        graph.graph.replay()
        return graph.output[:forward.rows]

    def warm(self, forward: Forward, inputs: ForwardInputs) -> bool:
        """Runs a forward without LoRA rows ahead of serving on `inputs` (which become its graph's buffers):
        compiles it, and captures its graph where graphs are on. Whether a graph holds it now."""
        if forward.key is None:
            self.fn(*inputs.args(), forward.layout)
            return False
        if forward.graph is None and forward.key not in self.graphs:
            return self._capture(forward, inputs, None) is not None
        return self.graphs.get(forward.key) is not None

    def _captures(self, forward: Forward) -> bool:
        """Whether a forward with no graph yet gets one captured now (lazily, the first of its key)."""
        return forward.key not in self.graphs and self.capture_lazily

    def _run(self, forward: Forward, inputs: ForwardInputs, hooks: ForwardHooks | None) -> torch.Tensor:
        """The forward run once, a new context given to its hooks for the span (each run of a capture its own:
        what the hooks build from the plan's tables is recorded in the graph). A forward with hooks to run runs
        the adapter's own Python (LoRA layers and step caching run Python per call)."""
        context = forward.context()
        if context is None:
            return self.fn(*inputs.args(), forward.layout)
        with hooks.running(context):
            return self.adapter.denoise(*inputs.args(), forward.layout, context=context)

    def _capture(self, forward: Forward, inputs: ForwardInputs, hooks: ForwardHooks | None) -> _Graph | None:
        """Captures the forward on `inputs`, which become the graph's static buffers (the gather made them
        for this forward alone). None, remembered, where the forward cannot be captured."""
        if len(self.graphs) >= self.max_graphs:
            self.graphs.popitem(last=False)

        try:
            graph, output = self.capture(lambda: self._run(forward, inputs, hooks), self.graph_pool)
        except Exception:  # e.g. a host-to-device copy inside the forward: not capturable
            logger.warning("cannot capture a CUDA graph for %s; running it eagerly", forward.key, exc_info=True)
            self.graphs[forward.key] = None
            return None
        logger.info("captured a CUDA graph for %d rows of %s", forward.layout.num_rows, forward.key[1])
        captured = self.graphs[forward.key] = _Graph(graph, inputs, output, forward.lora)
        return captured

