"""Preemption's swap: a request's pool contents go to host memory, and come back unchanged into the blocks it
is given on resuming (its latents, sampler history, step-cache state, input latents, conditions and control
images)."""
from __future__ import annotations

from typing import Any

from dvllm.models.model_info import ModelInfo
from dvllm.worker.request_state import RequestState
from dvllm.worker.state_pool import StatePool


def swap_out(state: RequestState, pool: StatePool, info: ModelInfo) -> None:
    blocks = state.blocks
    numel = info.latents.numel(*state.data.size)
    host = {"latents": pool.read(blocks.latents, numel)}
    if blocks.history is not None:
        host["history"] = pool.read(blocks.history, numel)
    if blocks.cache is not None:
        host["cache"] = pool.read(blocks.cache, state.cache.numel)
    if blocks.inputs is not None:
        host["inputs"] = pool.read(blocks.inputs, state.input_numel)
    host["cond"] = pool.read([blocks.cond], info.text.condition_numel)
    for i, (entry, control) in enumerate(zip(blocks.controls, state.data.controls)):
        host[f"control{i}"] = pool.read([list(entry)], control.image.numel())
    if blocks.uncond is not None:
        host["uncond"] = pool.read([blocks.uncond], info.text.condition_numel)
    state.host = {k: v.to("cpu") for k, v in host.items()}
    state.blocks = None
    if state.control_images:  # inputs made at its start (Flux's, SD3's...): outside the pool, to host memory too
        state.control_images = [None if t is None else t.to("cpu") for t in state.control_images]


def swap_in(state: RequestState, blocks: Any, pool: StatePool) -> None:
    """`blocks`: the request's new block tables (ResumedRequestData.blocks)."""
    host = {k: v.to(pool.device) for k, v in state.host.items()}
    pool.write(blocks.latents, host["latents"])
    if blocks.history is not None:
        pool.write(blocks.history, host["history"])
    if blocks.cache is not None:
        pool.write(blocks.cache, host["cache"])
    if blocks.inputs is not None:
        pool.write(blocks.inputs, host["inputs"])
    if blocks.write_cond:  # evicted from the prompt cache meanwhile: restore our copy
        pool.write([blocks.cond], host["cond"])
    if blocks.uncond is not None and blocks.write_uncond:
        pool.write([blocks.uncond], host["uncond"])
    for i, (entry, write) in enumerate(zip(blocks.controls, blocks.write_controls)):
        if write:  # the same: its control image was evicted
            pool.write([list(entry)], host[f"control{i}"])
    if state.control_images:
        state.control_images = [None if t is None else t.to(pool.device) for t in state.control_images]
    state.blocks, state.host = blocks, None
