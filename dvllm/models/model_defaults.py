"""A model's request defaults, when its pipeline's `__call__` defaults are not what it was made for.

Z-Image-Turbo served with its pipeline's defaults runs 50 steps with CFG, about 12x the compute it was
distilled for. Defaults come, each layer over the one before: the pipeline's; `KNOWN_DEFAULTS` below (facts
from the models' cards, by Hub id, and for the presets of those architectures); a preset's own `defaults` (a
benchmark's settings: wan2.2-t2v-a14b-mlperf); the model folder's (or Hub repo's) `dvllm_defaults.json`; the
engine's `default_params`. What is in force is in ModelInfo.defaults, and so in /v1/models.
"""
from __future__ import annotations

from typing import Any

_TURBO_512 = {"num_inference_steps": 1, "guidance_scale": 0.0, "height": 512, "width": 512}
_WAN22_LIGHTNING_MERGE = {"height": 720, "width": 1280, "num_inference_steps": 4, "guidance_scale": 1.0,
                          "guidance_scale_2": 1.0}
# By Hub id, lower case. Each from the model card's own example call.
KNOWN_DEFAULTS: dict[str, dict[str, Any]] = {
    "tongyi-mai/z-image-turbo": {"num_inference_steps": 9, "guidance_scale": 0.0},  # 9 steps: 8 DiT forwards
    "black-forest-labs/flux.1-schnell": {"num_inference_steps": 4, "guidance_scale": 0.0},
    "stabilityai/sdxl-turbo": _TURBO_512,
    "stabilityai/sd-turbo": _TURBO_512,
    "stabilityai/stable-diffusion-3.5-large-turbo": {"num_inference_steps": 4, "guidance_scale": 0.0},
    # Wan: the pipeline's own defaults are 480x832 and 81 frames for every model
    "wan-ai/wan2.2-ti2v-5b-diffusers": {"height": 704, "width": 1280, "num_frames": 121, "fps": 24},
    "wan-ai/wan2.1-t2v-14b-diffusers": {"height": 720, "width": 1280},
    # the card's example call; Wan's own wan/configs/wan_t2v_A14B.py agrees (40 steps, guidance (3.0, 4.0) for the
    # low- and high-noise experts)
    "wan-ai/wan2.2-t2v-a14b-diffusers": {"height": 720, "width": 1280, "num_inference_steps": 40,
                                         "guidance_scale": 4.0, "guidance_scale_2": 3.0},
    # Wan2.2-T2V-A14B with the Wan2.2-Lightning 4-step LoRA merged in, no CFG (guidance 1.0 for both experts):
    # the card's command, https://huggingface.co/rockapaper/Wan2.2-T2V-A14B-Merge-Lightning-V1.0-Diffusers
    # (a copy of FastDM's repo and card): --guidance-scale 1.0 --height 720 --width 1280 --steps 4
    "fastdm/wan2.2-t2v-a14b-merge-lightning-v1.0-diffusers": _WAN22_LIGHTNING_MERGE,
    "rockapaper/wan2.2-t2v-a14b-merge-lightning-v1.0-diffusers": _WAN22_LIGHTNING_MERGE,
}
# dvllm's presets of those architectures (random weights, for timing) time what the model would run
PRESET_HUB_IDS = {"z-image-turbo": "tongyi-mai/z-image-turbo", "sd-turbo": "stabilityai/sd-turbo",
                  "wan2.2-ti2v-5b": "wan-ai/wan2.2-ti2v-5b-diffusers",
                  "wan2.1-t2v-14b": "wan-ai/wan2.1-t2v-14b-diffusers",
                  "wan2.2-t2v-a14b": "wan-ai/wan2.2-t2v-a14b-diffusers",
                  "wan2.2-t2v-a14b-mlperf": "wan-ai/wan2.2-t2v-a14b-diffusers"}


def known_defaults(name: str) -> dict[str, Any]:
    """The table's defaults for a Hub id or preset name ({} for any other model)."""
    key = name.lower()
    return dict(KNOWN_DEFAULTS.get(PRESET_HUB_IDS.get(key, key), {}))
