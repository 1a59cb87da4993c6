"""What every family's ControlNet hook on its denoiser shares: a forward pre-hook, given each forward's context by
ForwardHooks, that passes a forward without a ControlPlan through untouched and hands a controlled one's plan to
the family's `run` (which returns the denoiser call's arguments with the controlnets' outputs added)."""
from __future__ import annotations

from typing import Any

import torch

from dvllm.worker.forward_context import DENOISER, ForwardContext, ForwardHooks


class ControlHook:
    def __init__(self, denoiser: torch.nn.Module, hooks: ForwardHooks) -> None:
        self.context: ForwardContext | None = None
        hooks.add(DENOISER, self)
        self.handle = denoiser.register_forward_pre_hook(self, with_kwargs=True)  # (the memory profile removes its own)

    def __call__(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        plan = None if self.context is None else self.context.control
        if plan is None:
            return None
        return self.run(module, plan, args, kwargs)

    def run(self, module: torch.nn.Module, plan: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """The call's (args, kwargs) with the plan's controls' outputs (worker/controlnets.py's ControlPlan)."""
        raise NotImplementedError
