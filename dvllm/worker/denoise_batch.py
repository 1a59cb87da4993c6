"""Steps c-e of an iteration: gather a batch from the state pool, one denoiser forward,
guidance, and the fused sampler update that writes straight back into the pool.

Rows are laid out request by request, requests with CFG first, so that the
unconditional half of the forward is one contiguous block and no row is indexed.
"""
from __future__ import annotations

import inspect
import math

import torch
from diffusers.utils.torch_utils import randn_tensor

from dvllm import ops
from dvllm.models.base import ModelAdapter
from dvllm.ops import CLIP
from dvllm.samplers import StepRow
from dvllm.worker.conditions import unflatten
from dvllm.worker.request_state import RequestState, row_bounds
from dvllm.worker.state_pool import StatePool


def denoise_step(adapter: ModelAdapter, pool: StatePool, states: list[RequestState], errors: dict[str, str],
                 previews: dict[str, torch.Tensor]) -> None:
    """Advance every state by one step. The pool is written only after the forward succeeded.
    Requests due for a preview leave their x0 estimate in `previews`."""
    info = adapter.info
    states = sorted(states, key=lambda s: not s.data.cfg)  # stable: CFG requests first
    shape = info.latent_shape(states[0].data.height, states[0].data.width)
    numel = math.prod(shape)
    per_row = (-1,) + (1,) * len(shape)  # broadcasts a per-row scalar over one image's latents
    rows = [s.plan.steps[s.step] for s in states]
    table = _step_table(states, rows).to(pool.device)
    timesteps, c_in, guidance, coeffs = table[:, 0], table[:, 1], table[:, 2], table[:, 3:]

    latent_table = pool.table([r for s in states for r in s.blocks.latents])
    sample = ops.gather_blocks(pool.data, latent_table, numel).view(-1, *shape)
    model_in = sample * c_in.to(sample.dtype).view(per_row)
    bounds = row_bounds(states)
    for s, (lo, hi) in zip(states, bounds):
        if s.fallback is not None and hasattr(s.fallback, "scale_model_input"):  # flow schedulers have none
            model_in[lo:hi] = s.fallback.scale_model_input(sample[lo:hi], s.fallback.timesteps[s.step])

    cfg_states = [s for s in states if s.data.cfg]
    num_cfg = sum(s.n for s in cfg_states)
    cond_rows = [s.blocks.cond for s in states for _ in range(s.n)]
    cond_rows += [s.blocks.uncond for s in cfg_states for _ in range(s.n)]
    conditions = unflatten(pool.read(cond_rows, info.condition_numel), info.condition_shapes)
    if num_cfg:
        model_in = torch.cat([model_in, model_in[:num_cfg]])
        timesteps_in, guidance_in = torch.cat([timesteps, timesteps[:num_cfg]]), torch.cat([guidance, guidance[:num_cfg]])
    else:
        timesteps_in, guidance_in = timesteps, guidance
    out = adapter.denoise(model_in, timesteps_in, conditions, guidance_in, (states[0].data.height, states[0].data.width))
    if num_cfg:  # as diffusers: uncond + g * (cond - uncond)
        cond, uncond = out[: len(sample)], out[len(sample):]
        g = guidance[:num_cfg].to(out.dtype).view(per_row)
        out = torch.cat([uncond + g * (cond[:num_cfg] - uncond), cond[num_cfg:]])

    noise = _noise(states, rows, sample) if any(r.draws_noise for r in rows) else None
    history_table = None
    if any(s.plan.uses_history for s in states):
        history_table = pool.table([r for s in states for r in s.history_rows(len(s.blocks.latents[0]))])
    clip = any(r.coeffs[CLIP] != float("inf") for r in rows)
    for s, (lo, hi) in zip(states, bounds):
        if s.fallback is None and s.step + 1 in s.data.preview_steps:
            previews[s.request_id] = ops.sampler_update(sample[lo:hi], out[lo:hi], coeffs[lo:hi], clip=clip)[1]
    ops.scatter_update(pool.data, latent_table, out.reshape(len(sample), -1), coeffs, history_table,
                       None if noise is None else noise.reshape(len(sample), -1), clip)

    for s, (lo, hi) in zip(states, bounds):
        if s.fallback is not None:  # its rows were left as they were; step them the diffusers way
            try:
                t = s.fallback.timesteps[s.step]
                kwargs = {"generator": s.generator} if _accepts_generator(s.fallback) else {}
                result = s.fallback.step(out[lo:hi], t, sample[lo:hi], **kwargs)
                pool.write(s.blocks.latents, result.prev_sample)
                x0 = getattr(result, "pred_original_sample", None)  # not every scheduler reports one
                if x0 is not None and s.step + 1 in s.data.preview_steps:
                    previews[s.request_id] = x0
            except Exception as e:  # this request's sampler failed: only it fails
                errors[s.request_id] = f"sampler {s.plan.name!r} failed: {type(e).__name__}: {e}"
                continue
        s.step += 1


def _step_table(states: list[RequestState], rows: list[StepRow]) -> torch.Tensor:
    """[R, 3 + NUM_COEFFS] float32: timestep, input scale, guidance, update coefficients per model row."""
    per_request = torch.tensor([(r.timestep, r.c_in, s.data.guidance_scale, *r.coeffs)
                                for r, s in zip(rows, states)], dtype=torch.float32)
    return per_request.repeat_interleave(torch.tensor([s.n for s in states]), dim=0)


def _accepts_generator(scheduler) -> bool:
    # As the pipelines' prepare_extra_step_kwargs: only schedulers whose step() takes one get it.
    return "generator" in inspect.signature(scheduler.step).parameters


def _noise(states: list[RequestState], rows: list[StepRow], sample: torch.Tensor) -> torch.Tensor:
    # Each request draws from its own generator, exactly as its scheduler would in diffusers.
    chunks = []
    for s, row in zip(states, rows):
        shape = (s.n, *sample.shape[1:])
        if row.draws_noise:
            chunks.append(randn_tensor(shape, generator=s.generator, device=sample.device, dtype=sample.dtype))
        else:
            chunks.append(sample.new_zeros(shape))
    return torch.cat(chunks)
