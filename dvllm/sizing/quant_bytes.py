"""Bytes of a component's weights once --quantization has quantized it, by arithmetic on its Linear layers.

Each backend's layout per Linear weight [out, in] (bias and other layers keep the model's dtype), as the
backend stores it: torchao int8 (int8wo, int8dq) an int8 weight with a float32 scale and an int8 zero point
per output row; float8wo an FP8 weight with a float32 scale per row; float8dq one float32 scale (per-tensor,
torchao's default); int4wo half a byte a weight with a bfloat16 scale and zero per group of group_size
(128). quanto int8/float8: a byte a weight and a scale per row in the model's dtype; int4/int2: half or a
quarter of a byte with a scale and a shift per group of 128. bitsandbytes 8bit: int8 with a float32 scale per
row; 4bit/nf4: half a byte with a float32 absmax per block of 64 (double quantization: an 8-bit absmax and a
float32 one per 256 blocks). torchao's int8wo and float8wo are checked against torchao in
tests/test_memory_estimate.py; quanto's four were read off quanto's tensors on the CPU (2026-12-02); int4wo,
float8dq and bitsandbytes need CUDA to quantize and are arithmetic only.
"""
from __future__ import annotations

import json
import math
from typing import Any

import torch

from dvllm.models.quantization import SHORT_OPTIONS, TORCHAO_TYPES, QuantizationSpec

TORCHAO_KEYS = {"quant_type", "quant_type_kwargs", "modules_to_not_convert"}
BNB_KEYS = {"load_in_4bit", "load_in_8bit", "bnb_4bit_quant_type", "bnb_4bit_use_double_quant",
            "bnb_4bit_compute_dtype", "llm_int8_skip_modules"}
QUANTO_KEYS = {"weights_dtype", "modules_to_not_convert"}


def parse_spec(value: str) -> QuantizationSpec:
    """A --quantization spec (BACKEND[:OPTION] or its JSON form) read for its layout only: the backend's
    package need not be installed here. ValueError for a spec memory_estimate cannot size."""
    text = value.strip()
    if text.startswith("{"):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"quantization: not valid JSON: {e}") from None
        if not isinstance(data, dict) or set(data) - {"backend", "options", "components"}:
            raise ValueError("quantization: the JSON form takes backend, options and components only")
        backend, options, components = data.get("backend"), data.get("options", {}), data.get("components")
        if isinstance(components, str):
            components = [components]
        _check_backend(backend)
        if not isinstance(options, dict):
            raise ValueError(f"quantization: options must be a JSON object, got {options!r}")
        spec = QuantizationSpec(backend, dict(options), tuple(components) if components else None, text)
    else:
        backend, _, option = text.partition(":")
        _check_backend(backend)
        choices = SHORT_OPTIONS[backend]
        if option and option not in choices:
            raise ValueError(f"quantization: {backend} takes one of {list(choices)} after the colon, got {option!r}")
        spec = QuantizationSpec(backend, dict(choices[option or next(iter(choices))]), None, text)
    linear_bytes(spec, 1, 128, 2)  # an option memory_estimate cannot size fails now, not after a model is built
    return spec


def _check_backend(backend: Any) -> None:
    if backend not in SHORT_OPTIONS:
        raise ValueError(f"quantization: unknown backend {backend!r}; memory_estimate sizes {list(SHORT_OPTIONS)}")


def _unknown(spec: QuantizationSpec, allowed: set[str]) -> None:
    extra = sorted(set(spec.options) - allowed)
    if extra:
        raise ValueError(f"quantization {spec}: memory_estimate knows no layout for option(s) {extra}")


def linear_bytes(spec: QuantizationSpec, out_features: int, in_features: int, dtype_bytes: int) -> int:
    """Bytes of one quantized Linear weight [out, in] (bias not included)."""
    numel, opts = out_features * in_features, spec.options
    if spec.backend == "torchao":
        _unknown(spec, TORCHAO_KEYS)
        kind = TORCHAO_TYPES.get(opts.get("quant_type"), opts.get("quant_type"))
        kwargs = opts.get("quant_type_kwargs") or {}
        if kind in ("Int8WeightOnlyConfig", "Int8DynamicActivationInt8WeightConfig") and not kwargs:
            return numel + out_features * (4 + 1)
        if kind == "Float8WeightOnlyConfig" and not kwargs:
            return numel + out_features * 4
        if kind == "Float8DynamicActivationFloat8WeightConfig" and not kwargs:
            return numel + 4
        if kind == "Int4WeightOnlyConfig" and set(kwargs) <= {"group_size"}:
            return numel // 2 + math.ceil(numel / kwargs.get("group_size", 128)) * 2 * 2
        raise ValueError(f"quantization {spec}: memory_estimate knows no layout for torchao {kind!r} "
                         f"with {kwargs or 'its defaults'}; it sizes {list(TORCHAO_TYPES)} at their defaults")
    if spec.backend == "quanto":
        _unknown(spec, QUANTO_KEYS)
        bits = {"int8": 8, "float8": 8, "int4": 4, "int2": 2}.get(opts.get("weights_dtype", "int8"))
        if bits is None:
            raise ValueError(f"quantization {spec}: quanto weights_dtype must be int8, float8, int4 or int2")
        if bits == 8:
            return numel + out_features * dtype_bytes
        return numel * bits // 8 + math.ceil(numel / 128) * 2 * dtype_bytes
    _unknown(spec, BNB_KEYS)
    if opts.get("load_in_8bit"):
        return numel + out_features * 4
    if not opts.get("load_in_4bit"):
        raise ValueError("quantization: bitsandbytes needs options.load_in_4bit or options.load_in_8bit")
    blocks = math.ceil(numel / 64)
    if opts.get("bnb_4bit_use_double_quant"):
        return numel // 2 + blocks + math.ceil(blocks / 256) * 4
    return numel // 2 + blocks * 4


def _skipped(spec: QuantizationSpec) -> list[str]:
    return list(spec.options.get("modules_to_not_convert") or spec.options.get("llm_int8_skip_modules") or [])


def quantized_bytes(module: torch.nn.Module, spec: QuantizationSpec) -> int:
    """The module's parameter and buffer bytes with every Linear weight the backend quantizes (all but the
    modules_to_not_convert, matched as dvllm's torchao path matches them) at its quantized size."""
    skip = _skipped(spec)
    tensors = {id(t): t for t in (*module.parameters(), *module.buffers())}
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    for fqn, layer in module.named_modules():
        if isinstance(layer, torch.nn.Linear) and not any(s in fqn.split(".") or fqn == s for s in skip):
            weight = layer.weight
            total += linear_bytes(spec, *weight.shape, weight.element_size()) - weight.numel() * weight.element_size()
    return total
