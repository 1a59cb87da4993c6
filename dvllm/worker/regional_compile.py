"""Regional compile: each of the denoiser's repeated blocks torch.compile'd, as diffusers'
`compile_repeated_blocks` does, but switched on only around a plain forward.

diffusers compiles the blocks in place (`Module.compile`), so every call of a block would run the compiled
code, a LoRA or step-cache forward too: their hooks read per-forward plans (rows, slots, cache decisions)
that dynamo would guard on and recompile for at every step. Here each block keeps both: its compiled call is
installed for the forwards without LoRA or step-cached rows (`active`), and those run the blocks as they are,
hooks and all, so every combination is served and those rows are computed exactly as without compile.

The blocks of a class share their code, so dynamo compiles it once per class and shape family (its automatic
dynamic shapes take a second batch size as dynamic): the compile takes seconds where the whole denoiser's
takes minutes.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch

# Denoisers of dvllm's families whose diffusers class declares no _repeated_blocks: the blocks repeated in them
FALLBACK_BLOCKS = {"SD3Transformer2DModel": ("JointTransformerBlock", "SD3SingleTransformerBlock")}


def repeated_block_names(model: torch.nn.Module) -> tuple[str, ...]:
    """The class names of `model`'s repeated blocks (empty: it has none we know of)."""
    names = tuple(getattr(model, "_repeated_blocks", None) or ())
    return names or FALLBACK_BLOCKS.get(type(model).__name__, ())


class RegionalCompile:
    def __init__(self, models: list[torch.nn.Module], backend: str, dynamic: bool | None = None) -> None:
        self.blocks = [m for model in models for names in [repeated_block_names(model)]
                       for m in model.modules() if type(m).__name__ in names]
        if not self.blocks:
            raise ValueError(f"compile='regional': {type(models[0]).__name__} has no repeated blocks to compile "
                             f"(diffusers' _repeated_blocks); use compile='dynamic' or 'bucketed' for it")
        self.classes = sorted({type(m).__name__ for m in self.blocks})
        # what Module.compile installs, made once per block and kept aside until a forward asks for it
        self._compiled = [torch.compile(block._call_impl, backend=backend, dynamic=dynamic) for block in self.blocks]

    @contextmanager
    def active(self) -> Iterator[None]:
        """The blocks run compiled inside (nn.Module.__call__ takes `_compiled_call_impl` when one is set)."""
        for block, compiled in zip(self.blocks, self._compiled):
            block._compiled_call_impl = compiled
        try:
            yield
        finally:
            for block in self.blocks:
                block._compiled_call_impl = None

    def wrap(self, fn: Callable[[], Callable[..., Any]]) -> Callable[..., Any]:
        """A forward that calls fn() (looked up per call) with the blocks compiled."""
        def forward(*args: Any, **kwargs: Any) -> Any:
            with self.active():
                return fn()(*args, **kwargs)
        return forward
