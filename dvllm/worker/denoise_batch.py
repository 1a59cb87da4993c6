"""Step c-e of an iteration: gather a batch, one denoiser forward, guidance, sampler update, scatter.

Rows are laid out request by request, requests with CFG first, so that the
unconditional half of the forward is one contiguous block and no row is indexed.
"""
from __future__ import annotations

import inspect

import torch
from diffusers.utils.torch_utils import randn_tensor

from dvllm.models.base import Conditions, ModelAdapter
from dvllm.ops import CLIP, sampler_update
from dvllm.worker.request_state import RequestState


def denoise_step(adapter: ModelAdapter, states: list[RequestState], errors: dict[str, str]) -> None:
    """Advance every state by one step. Nothing is written back unless the forward succeeded."""
    states = sorted(states, key=lambda s: not s.data.cfg)  # stable: CFG requests first
    device = adapter.device
    rows = [s.plan.steps[s.step] for s in states]
    repeats = torch.tensor([s.n for s in states])
    table = torch.tensor([(r.timestep, r.c_in, s.data.guidance_scale, *r.coeffs) for r, s in zip(rows, states)],
                         dtype=torch.float32)
    table = table.repeat_interleave(repeats, dim=0).to(device)
    timesteps, c_in, guidance, coeffs = table[:, 0], table[:, 1], table[:, 2], table[:, 3:]

    sample = torch.cat([s.latents for s in states])
    model_in = sample * c_in.to(sample.dtype)[:, None, None, None]
    bounds = _row_bounds(states)
    for s, (lo, hi) in zip(states, bounds):
        if s.fallback is not None:
            model_in[lo:hi] = s.fallback.scale_model_input(sample[lo:hi], s.fallback.timesteps[s.step])

    num_cfg = sum(s.n for s in states if s.data.cfg)
    conditions = _gather_conditions(states)
    if num_cfg:
        model_in = torch.cat([model_in, model_in[:num_cfg]])
        timesteps_in, guidance_in = torch.cat([timesteps, timesteps[:num_cfg]]), torch.cat([guidance, guidance[:num_cfg]])
    else:
        timesteps_in, guidance_in = timesteps, guidance
    out = adapter.denoise(model_in, timesteps_in, conditions, guidance_in)
    if num_cfg:  # as diffusers: uncond + g * (cond - uncond)
        cond, uncond = out[: len(sample)], out[len(sample):]
        g = guidance[:num_cfg, None, None, None].to(out.dtype)
        out = torch.cat([uncond + g * (cond[:num_cfg] - uncond), cond[num_cfg:]])

    noise = _noise(states, rows, sample) if any(r.draws_noise for r in rows) else None
    uses_history = any(s.plan.uses_history for s in states)
    history = torch.cat([_history_or_zeros(s) for s in states]) if uses_history else None
    clip = any(r.coeffs[CLIP] != float("inf") for r in rows)
    prev, x0 = sampler_update(sample, out, coeffs, history, noise, clip)

    for s, (lo, hi) in zip(states, bounds):
        if s.fallback is not None:
            try:
                t = s.fallback.timesteps[s.step]
                kwargs = {"generator": s.generator} if _accepts_generator(s.fallback) else {}
                prev[lo:hi] = s.fallback.step(out[lo:hi], t, sample[lo:hi], return_dict=False, **kwargs)[0]
            except Exception as e:  # this request's sampler failed: only it fails
                errors[s.request_id] = f"sampler {s.plan.name!r} failed: {type(e).__name__}: {e}"
                continue
        s.latents = prev[lo:hi].to(s.latents.dtype)
        if s.plan.uses_history:
            s.history = x0[lo:hi]
        s.step += 1


def _accepts_generator(scheduler) -> bool:
    # As the pipelines' prepare_extra_step_kwargs: only schedulers whose step() takes one get it.
    return "generator" in inspect.signature(scheduler.step).parameters


def _row_bounds(states: list[RequestState]) -> list[tuple[int, int]]:
    bounds, lo = [], 0
    for s in states:
        bounds.append((lo, lo + s.n))
        lo += s.n
    return bounds


def _gather_conditions(states: list[RequestState]) -> Conditions:
    parts = [s.cond for s in states] + [s.uncond for s in states if s.data.cfg]
    counts = [s.n for s in states] + [s.n for s in states if s.data.cfg]
    return {
        key: torch.cat([c[key].expand(n, *c[key].shape[1:]) for c, n in zip(parts, counts)])
        for key in parts[0]
    }


def _noise(states: list[RequestState], rows, sample: torch.Tensor) -> torch.Tensor:
    # Each request draws from its own generator, exactly as its scheduler would in diffusers.
    chunks = []
    for s, row in zip(states, rows):
        shape = (s.n, *sample.shape[1:])
        if row.draws_noise:
            chunks.append(randn_tensor(shape, generator=s.generator, device=sample.device, dtype=sample.dtype))
        else:
            chunks.append(sample.new_zeros(shape))
    return torch.cat(chunks)


def _history_or_zeros(s: RequestState) -> torch.Tensor:
    if s.history is not None:
        return s.history
    return torch.zeros(s.latents.shape, dtype=torch.float32, device=s.latents.device)
