"""A weightless copy of the served pipeline that diffusers' `load_lora_weights` can load adapters into.

Every module is built on the meta device, then each parameter and buffer is replaced by a zero-stride
CPU tensor: no memory, but a real device, so peft leaves the adapter weights it loads on the CPU (it moves
an adapter to its base layer's device, which on meta would drop the values). The model is never touched:
adapters are read here, on the driver, while the workers keep stepping.
"""
from __future__ import annotations

import importlib
import types
from typing import Any

import torch

from dvllm.models.loader import dummy_components, resolve_model
from dvllm.models.registry import adapter_for


def skeleton_pipeline(model: str | None) -> Any:
    source = resolve_model(model)
    adapter_cls = adapter_for(source.pipeline_class)
    pipeline_cls = getattr(importlib.import_module("diffusers"), source.pipeline_class)
    components = dummy_components(source, adapter_cls, seed=0, meta=True)
    for component in components.values():
        if isinstance(component, torch.nn.Module):
            _hollow(component)
    for name in getattr(pipeline_cls, "_lora_loadable_modules", ()):
        if name.startswith("text_encoder") and isinstance(components.get(name), torch.nn.Module):
            _inject_with_peft(components[name])
    return pipeline_cls(**components)


def _hollow(module: torch.nn.Module) -> None:
    for m in module.modules():
        for key, p in m._parameters.items():
            if p is not None:
                m._parameters[key] = torch.nn.Parameter(torch.zeros((), dtype=torch.float32).expand(p.shape),
                                                        requires_grad=False)
        for key, b in m._buffers.items():
            if b is not None:
                m._buffers[key] = torch.zeros((), dtype=b.dtype).expand(b.shape)


def _inject_with_peft(text_encoder: torch.nn.Module) -> None:
    """diffusers hands text-encoder adapters (already converted to peft's format) to transformers'
    `load_adapter`, which only forwards them to peft but refuses peft releases older than it expects. On
    the skeleton, the same two peft calls are made directly; unplaced weights are an error, not a warning."""

    def load_adapter(self: torch.nn.Module, adapter_name: str, peft_config: Any, adapter_state_dict: dict,
                     low_cpu_mem_usage: bool = False, **_: Any) -> None:
        from peft import inject_adapter_in_model, set_peft_model_state_dict

        inject_adapter_in_model(peft_config, self, adapter_name=adapter_name, low_cpu_mem_usage=low_cpu_mem_usage)
        result = set_peft_model_state_dict(self, adapter_state_dict, adapter_name, low_cpu_mem_usage=low_cpu_mem_usage)
        unexpected = [k for k in getattr(result, "unexpected_keys", []) if "lora_" in k]
        if unexpected:
            raise ValueError(f"weights for modules the text encoder does not have: {unexpected[:5]}")

    text_encoder.load_adapter = types.MethodType(load_adapter, text_encoder)
