"""A new request's start: its first latents (and the input state inpainting and edits keep), drawn from a generator
seeded with its seed, in the order the diffusers pipeline draws them. The loop makes it at admission; for a
request with input images the encode stage may make it ahead (their VAE encode is the cost), and the loop then
takes it with the generator as those draws left it, so the request's next draws are the ones it would have made.
A request's ControlNet controls' inputs are made first (FluxControlNetPipeline draws its control images' VAE
samples before its start noise), in the order of its controls.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from dvllm.core.scheduler_output import StartJob
from dvllm.models.base import ModelAdapter
from dvllm.request_sizes import as_images


@dataclass
class Start:
    latents: torch.Tensor        # [n, *latent shape]
    inputs: torch.Tensor | None  # [n, *input state] (inpainting, edits)
    generator: torch.Generator
    controls: list[torch.Tensor] | None = None  # its controls' inputs, as their controlnets take them


def make_start(adapter: ModelAdapter, job: StartJob, controlnets: dict[str, Any] | None = None) -> Start:
    """(The loop's admission, or the encode stage's thread, while the decode stage may be decoding.)
    `controlnets`: the engine's, by name, which the job's controls name."""
    with adapter.vae_lock:
        return _make_start(adapter, job, controlnets or {})


def _make_start(adapter: ModelAdapter, job: StartJob, controlnets: dict[str, Any]) -> Start:
    generator = torch.Generator("cpu").manual_seed(job.seed)
    controls = [adapter.control_input(c.image, controlnets[c.name], job.n, generator,
                                      controlnets[job.controls[0].name])
                for c in job.controls] if job.controls else None
    inputs = None
    if job.mask is not None:
        x, inputs = adapter.prepare_inpaint(job.image, job.mask, job.n, job.height, job.width, generator, job.plan,
                                            job.strength)
    elif job.edit:  # an edit: its images' latents are its input state
        x, inputs = adapter.prepare_edit(as_images(job.image), job.n, job.height, job.width, generator)
    elif job.num_frames is not None and job.image is not None:  # a video from an image: its condition is the state
        x, inputs = adapter.prepare_image_to_video(job.image, job.n, job.height, job.width, job.num_frames, generator,
                                                   job.plan.init_noise_sigma)
    elif job.num_frames is not None:  # a video
        x = adapter.prepare_video_latents(job.n, job.height, job.width, job.num_frames, generator,
                                          job.plan.init_noise_sigma)
    elif job.image is not None:
        x = adapter.encode_image(job.image, job.n, job.height, job.width, generator, job.plan.start_noise)
    else:
        x = adapter.prepare_latents(job.n, job.height, job.width, generator, job.plan.init_noise_sigma)
    return Start(x, inputs, generator, controls)
