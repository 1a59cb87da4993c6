"""Steps c-e of an iteration: gather a batch from the state pool, one denoiser forward,
guidance, and the fused sampler update that writes straight back into the pool.

Rows are laid out request by request, requests with CFG first, so that the
unconditional half of the forward is one contiguous block and no row is indexed
(models/layout.py: BatchLayout says which row is whose).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from dvllm import ops
from dvllm.host_copy import copy_to, device_index, to_device
from dvllm.models.base import ModelAdapter, ModelInfo
from dvllm.models.layout import BatchLayout
from dvllm.ops import AM, CLIP
from dvllm.profiler import PhaseTimer
from dvllm.samplers import StepRow
from dvllm.worker.conditions import unflatten
from dvllm.worker.controlnets import ControlPlanner
from dvllm.worker.denoiser import Denoiser, Forward, ForwardInputs
from dvllm.worker.first_frame import hold_first_frame
from dvllm.worker.forward_context import ForwardHooks
from dvllm.worker.image_prompts import image_prompt_plan
from dvllm.worker.lora_layers import LoraLayers
from dvllm.worker.model_dtype_product import x0_terms
from dvllm.worker.request_state import RequestState, row_bounds
from dvllm.worker.state_pool import StatePool
from dvllm.worker.step_cache_hooks import CacheHooks, forward_cache


@dataclass
class Batch:
    states: list[RequestState]  # CFG requests first
    layout: BatchLayout         # who each forward row is
    rows: list[StepRow]         # each request's current step
    sample: torch.Tensor        # [R, *latent shape], gathered from the pool
    latent_table: torch.Tensor  # [R, blocks] where those latents live
    timesteps: torch.Tensor     # [R]
    c_in: torch.Tensor          # [R] input scale
    guidance: torch.Tensor      # [R]
    coeffs: torch.Tensor        # [R, NUM_COEFFS]
    fused: list[bool]           # per request: its rows go through the fused update (else its own scheduler)
    noise: torch.Tensor | None  # the fused rows' ancestral noise for this step, drawn before the forward

    @property
    def bounds(self) -> tuple[tuple[int, int], ...]:
        return self.layout.bounds

    @property
    def num_cfg(self) -> int:
        """The first num_cfg rows also run unconditionally."""
        return self.layout.num_cfg

    @property
    def per_row(self) -> tuple[int, ...]:
        """View shape that broadcasts a per-row scalar over one image's latents."""
        return (-1,) + (1,) * (self.sample.dim() - 1)


@dataclass
class StepParts:
    """What every step runs through: the worker's model, forward, pool and the layers hooked into the model."""

    adapter: ModelAdapter
    denoiser: Denoiser
    pool: StatePool
    timer: PhaseTimer
    lora: LoraLayers
    forward_hooks: ForwardHooks     # every hook on the pipeline's modules, given each forward's context
    hooks: CacheHooks | None = None  # step caching (installed with the first caching request)
    controls: ControlPlanner | None = None  # the engine's controlnets' (None: it serves none)
    ip_adapter: Any = None  # the engine's IP-Adapter (ip_adapter_load.IPAdapter; None: none)


@dataclass
class StepResult:
    errors: dict[str, str] = field(default_factory=dict)  # request -> why its own sampler failed
    previews: dict[str, torch.Tensor] = field(default_factory=dict)  # x0 estimates of requests due for one
    cached: dict[str, tuple[bool, int, int]] = field(default_factory=dict)  # caching requests: (step cached,
    #                                                                          rows skipped, rows computed)

    def merge(self, other: "StepResult") -> None:
        for mine, theirs in ((self.errors, other.errors), (self.previews, other.previews),
                             (self.cached, other.cached)):
            mine.update(theirs)


def denoise_step(parts: StepParts, states: list[RequestState]) -> StepResult:
    """Advance every state by one step: schedule's batch -> one forward -> update. The pool is written only
    after the forward succeeded. Requests with LoRA adapters get them on all their rows, the unconditional
    ones too. Nothing here reads a device tensor back to the host (first_block caching's decision aside)."""
    adapter, pool, timer, hooks, result = parts.adapter, parts.pool, parts.timer, parts.hooks, StepResult()
    # 1. gather: the rows' latents, step table, noise and conditions, laid out as the BatchLayout says, written
    #    straight into the static inputs of the graph that will replay the forward, where there is one
    with timer.phase("gather"):
        batch = gather(adapter, pool, sorted(states, key=lambda s: not s.data.cfg))
        caching = None
        if hooks is not None and any(s.cache is not None for s in batch.states):
            caching = forward_cache(hooks.spec, pool, batch.states, batch.layout)
        control = None if parts.controls is None else parts.controls.plan(batch.states, batch.layout, pool)
        image_prompt = None if parts.ip_adapter is None else \
            image_prompt_plan(batch.states, batch.layout, parts.ip_adapter.embeds, pool.device)
        forward = parts.denoiser.plan(batch.layout, input_shapes(batch), parts.lora, cache=caching, control=control,
                                      image_prompt=image_prompt)
        inputs = model_inputs(adapter, pool, batch, forward)
    # 2. forward
    with timer.phase("forward"):
        out = parts.denoiser(forward, inputs, parts.forward_hooks)
        if forward.key is not None and not all(batch.fused):
            out = out.clone()  # a replay's output buffer, and a diffusers scheduler may keep what it steps on
    # 3. guidance, 4. the sampler update written back into the pool, 5. step caching's state
    with timer.phase("update_scatter"):
        update(pool, batch, guide(adapter, batch, out), result.errors, result.previews)
        renoise_known_region(adapter, pool, batch.states, result.errors)
        hold_first_frame(adapter, pool, batch.states, result.errors)
        if caching is not None:
            ids = {id(s.cache): s.request_id for s in batch.states if s.cache is not None}
            for state, skipped, computed in caching.commit(pool.write):
                result.cached[ids[id(state)]] = (computed == 0, skipped, computed)
    return result


def batch_layout(adapter: ModelAdapter, states: list[RequestState], rows: list[StepRow]) -> BatchLayout:
    """The forward's rows as the host knows them (states: CFG requests first; rows: their steps)."""
    info, first = adapter.info, states[0].data
    return BatchLayout(
        image_size=first.size, counts=tuple(s.n for s in states),
        num_cfg_requests=sum(1 for s in states if s.data.cfg),
        guidance=tuple(_guidance(info, s, row) for s, row in zip(states, rows)),
        experts=tuple(info.expert(row.timestep) for row in rows) if info.expert_boundary is not None else (),
        first_frames=tuple(s.input_numel > 0 for s in states) if info.images.first_frame else (),
        text_lengths=tuple(s.text_lengths for s in states) if states[0].text_lengths is not None else None,
        image_grids=tuple(tuple(x for grid in s.data.input_grids for x in grid) for s in states)
        if info.images.edit_grids is not None else (),
        loras=tuple(s.data.loras for s in states),
        aesthetic_scores=tuple(s.data.aesthetic_scores for s in states) if info.images.aesthetic_scores else ())


def gather(adapter: ModelAdapter, pool: StatePool, states: list[RequestState]) -> Batch:
    """The batch's latents out of the pool, its step table, and its noise: everything the host knows ahead is
    built on the host and copied without a wait, before the forward is queued."""
    shape = adapter.info.latents.shape(*states[0].data.size)
    rows = [s.plan.steps[s.step] for s in states]
    table = to_device(_step_table(adapter.info, states, rows), pool.device)
    latent_table = pool.table([r for s in states for r in s.blocks.latents])
    sample = ops.gather_blocks(pool.data, latent_table, math.prod(shape)).view(-1, *shape)
    fused = [s.fallback is None for s in states]
    drawing = [(s, r) for s, r, f in zip(states, rows, fused) if f]
    noise = None
    if any(r.draws_noise for _, r in drawing):
        noise = to_device(_noise(drawing, shape, sample.dtype), pool.device)
    return Batch(states=states, layout=batch_layout(adapter, states, rows), rows=rows, sample=sample,
                 latent_table=latent_table, timesteps=table[:, 0], c_in=table[:, 1], guidance=table[:, 2],
                 coeffs=table[:, 3:], fused=fused, noise=noise)


def input_shapes(batch: Batch) -> tuple:
    """The forward's input shapes past the rows that vary between batches: the latents' (one image size per
    forward), and an edit's input images' longest state."""
    longest = max(s.input_numel for s in batch.states) if batch.states[0].input_numel else 0
    return tuple(batch.sample.shape[1:]), longest


def model_inputs(adapter: ModelAdapter, pool: StatePool, batch: Batch, forward: Forward) -> ForwardInputs:
    """The forward's inputs in its row layout (the CFG rows appended, then the padding): scaled latents, step
    table columns and the rows' conditions (negative prompts on the CFG rows). Written into the forward's
    graph's buffers where it has them, else into tensors of their own."""
    info, states, layout, dst = adapter.info, batch.states, forward.layout, forward.buffers
    sample, rows = batch.sample, layout.num_rows
    latents = dst.latents if dst else sample.new_empty((rows, *sample.shape[1:]))
    torch.mul(sample, batch.c_in.to(sample.dtype).view(batch.per_row), out=latents[:len(sample)])
    for s, (lo, hi) in zip(states, batch.bounds):
        if s.fallback is not None and hasattr(s.fallback, "scale_model_input"):  # flow schedulers have none
            latents[lo:hi] = s.fallback.scale_model_input(sample[lo:hi], s.fallback_timestep)
    timesteps = dst.timesteps if dst else batch.timesteps.new_empty(rows)
    guidance = dst.guidance if dst else batch.guidance.new_empty(rows)
    for target, values in ((latents, None), (timesteps, batch.timesteps), (guidance, batch.guidance)):
        layout.lay_out(target, values)
    # the pool's conditions: one gather, every forward row's own blocks (a negative prompt's on CFG rows)
    cond_rows = [s.blocks.cond for s in states for _ in range(s.n)]
    cond_rows += [s.blocks.uncond for s in states if s.data.cfg for _ in range(s.n)]
    cond_rows += cond_rows[-1:] * layout.pad
    flat = ops.gather_blocks(pool.data, pool.table(cond_rows), info.text.condition_numel,
                             out=dst.flat if dst else None)
    conditions = dst.conditions if dst else unflatten(flat, info.text.condition_shapes)
    if info.images.denoiser_takes_inputs:
        if dst:
            image_inputs(pool, states, out=dst.conditions["image_inputs"][:layout.num_cond])
            conditions["image_inputs"] = layout.lay_out(dst.conditions["image_inputs"])
        else:
            conditions["image_inputs"] = layout.lay_out(None, image_inputs(pool, states))
    for key, value in adapter.step_conditions(layout, sample.dtype).items():
        conditions[key] = copy_to(dst.conditions[key], value) if dst else to_device(value, pool.device)
    return dst or ForwardInputs(latents, timesteps, guidance, conditions, flat)


def image_inputs(pool: StatePool, states: list[RequestState], out: torch.Tensor | None = None) -> torch.Tensor:
    """Each row's input state, [rows, numbers], zero-padded to the longest (edits of other image sizes);
    gathered into `out`'s first rows where given."""
    longest = max(s.input_numel for s in states)
    if all(s.input_numel == longest for s in states):
        return pool.read([r for s in states for r in s.blocks.inputs], longest, out=out)
    rows = torch.cat([torch.nn.functional.pad(pool.read(s.blocks.inputs, s.input_numel),
                                              (0, longest - s.input_numel)) for s in states])
    return rows if out is None else out.copy_(rows)


def renoise_known_region(adapter: ModelAdapter, pool: StatePool, states: list[RequestState],
                         errors: dict[str, str]) -> None:
    """Inpainting with a regular UNet: after each step the known region (mask 0) is the image's latents,
    re-noised to the next step with the request's first noise (clean after the last step), as the pipeline's
    loop writes (1 - mask) * known + mask * latents."""
    info = adapter.info
    for s in states:
        if s.data.mask is None or info.images.denoiser_takes_inputs or s.request_id in errors:
            continue
        shape = info.latents.shape(*s.data.size)
        c = shape[0]
        latents = pool.read(s.blocks.latents, math.prod(shape)).view(s.n, *shape)
        inputs = pool.read(s.blocks.inputs, s.input_numel).view(s.n, 1 + 2 * c, *shape[1:])
        mask, image, noise = inputs[:, :1], inputs[:, 1:1 + c], inputs[:, 1 + c:]
        a, b = s.plan.renoise[s.step]
        known = image if b == 0.0 else a * image + b * noise
        pool.write(s.blocks.latents, ((1 - mask) * known + mask * latents).reshape(s.n, -1))


def guide(adapter: ModelAdapter, batch: Batch, out: torch.Tensor) -> torch.Tensor:
    """The model's guidance on the CFG rows; the other rows as they came."""
    if not batch.num_cfg:
        return out
    n = batch.num_cfg
    cond, uncond = out[: len(batch.sample)], out[len(batch.sample):]
    g = batch.guidance[:n].to(out.dtype).view(batch.per_row)
    return torch.cat([adapter.combine_guidance(cond[:n], uncond, g), cond[n:]])


def update(pool: StatePool, batch: Batch, out: torch.Tensor, errors: dict[str, str],
           previews: dict[str, torch.Tensor]) -> None:
    states, rows, sample, coeffs, fused = batch.states, batch.rows, batch.sample, batch.coeffs, batch.fused
    clip = any(r.coeffs[CLIP] != float("inf") for r, f in zip(rows, fused) if f)
    for s, (lo, hi) in zip(states, batch.bounds):
        if s.fallback is None and s.step + 1 in s.data.preview_steps:
            previews[s.request_id] = ops.sampler_update(sample[lo:hi], out[lo:hi], coeffs[lo:hi], clip=clip)[1]
    if any(fused):
        _fused_update(pool, batch, out, fused, clip)

    for s, (lo, hi) in zip(states, batch.bounds):
        if s.fallback is not None:  # its rows are not in the fused update: step them the diffusers way
            try:
                t = s.fallback_timestep
                result = s.fallback.step(out[lo:hi], t, sample[lo:hi], **s.plan.step_kwargs(s.generator))
                pool.write(s.blocks.latents, result.prev_sample)
                x0 = getattr(result, "pred_original_sample", None)  # not every scheduler reports one
                if x0 is None:
                    x0 = multistep_x0(s.fallback)
                if x0 is not None and s.step + 1 in s.data.preview_steps:
                    previews[s.request_id] = x0
            except Exception as e:  # this request's sampler failed: only it fails
                errors[s.request_id] = f"sampler {s.plan.name!r} failed: {type(e).__name__}: {e}"


def _fused_update(pool: StatePool, batch: Batch, out: torch.Tensor, fused: list[bool], clip: bool) -> None:
    """The vectorized samplers' rows, updated and written back to the pool in one op."""
    states, rows, sample = batch.states, batch.rows, batch.sample
    latent_table, coeffs, out = batch.latent_table, batch.coeffs, out.reshape(len(sample), -1)
    if not all(fused):  # only the fused rows go through the op
        states, rows = [s for s, f in zip(states, fused) if f], [r for r, f in zip(rows, fused) if f]
        keep = device_index([i for (lo, hi), f in zip(batch.bounds, fused) if f for i in range(lo, hi)],
                            sample.device)
        sample, latent_table, coeffs, out = sample[keep], latent_table[keep], coeffs[keep], out[keep]
    if out.dtype != pool.data.dtype:  # only plans with x0_term_in_model_dtype are fused then (plan_for)
        out, coeffs = x0_terms(out, coeffs, [r.coeffs[AM] for r in rows], row_bounds(states))
    noise = batch.noise
    history_table, slots = None, max(s.plan.history_slots for s in states)
    if slots:  # [R, slots, nb]
        history_table = pool.table([slot for s in states for image in s.history_rows(len(s.blocks.latents[0]), slots)
                                    for slot in image]).view(len(sample), slots, -1)
    ops.scatter_update(pool.data, latent_table, out, coeffs, history_table,
                       None if noise is None else noise.reshape(len(sample), -1), clip)


def multistep_x0(scheduler: object) -> torch.Tensor | None:
    """The x0 estimate a multistep solver kept of its last step, for those that report none (UniPC, Wan's own):
    each step's model output converted, which is x0 where the solver predicts x0 (UniPC's predict_x0,
    DPM-Solver++); None otherwise."""
    outputs = getattr(scheduler, "model_outputs", None)
    config = getattr(scheduler, "config", {})
    predicts_x0 = config.get("predict_x0", False) or config.get("algorithm_type") in ("dpmsolver++", "sde-dpmsolver++")
    return outputs[-1] if predicts_x0 and outputs and outputs[-1] is not None else None


def _guidance(info: ModelInfo, state: RequestState, row: StepRow) -> float:
    """A request's guidance scale at this step: a two-expert model's second scale while its second expert runs."""
    return state.data.guidance_scale_2 if info.expert(row.timestep) else state.data.guidance_scale


def _step_table(info: ModelInfo, states: list[RequestState], rows: list[StepRow]) -> torch.Tensor:
    """[R, 3 + NUM_COEFFS] float32: timestep, input scale, guidance, update coefficients per model row."""
    per_request = torch.tensor([(r.timestep, r.c_in, _guidance(info, s, r), *r.coeffs)
                                for r, s in zip(rows, states)], dtype=torch.float32)
    return per_request.repeat_interleave(torch.tensor([s.n for s in states]), dim=0)


def _noise(states: list[tuple[RequestState, StepRow]], shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """The rows' noise on the host. Each request draws from its own CPU generator, exactly as its scheduler
    would in diffusers (randn_tensor with a CPU generator draws on the CPU, then copies)."""
    chunks = []
    for s, row in states:
        if row.draws_noise:
            chunks.append(torch.randn((s.n, *shape), generator=s.generator, dtype=dtype))
        else:
            chunks.append(torch.zeros((s.n, *shape), dtype=dtype))
    return torch.cat(chunks)
