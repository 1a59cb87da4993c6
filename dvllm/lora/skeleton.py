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

from dvllm.lora.weights import EXPECTED_LAYERS
from dvllm.models.loader import dummy_components, resolve_model
from dvllm.models.registry import adapter_for


def skeleton_pipeline(model: str | None, load: Any = None) -> Any:
    source = resolve_model(model, load)
    adapter_cls = adapter_for(source.pipeline_class)
    pipeline_cls = getattr(importlib.import_module("diffusers"), source.pipeline_class)
    components = dummy_components(source, adapter_cls, seed=0, meta=True)
    for component in components.values():
        if isinstance(component, torch.nn.Module):
            _hollow(component)
    for name in getattr(pipeline_cls, "_lora_loadable_modules", ()):
        if not isinstance(components.get(name), torch.nn.Module):
            continue
        if name.startswith("text_encoder"):
            _inject_with_peft(components[name])
        else:
            _record_expected_layers(components[name])
    return pipeline_cls(**components)


def _record_expected_layers(model: torch.nn.Module) -> None:
    """diffusers reports an adapter's weights that match no module of the model only as a log warning, which a
    server's log level may drop. So the denoiser's `load_lora_adapter` first notes which modules the adapter
    names, by diffusers' own key conversion; read_lora compares them with the layers peft placed."""
    from diffusers.utils import convert_unet_state_dict_to_peft

    load = model.load_lora_adapter

    def load_lora_adapter(self: torch.nn.Module, state_dict: Any, prefix: str | None = "transformer", *args: Any,
                          **kwargs: Any) -> Any:
        expected = None  # not known: LoKr (refused later: no LoRA layers), or weights given other than as a dict
        if isinstance(state_dict, dict):
            keys = {k.removeprefix(f"{prefix}."): v for k, v in state_dict.items()
                    if prefix is None or k.startswith(f"{prefix}.")}
            if not any(".lokr_" in k for k in keys):
                if keys and "lora_A" not in next(iter(keys)):  # as diffusers decides it
                    keys = convert_unet_state_dict_to_peft(keys)
                expected = _changing_modules(keys)
        setattr(self, EXPECTED_LAYERS, expected)
        return load(state_dict, prefix, *args, **kwargs)

    model.load_lora_adapter = types.MethodType(load_lora_adapter, model)


def _changing_modules(keys: dict[str, Any]) -> dict[str, bool]:
    """Each module the adapter has weights for, and whether they change it (not all zeros). diffusers adds zeros
    itself: a Wan text-to-video LoRA loaded on image-to-video gets zero weights for the image attention
    (add_k_proj, add_v_proj), which no layer takes where the adapter's saved config names its targets (diffusers
    only warns). They change nothing, placed or not."""
    modules: dict[str, bool] = {}
    for key, value in keys.items():
        if ".lora_" in key:
            module = key.split(".lora_")[0]
            modules[module] = modules.get(module, False) or not (torch.is_tensor(value) and not bool(value.any()))
    return modules


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
