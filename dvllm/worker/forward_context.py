"""What one forward's hooked modules are given for its span, instead of reading it from a shared object."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dvllm.worker.step_cache_hooks import ForwardCache


@dataclass(frozen=True)
class ForwardContext:
    """One forward's plans for the modules hooked into the transformer. Today step caching's (`cache`: its
    decisions and state); the place for the forward's BatchLayout, LoRA plan and row scope too, so that every
    hook gets one object passed for the span."""

    cache: "ForwardCache | None" = None
