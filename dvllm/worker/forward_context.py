"""What one forward's hooked modules are given for its span, instead of reading it from a shared object."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ForwardContext:
    """One forward's plans for the modules hooked into the transformer. Today step caching's (`cache`: its
    decisions and state); the place for the forward's BatchLayout, LoRA plan and row scope too, so that every
    hook gets one object passed for the span."""

    cache: Any = None  # step_cache_hooks.ForwardCache (that module gives hooks this context: not imported here)
