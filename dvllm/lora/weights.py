"""One LoRA adapter as dvllm applies it: per adapted Linear layer, A [r, in] and B [out, r] already
multiplied by the layer's alpha / r (per Conv2d layer, A [r, in, kh, kw] and B [out, r]).

The file is read the way `pipe.load_lora_weights(path)` reads it (diffusers' key conversions for
every format it knows, alpha from the adapter metadata, else from `.alpha` keys, else alpha = rank),
into a weightless copy of the pipeline (skeleton.py); what peft then holds per layer is taken out.
So a request's weight w adds w * (alpha / r) * B @ A to each layer, as `set_adapters` with weight w does.
"""
from __future__ import annotations

import logging
import math
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch

TEXT_ENCODER_PREFIX = "text_encoder"  # text_encoder, text_encoder_2: adapters there change prompt embeddings


class _Refused(ValueError):
    """dvllm's own refusal, already worded for the user."""


@dataclass(eq=False)
class LoraWeights:
    name: str
    uid: int    # unique per load: a name unloaded and loaded again is another adapter
    path: str
    rank: int   # the largest rank of its layers
    # component ("unet", "transformer", "text_encoder"...) -> module name -> (A, B * alpha / r), on the CPU
    layers: dict[str, dict[str, tuple[torch.Tensor, torch.Tensor]]] = field(repr=False)

    @property
    def has_text_encoder(self) -> bool:
        return any(c.startswith(TEXT_ENCODER_PREFIX) for c in self.layers)


def read_lora(skeleton: Any, name: str, uid: int, path: str, max_rank: int) -> LoraWeights:
    """The adapter at `path` for the skeleton's pipeline; ValueError saying why it cannot be served."""
    key = f"dvllm_{uid}"
    try:
        with _unplaced_weights_are_errors(key):
            skeleton.load_lora_weights(path, adapter_name=key, low_cpu_mem_usage=True)
        layers = _take_layers(skeleton, key, path)
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
    return LoraWeights(name=name, uid=uid, path=path, rank=rank, layers=layers)


def _take_layers(skeleton: Any, key: str, path: str) -> dict[str, dict[str, tuple[torch.Tensor, torch.Tensor]]]:
    from peft.tuners.lora import LoraLayer

    layers: dict[str, dict[str, tuple[torch.Tensor, torch.Tensor]]] = {}
    for component in skeleton._lora_loadable_modules:
        model = getattr(skeleton, component, None)
        if not isinstance(model, torch.nn.Module):
            continue
        for module_name, module in model.named_modules():
            if not isinstance(module, LoraLayer) or key not in module.scaling:
                continue
            where = f"{component}.{module_name}"
            if module.use_dora.get(key) or getattr(module, "lora_bias", {}).get(key) \
                    or key in getattr(module, "lora_variant", {}):
                raise _Refused(f"{path!r}: {where} is a DoRA / biased LoRA layer, which dvllm does not serve")
            base = module.get_base_layer()
            if key not in module.lora_A or not _servable(base):
                raise _Refused(f"{path!r}: {where} is a {type(base).__name__}; dvllm applies LoRA to Linear and "
                               "Conv2d (groups=1) layers only")
            a, b = module.lora_A[key].weight, module.lora_B[key].weight
            scale = module.scaling[key]
            if not math.isfinite(scale):
                raise _Refused(f"{path!r}: {where} has a non-finite alpha / rank ({scale})")
            # Conv2d: A [r, in, kh, kw] (the base layer's kernel, stride, padding), B a 1x1 conv: [out, r]
            layers.setdefault(component, {})[module_name] = (a.detach().float().clone(),
                                                             (b.detach().float().flatten(1) * scale).contiguous())
    return layers


def _servable(base: torch.nn.Module) -> bool:
    if isinstance(base, torch.nn.Linear):
        return True
    return isinstance(base, torch.nn.Conv2d) and base.groups == 1 and base.padding_mode == "zeros"


@contextmanager
def _unplaced_weights_are_errors(key: str) -> Iterator[None]:
    """diffusers only warns about adapter weights that match no module of the model (another model's
    adapter, a module this model lacks); serving the rest would silently differ from what was trained."""
    found: list[str] = []

    class Catch(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            message = record.getMessage()
            if "unexpected keys" in message or ("missing keys" in message and f".{key}." in message):
                found.append(message)

    handler, logger = Catch(logging.WARNING), logging.getLogger("diffusers")
    logger.addHandler(handler)
    try:
        yield
    finally:
        logger.removeHandler(handler)
    if found:
        raise _Refused(f"LoRA weights for modules this model does not have: {found[0][:500]}")
