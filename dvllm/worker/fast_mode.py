"""Fast mode (EngineConfig.fast): the speed settings a user left unset, chosen once at start for this worker's
device and denoiser, and logged in one line with what was left off and why.

- compile: regional (the repeated blocks, compiled once per block class; regional_compile.py), with the
  backend compile_backend names (inductor by default).
- cuda_graph: on where the device is CUDA, with warm_up: a graph captured at start for every batch bucket at
  the model's default size, none while serving (another shape runs compiled, without a graph).
- attention_backend: the fastest installed that cannot fail here. flash-attn's kernels take no attention mask
  and only half precision: _flash_3 on Hopper, else flash (Ampere and later), for a DiT that attends without
  masks in float16 or bfloat16; native (torch's SDPA, which picks its own flash kernel) otherwise.
- channels_last: on (it changes UNets only).
- FP8 (quantization torchao:float8dq) changes images by design: fast mode leaves quantization as given.
"""
from __future__ import annotations

import dataclasses
import logging

import torch

from dvllm.config import EngineConfig
from dvllm.logging_setup import STARTUP_LOGGER
from dvllm.models.attention_backend import installed_backends, set_attention_backend
from dvllm.models.base import ModelAdapter, denoiser_component, denoiser_of
from dvllm.worker.regional_compile import repeated_block_names

startup = logging.getLogger(STARTUP_LOGGER)  # shown by the CLI at its default levels, as the model's loading

# Denoisers whose attention dvllm's adapters call without a mask (Qwen-Image and Z-Image mask their texts)
MASKLESS_DENOISERS = ("FluxTransformer2DModel", "SD3Transformer2DModel", "WanTransformer3DModel")


def fastest_attention(denoiser: torch.nn.Module, device: torch.device, dtype: torch.dtype) -> tuple[str, str]:
    """(backend, why) for `denoiser` on `device`: probed from what is installed, never one that would fail."""
    if device.type != "cuda":
        return "native", "no CUDA"
    name = type(denoiser).__name__
    if name not in MASKLESS_DENOISERS:
        return "native", f"{name} attends with masks or outside diffusers' backends"
    if dtype not in (torch.float16, torch.bfloat16):
        return "native", f"flash kernels take half precision, the model runs in {str(dtype).removeprefix('torch.')}"
    installed, (major, _) = installed_backends(), torch.cuda.get_device_capability(device)
    if major == 9 and "_flash_3" in installed:
        return "_flash_3", "Hopper"
    if major >= 8 and "flash" in installed:
        return "flash", "flash-attn installed"
    return "native", "no flash-attn kernel installed for this GPU"


def settle(config: EngineConfig, adapter: ModelAdapter) -> EngineConfig:
    """The config with compile, cuda_graph, warm_up, channels_last and (fast) attention_backend concrete, and
    the loaded denoiser put in that memory format and attention backend."""
    values = _resolve(config, adapter) if config.fast else {}
    values = {"compile": config.compile or "off", "cuda_graph": bool(config.cuda_graph),
              "warm_up": bool(config.warm_up), "channels_last": bool(config.channels_last), **values}
    settled = dataclasses.replace(config, **values)
    if settled.attention_backend != config.attention_backend and settled.attention_backend != "native":
        set_attention_backend(adapter.pipeline, settled.attention_backend)  # (the loader set the user's)
    if settled.channels_last and denoiser_component(adapter.pipeline) == "unet":
        denoiser_of(adapter.pipeline).to(memory_format=torch.channels_last)
    return settled


def _resolve(config: EngineConfig, adapter: ModelAdapter) -> dict:
    """Fast mode's choices for what the user left unset, and the line saying them."""
    device, denoiser = adapter.device, denoiser_of(adapter.pipeline)
    cuda, unet = device.type == "cuda", denoiser_component(adapter.pipeline) == "unet"
    on, off, values = [], [], {}
    if config.compile is None:
        blocks = repeated_block_names(denoiser)
        values["compile"] = "regional" if blocks else "dynamic"
        on.append(f"compile regional ({', '.join(blocks)})" if blocks else "compile dynamic (no repeated blocks)")
    if config.cuda_graph is None:
        values["cuda_graph"] = cuda
        (on if cuda else off).append("CUDA graphs" + ("" if cuda else " (no CUDA)"))
    if config.warm_up is None:
        values["warm_up"] = True
        on.append("start-up " + ("graph capture for the batch buckets" if values.get("cuda_graph", config.cuda_graph)
                                 else "compile") + " at the default size")
    if config.attention_backend is None:
        values["attention_backend"], why = fastest_attention(denoiser, device, adapter.dtype)
        on.append(f"attention {values['attention_backend']} ({why})")
    if config.channels_last is None:
        values["channels_last"] = True
        (on if unet else off).append("channels-last" + ("" if unet else " (not a UNet)"))
    if config.quantization is None:
        off.append("FP8 (not asked: --quantization torchao:float8dq, CUDA 8.9+)")
    given = [name for name in ("compile", "cuda_graph", "warm_up", "attention_backend", "channels_last")
             if name not in values]
    startup.info("fast mode: on: %s; off: %s%s", ", ".join(on) or "nothing", ", ".join(off) or "nothing",
                f"; as given: {', '.join(given)}" if given else "")
    return values
