"""One LoRA adapter as dvllm applies it: per adapted Linear layer, A [r, in] and B [out, r] already
multiplied by the layer's alpha / r (per Conv2d layer, A [r, in, kh, kw] and B [out, r]), and where the adapter
has one, the bias of B (peft's lora_bias: LightX2V's and CausVid's Wan LoRAs carry `diff_b` keys, which diffusers
loads as such), times alpha / r as well.

The file (already located and checked: files.py) is read the way `pipe.load_lora_weights(path)` reads it
(diffusers' key conversions for every format it knows, alpha from the adapter metadata, else from `.alpha`
keys, else alpha = rank), into a weightless copy of the pipeline (skeleton.py); what peft then holds per
layer is taken out. So a request's weight w adds w * (alpha / r) * B @ A to each layer, as `set_adapters`
with weight w does. Weights for modules the model lacks, and weights that are not finite numbers of a sane
size, are refused: served, the first would differ from what was trained, the second paint black images.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from dvllm.lora.files import LoraFile

# Far past any trained adapter's values (of order 1): beyond it an fp16 forward overflows to inf, then NaN.
MAX_ABS_LORA_VALUE = 1e4
TEXT_ENCODER_PREFIX = "text_encoder"  # text_encoder, text_encoder_2: adapters there change prompt embeddings
# Set on a skeleton's denoiser by its load_lora_adapter (skeleton.py): the modules the adapter has weights for,
# each with whether those change it (all zeros do not)
EXPECTED_LAYERS = "_dvllm_lora_expected"


class _Refused(ValueError):
    """dvllm's own refusal, already worded for the user."""


@dataclass(eq=False)
class LoraWeights:
    name: str
    digest: str  # of the file's bytes (lora/ref.py): the slot tables know the adapter by it
    path: str
    rank: int   # the largest rank of its layers
    # component ("unet", "transformer", "text_encoder"...) -> module name -> (A, B * alpha / r), on the CPU
    layers: dict[str, dict[str, tuple[torch.Tensor, torch.Tensor]]] = field(repr=False)
    # component -> module name -> B's bias [out] * alpha / r, for the Linear layers that have one
    biases: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict, repr=False)

    @property
    def has_text_encoder(self) -> bool:
        return any(c.startswith(TEXT_ENCODER_PREFIX) for c in self.layers)


def read_lora(skeleton: Any, name: str, file: LoraFile, max_rank: int, digest: str) -> LoraWeights:
    """The adapter in `file` (whose bytes have `digest`) for the skeleton's pipeline; ValueError saying why it
    cannot be served."""
    key, path = f"dvllm_{digest[:16]}", file.path
    for _, model in _components(skeleton):
        setattr(model, EXPECTED_LAYERS, None)  # set again by this load, where the model's loader runs
    try:
        # One local file, read by the reader of its type only: no pickle fallback for a broken safetensors
        # file, no Hub lookup.
        skeleton.load_lora_weights(path, adapter_name=key, low_cpu_mem_usage=True,
                                   use_safetensors=file.is_safetensors, local_files_only=True)
        layers, biases = _take_layers(skeleton, key, path)
    except _Refused:
        raise
    except Exception as e:  # a missing file, a file that is no LoRA, shapes of another model...
        raise ValueError(f"{path!r} is not a LoRA adapter this {type(skeleton).__name__} can load: "
                         f"{type(e).__name__}: {e}") from None
    finally:
        skeleton.unload_lora_weights()
    if not layers:
        raise ValueError(f"{path!r} has no LoRA weights for any part of this {type(skeleton).__name__} "
                         f"({', '.join(skeleton._lora_loadable_modules)})")
    rank = max(a.shape[0] for m in layers.values() for a, _ in m.values())
    if rank > max_rank:
        raise ValueError(f"LoRA adapter {name!r} has rank {rank}, more than max_lora_rank={max_rank}: "
                         "raise max_lora_rank")
    return LoraWeights(name=name, digest=digest, path=path, rank=rank, layers=layers, biases=biases)


def _take_layers(skeleton: Any, key: str, path: str) -> tuple[dict, dict]:
    """The adapter's layers ({component: {module: (A, B)}}) and B's biases ({component: {module: bias}})."""
    from peft.tuners.lora import LoraLayer

    layers: dict[str, dict[str, tuple[torch.Tensor, torch.Tensor]]] = {}
    biases: dict[str, dict[str, torch.Tensor]] = {}
    for component, model in _components(skeleton):
        placed = set()
        for module_name, module in model.named_modules():
            if not isinstance(module, LoraLayer) or key not in module.scaling:
                continue
            placed.add(module_name)
            where = f"{component}.{module_name}"
            if module.use_dora.get(key) or key in getattr(module, "lora_variant", {}):
                raise _Refused(f"{path!r}: {where} is a DoRA LoRA layer, which dvllm does not serve")
            base = module.get_base_layer()
            if key not in module.lora_A or not servable(base):
                raise _Refused(f"{path!r}: {where} is a {type(base).__name__}; dvllm applies LoRA to Linear and "
                               "Conv2d (groups=1) layers only")
            bias = module.lora_B[key].bias if getattr(module, "lora_bias", {}).get(key) else None
            if bias is not None and not isinstance(base, torch.nn.Linear):
                raise _Refused(f"{path!r}: {where} is a biased LoRA layer on a {type(base).__name__}; dvllm serves "
                               "LoRA biases on Linear layers only")
            a, b = module.lora_A[key].weight, module.lora_B[key].weight
            scale = module.scaling[key]
            if not math.isfinite(scale):
                raise _Refused(f"{path!r}: {where} has a non-finite alpha / rank ({scale})")
            # Conv2d: A [r, in, kh, kw] (the base layer's kernel, stride, padding), B a 1x1 conv: [out, r]
            a, b = a.detach().float().clone(), (b.detach().float().flatten(1) * scale).contiguous()
            _check_values(path, f"{where}.lora_A", a)
            _check_values(path, f"{where}.lora_B (times alpha / rank)", b)
            layers.setdefault(component, {})[module_name] = (a, b)
            if bias is not None:
                bias = (bias.detach().float() * scale).contiguous()
                _check_values(path, f"{where}.lora_B.bias (times alpha / rank)", bias)
                biases.setdefault(component, {})[module_name] = bias
        _check_placed(path, component, getattr(model, EXPECTED_LAYERS, None), placed)
    return layers, biases


def _components(skeleton: Any) -> list[tuple[str, torch.nn.Module]]:
    return [(name, getattr(skeleton, name)) for name in skeleton._lora_loadable_modules
            if isinstance(getattr(skeleton, name, None), torch.nn.Module)]


def _check_values(path: str, where: str, values: torch.Tensor) -> None:
    if not bool(torch.isfinite(values).all()):
        raise _Refused(f"{path!r}: {where} holds non-finite values (NaN or inf)")
    peak = float(values.abs().max()) if values.numel() else 0.0
    if peak > MAX_ABS_LORA_VALUE:
        raise _Refused(f"{path!r}: {where} holds a value of magnitude {peak:.3g}, over {MAX_ABS_LORA_VALUE:g}: "
                       "no trained adapter has such weights, and they overflow a half-precision forward")


def _check_placed(path: str, component: str, expected: dict[str, bool] | None, placed: set[str]) -> None:
    """Every module the adapter has weights for got a layer, unless its weights are all zeros (`expected`: module
    -> whether its weights change it), and no layer was made without weights."""
    if expected is None:
        return
    missing = {name for name in expected.keys() - placed if expected[name]}
    for names, what in ((missing, "weights for modules this model does not have"),
                        (placed - expected.keys(), "layers this model matched but the adapter has no weights for")):
        if names:
            shown = ", ".join(f"{component}.{n}" for n in sorted(names)[:5])
            raise _Refused(f"{path!r}: LoRA {what}: {shown}{', ...' if len(names) > 5 else ''} "
                           f"({len(names)} in all)")


def servable(base: torch.nn.Module) -> bool:
    """A layer dvllm applies LoRA to (worker/lora_layers.py): Linear, or Conv2d with groups=1 and zero padding."""
    if isinstance(base, torch.nn.Linear):
        return True
    return isinstance(base, torch.nn.Conv2d) and base.groups == 1 and base.padding_mode == "zeros"
