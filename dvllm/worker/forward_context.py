"""One forward's context, given to every hook of the modules it runs, instead of read from shared objects.

A forward whose rows differ (LoRA rows, step-cached rows) runs its modules through hooks: diffusers' hook
registry for the LoRA layers and the cache's blocks, torch's pre- and post-hooks for a worker group's shared
call. Each such hook has a `context` attribute, None between forwards; `ForwardHooks.running` gives one
forward's ForwardContext to the hooks of the part it runs (the denoiser, or the text encoders) for its span, as
diffusers' registry gives its hooks their cache context. Hooks keep nothing of a forward past it: what they
compute once per forward (a LoRA plan's row views) lives in the context's `memo`.

The two parts are apart because the encode stage's thread runs the text encoders' LoRA plans while the step loop
runs the denoiser's; a part runs one forward at a time (the text encoders under the prompt writer's lock).
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, ContextManager, Iterator, Protocol

from dvllm.worker.row_scope import RowScope

DENOISER = "denoiser"
TEXT_ENCODERS = "text encoders"


def part_of(component: str) -> str:
    """Which part of a pipeline a component belongs to, for the hooks on its modules."""
    return TEXT_ENCODERS if component.startswith("text_encoder") else DENOISER


@dataclass
class ForwardContext:
    """What the hooked modules of one forward are given: its layout, its LoRA plan, its step caching's groups,
    its controls, the rows a module runs on now (step caching and per-shape calls narrow them), and the per-forward memo."""

    layout: Any = None  # models.layout.BatchLayout (None: a text encoder's call)
    lora: Any = None    # lora_layers.LoraPlan (None: no row has adapters)
    cache: Any = None   # step_cache_hooks.ForwardCache (None: no row caches)
    control: Any = None  # controlnets.ControlPlan (None: no row has a control acting now)
    image_prompt: Any = None  # image_prompts.ImagePromptPlan (None: no row has an IP-Adapter image prompt)
    rows: RowScope = field(default_factory=RowScope)
    memo: dict = field(default_factory=dict)

    def narrow(self, rows: list[int], index: Any) -> ContextManager[None]:
        """Runs what is inside on `rows` of the rows running now (`index`: the same on the device)."""
        return self.rows.narrow(rows, index)


class ContextHook(Protocol):
    context: ForwardContext | None


class ForwardHooks:
    """The hooks that take a forward's context, by part: whoever installs a hook adds it here."""

    def __init__(self) -> None:
        self._hooks: dict[str, list[ContextHook]] = {DENOISER: [], TEXT_ENCODERS: []}

    def add(self, part: str, hook: ContextHook) -> None:
        hook.context = None
        self._hooks[part].append(hook)

    def context_of(self, part: str) -> ForwardContext | None:
        """The context the part's hooks hold now (None: no forward of it runs, or it has no hooks)."""
        hooks = self._hooks[part]
        return hooks[0].context if hooks else None

    @contextmanager
    def running(self, context: ForwardContext | None, part: str = DENOISER) -> Iterator[None]:
        """Gives `context` to the part's hooks for the span (None: they pass every call through)."""
        hooks = self._hooks[part]
        if context is None or not hooks:
            yield
            return
        if hooks[0].context is not None:  # (every hook of a part has the same one)
            raise RuntimeError(f"a forward of the {part} runs already: a part runs one forward at a time")
        for hook in hooks:
            hook.context = context
        try:
            yield
        finally:
            for hook in hooks:
                hook.context = None
