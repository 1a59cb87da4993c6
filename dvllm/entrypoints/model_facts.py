"""What a client needs to know to ask the served model for something it will run: its defaults, the sizes
and samplers it takes. /v1/models carries it (as `dvllm`, beside vLLM's fields); the playground builds its
menus from it, so it never offers a size the model refuses."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dvllm.models.load_config import LoadedModel
    from dvllm.models.model_info import ModelInfo

# Sides offered besides the default, as multiples of the default's (each rounded to the model's size step)
_SIDE_FACTORS = (0.5, 0.75, 1.0, 1.5, 2.0)


def model_facts(info: ModelInfo, max_image_pixels: int, samplers: list[str],
                loaded: LoadedModel | None = None, max_num_frames: int | None = None) -> dict[str, Any]:
    """info: the served ModelInfo; max_image_pixels: the engine's limit in force; samplers: those that run;
    loaded: where and how the workers hold it (its device, dtypes and quantization); max_num_frames: the
    engine's limit on a video's frames (video models: their default frames and fps are told besides)."""
    step = info.latents.size_factor
    default = (info.defaults.width, info.defaults.height)
    sizes = []
    for factor in _SIDE_FACTORS:
        width, height = (max(step, round(side * factor / step) * step) for side in default)
        size = f"{width}x{height}"
        if width * height <= max_image_pixels and size not in sizes:
            sizes.append(size)
    served = {}
    if loaded is not None:
        served = {"device": loaded.device, "dtype": loaded.dtype, "vae_dtype": loaded.vae_dtype,
                  "encoder_device": loaded.encoder_device, "quantization": loaded.quantization,
                  "custom_ops": loaded.custom_ops}
    return {
        "family": info.family,
        "default_size": f"{default[0]}x{default[1]}",
        "num_inference_steps": info.defaults.steps,
        "guidance_scale": info.defaults.guidance,
        **_second_expert(info),
        "sampler": info.defaults.sampler or info.schedule.config["_class_name"],
        "max_sequence_length": info.text.max_sequence_length,
        "size_multiple": step,
        "max_image_pixels": max_image_pixels,
        "sizes": sizes,
        "samplers": samplers,
        **served,
        **_video_facts(info, max_num_frames),
    }


def _second_expert(info: ModelInfo) -> dict[str, Any]:
    """A two-expert model's default scale for its low-noise expert (its guidance default unless it names one)
    and the timestep below which that expert runs."""
    if info.expert_boundary is None:
        return {}
    second = info.defaults.guidance if info.defaults.guidance_2 is None else info.defaults.guidance_2
    return {"guidance_scale_2": second, "boundary_timestep": info.expert_boundary}


def _video_facts(info: ModelInfo, max_num_frames: int | None) -> dict[str, Any]:
    """A video model's: its default frames and frame rate, the frame rule (num_frames - 1 a multiple of
    frame_multiple) and the most frames a request may ask for."""
    if info.video is None:
        return {}
    video = info.video
    facts = {"num_frames": video.frames, "fps": video.fps, "frame_multiple": video.frame_multiple,
             "seconds": round(video.frames / video.fps, 3)}
    bounds = [b for b in (max_num_frames, video.max_frames) if b is not None]  # the engine's and the model's
    return {"video": {**facts, "max_num_frames": min(bounds)} if bounds else facts}
