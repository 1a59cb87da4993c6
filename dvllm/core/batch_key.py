"""The request-level policy's batch key (batching="request", core/scheduler.py)."""
from __future__ import annotations

from dvllm.core.request import Request


def request_batch_key(request: Request) -> tuple:
    """What requests must share to run in one batch of the request-level policy: the pipeline call's shape and
    arguments (size and frames, steps, guidance and whether CFG runs, sampler, images per prompt, strength), one
    LoRA set with its weights, and no step cache (a cached request is a batch of its own: the cache decides skips
    per batch there)."""
    p = request.params
    if request.cache_blocks:
        return ("alone", request.request_id)
    loras = tuple(sorted((p.loras or {}).items()))
    return (request.shape_key, request.num_steps, p.guidance_scale, request.cfg, p.sampler, p.n, p.strength, p.eta,
            loras)
