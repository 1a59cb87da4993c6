"""One engine iteration on the worker, named after the steps of a diffusers pipeline:
encode prompts, prepare latents, denoise, decode.

A failure is pinned on the request that caused it: a batched call that raises is
retried request by request, and only the requests that still fail are dropped.
"""
from __future__ import annotations

from typing import Any, Callable, TypeVar

import torch

from dvllm.core.scheduler_output import NewRequestData, RunnerOutput, SchedulerOutput
from dvllm.models.base import ModelAdapter
from dvllm.worker.denoise_batch import denoise_step
from dvllm.worker.request_state import RequestState

T = TypeVar("T")


class ModelRunner:
    def __init__(self, adapter: ModelAdapter) -> None:
        self.adapter = adapter
        self.states: dict[str, RequestState] = {}

    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        errors: dict[str, str] = {}
        for request_id in out.freed_ids:
            self.states.pop(request_id, None)
        self._add_requests(out.new_requests, errors)
        batch = [self.states[i] for i in out.scheduled_ids if i in self.states]
        if batch:
            _per_request(batch, lambda group: denoise_step(self.adapter, group, errors), errors, "denoise")
        finished = [s for s in batch if s.done and s.request_id not in errors]
        images = self._decode(finished, errors)
        for request_id in [*images, *errors]:
            self.states.pop(request_id, None)
        return RunnerOutput(images=images, errors=errors)

    # 1-2. encode prompts (one text-encoder call for all new requests), prepare latents
    def _add_requests(self, new: list[NewRequestData], errors: dict[str, str]) -> None:
        if not new:
            return

        def add(group: list[NewRequestData]) -> None:
            texts = [(d.prompt, False) for d in group] + [(d.negative_prompt, True) for d in group if d.cfg]
            unique = list(dict.fromkeys(texts))  # identical texts are encoded once
            encoded = dict(zip(unique, self.adapter.encode_prompt(unique)))
            for d in group:
                generator = torch.Generator("cpu").manual_seed(d.seed)
                latents = self.adapter.prepare_latents(d.n, d.height, d.width, generator, d.plan.init_noise_sigma)
                self.states[d.request_id] = RequestState(
                    data=d, generator=generator, latents=latents, cond=encoded[(d.prompt, False)],
                    uncond=encoded[(d.negative_prompt, True)] if d.cfg else None,
                    fallback=None if d.plan.vectorized else d.plan.new_fallback_scheduler(),
                )

        _per_request(new, add, errors, "prompt encoding", key=lambda d: d.request_id)

    # 4. decode the requests that took their last step (one VAE call), convert to the output type
    def _decode(self, finished: list[RequestState], errors: dict[str, str]) -> dict[str, list[Any]]:
        images: dict[str, list[Any]] = {}

        def decode(group: list[RequestState]) -> None:
            to_decode = [s for s in group if s.data.output_type != "latent"]
            decoded = self.adapter.decode(torch.cat([s.latents for s in to_decode])) if to_decode else None
            lo = 0
            for s in group:
                if s.data.output_type == "latent":
                    images[s.request_id] = [x.cpu() for x in s.latents]
                else:
                    images[s.request_id] = _convert(decoded[lo:lo + s.n], s.data.output_type)
                    lo += s.n

        if finished:
            _per_request(finished, decode, errors, "decode")
        return images


def _convert(images: torch.Tensor, output_type: str) -> list[Any]:
    """[B, 3, H, W] in [0, 1] -> the output type, as diffusers' VaeImageProcessor.postprocess does."""
    if output_type == "pt":
        return [x.cpu() for x in images]
    arrays = images.cpu().permute(0, 2, 3, 1).float().numpy()
    if output_type == "np":
        return list(arrays)
    from diffusers.image_processor import VaeImageProcessor

    return VaeImageProcessor.numpy_to_pil(arrays)


def _per_request(items: list[T], run: Callable[[list[T]], None], errors: dict[str, str], what: str,
                 key: Callable[[T], str] = lambda s: s.request_id) -> None:
    """Run on the whole group; if that raises, run on each item alone and fail only those that raise."""
    try:
        run(items)
        return
    except Exception as e:
        if len(items) == 1:
            errors[key(items[0])] = f"{what} failed: {type(e).__name__}: {e}"
            return
    for item in items:
        try:
            run([item])
        except Exception as e:
            errors[key(item)] = f"{what} failed: {type(e).__name__}: {e}"
