"""The denoiser's attention kernel: diffusers' attention backends (`set_attention_backend`: native, flash,
flash 3, sage, xformers, cuDNN, ...), chosen once at load and refused at start when its package is missing.

The transformer families' attention processors dispatch through diffusers' `dispatch_attention_fn`, and so do
dvllm's own (Qwen edits' padded rows, models/qwen_rows.py). The UNet families' processors call torch's SDPA
directly: for them "xformers" is diffusers' `enable_xformers_memory_efficient_attention`, "native" is the
default, and any other backend is refused. diffusers also keeps the backend set as its process-wide active one
(what a processor that names none uses): one engine per process, as `dvllm serve` and Ray workers run.
"""
from __future__ import annotations

from typing import Any

UNET_BACKENDS = ("native", "xformers")


def installed_backends() -> list[str]:
    """Backends whose packages are installed here (a GPU-only kernel is listed where its package is)."""
    from diffusers.models.attention_dispatch import AttentionBackendName, _check_attention_backend_requirements

    names = []
    for backend in AttentionBackendName:
        try:
            _check_attention_backend_requirements(backend)
        except Exception:  # noqa: BLE001  (a missing package or too old a version: not installed)
            continue
        names.append(backend.value)
    return names


def check_backend_name(name: str) -> None:
    """A name diffusers knows (ValueError listing them otherwise): the flag is checked before the model loads."""
    from diffusers.models.attention_dispatch import AttentionBackendName

    known = [b.value for b in AttentionBackendName]
    if name not in known:
        from dvllm.sampler_names import did_you_mean

        raise ValueError(f"attention_backend {name!r} is not one of diffusers' attention backends"
                         f"{did_you_mean(name, known)}; known: {', '.join(known)}")


def set_attention_backend(pipeline: Any, name: str | None) -> None:
    """Puts the pipeline's denoiser on backend `name` (None: leave the model's own); ValueError naming what
    is installed when that backend is not."""
    if name is None:
        return
    check_backend_name(name)
    installed = installed_backends()
    if name not in installed:
        extra = " (pip install 'dvllm[xformers]')" if name == "xformers" else ""
        raise ValueError(f"attention_backend {name!r} is not installed here{extra}; installed: {', '.join(installed)}")
    transformer = getattr(pipeline, "transformer", None)
    if transformer is not None:
        transformer.set_attention_backend(name)
        return
    if name not in UNET_BACKENDS:
        raise ValueError(f"attention_backend {name!r}: a UNet's attention does not go through diffusers' backends; "
                         f"it takes {' or '.join(UNET_BACKENDS)}")
    if name == "xformers":
        pipeline.enable_xformers_memory_efficient_attention()
