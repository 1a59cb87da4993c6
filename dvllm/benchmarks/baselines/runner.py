"""The diffusers pipeline behind the baselines, and the batcher that feeds it.

`serial` is the batcher with batches of one and no window: requests run one at a time, oldest first.
`static` collects compatible requests (same size, frames, steps, guidance, sampler, n, LoRA set, cache) for up
to a window after the oldest arrived, up to max_batch_size, and calls the pipeline once on their prompts with one
seeded CPU generator per image, so every image equals the one the request gets alone (and dvllm's). A call sets
its LoRA set and step cache first (pipeline_options.py); a video pipeline's call (Wan) returns frames.

Edits (requests with input images) call the model's diffusers edit pipeline: `image=` one PIL image or a
list, dvllm's guidance_scale as `true_cfg_scale` (CFG only with a negative prompt, as in diffusers).
What `static` can batch there is what diffusers allows:
- QwenImageEditPlusPipeline refuses batch_size > 1 (its __call__ raises for a list of prompts): it batches
  only a request's own n images (num_images_per_prompt), so its static baseline IS serial, one request
  per call. Not faked: such jobs get a key of their own.
- QwenImageEditPipeline takes a list of prompts with a list of images (one each), but resizes every image
  to the size it computes from the first: only requests whose input image has the same size share a call.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from dvllm.benchmarks.baselines.pipeline_options import diffusers_cache, diffusers_cache_unsupported, use_loras
from dvllm.config import EngineConfig
from dvllm.executor.worker import resolve_device
from dvllm.models.loader import load_adapter
from dvllm.samplers import build_plan, make_scheduler
from dvllm.sampling_params import SamplingParams


@dataclass
class Job:
    prompt: str
    params: SamplingParams           # resolved: no None left but negative_prompt and sampler
    future: asyncio.Future
    arrival: float = field(default_factory=time.monotonic)
    started: float | None = None     # when its pipeline call began
    batch_tag: Any = None            # more of the key: PipelineRunner.batch_tag (edits)

    @property
    def key(self) -> tuple:
        """Requests with equal keys can share one pipeline call (one LoRA set and one cache a call)."""
        p = self.params
        return (p.height, p.width, p.num_frames, p.num_inference_steps, p.guidance_scale, p.sampler, p.n,
                p.negative_prompt is None, self.batch_tag, tuple(sorted((p.loras or {}).items())), repr(p.cache))


class PipelineRunner:
    """Loads the model exactly as dvllm's worker does (same loader, dtype, dummy-weight seed)."""

    def __init__(self, model: str | None, load_format: str = "auto", device: str = "auto", dtype: str = "auto",
                 dummy_weight_seed: int = 0, lora_modules: dict[str, str] | None = None,
                 limits: dict[str, Any] | None = None) -> None:
        # The engine's limits (max steps, pixels, n: `limits`, EngineConfig's names) so both sides refuse the same
        # requests
        self.config = EngineConfig(model=model, load_format=load_format, device=device, dtype=dtype,
                                   dummy_weight_seed=dummy_weight_seed, lora_modules=lora_modules or {},
                                   **(limits or {}))
        torch_device = resolve_device(device)
        adapter = load_adapter(model, load_format, torch_device, dtype, seed=dummy_weight_seed)
        self.pipeline = adapter.pipeline
        self.name = adapter.name
        self.info = adapter.info
        self.loras = list(lora_modules or {})  # loaded once; each call chooses its set (pipeline_options.py)
        for name, path in (lora_modules or {}).items():
            self.pipeline.load_lora_weights(path, adapter_name=name)
        self._checked: set[tuple] = set()  # (sampler, steps, height, width) whose schedule builds
        self._solo = 0  # edit calls that can hold one request only, numbered

    def resolve(self, params: SamplingParams) -> SamplingParams:
        """Fills the model's defaults and checks what dvllm checks (limits, sampler, its schedule for this
        step count), so a bad request is refused alone instead of failing the batch it would join."""
        resolved = params.resolve(self.info, self.config)
        if resolved.cache is not None:
            why = diffusers_cache_unsupported(self.pipeline.transformer, resolved.cache)
            if why is not None:
                raise ValueError(f"cache: {why}")
        info, steps = self.info, resolved.num_inference_steps
        key = (resolved.sampler, steps, resolved.height, resolved.width)
        if key not in self._checked:  # building a schedule costs about a millisecond: once per kind
            extra = info.schedule.timestep_kwargs(resolved.height, resolved.width, steps, info.schedule.config) \
                if info.schedule.timestep_kwargs else {}
            build_plan(info.schedule.config, resolved.sampler, steps, **extra)
            self._checked.add(key)
        return resolved

    def batch_tag(self, params: SamplingParams) -> Any:
        """What else an edit's pipeline call must share (see the module's docstring); None for generations."""
        if params.image is None:
            return None
        if self.info.images.max_images > 1:  # QwenImageEditPlusPipeline: batch_size 1 only, never shared
            self._solo += 1
            return ("alone", self._solo)
        return ("image size", params.image.size)

    def run(self, jobs: list[Job]) -> list[list[Any]]:
        """One pipeline call for jobs that share a key; each job's PIL images. Runs on the worker thread."""
        p = jobs[0].params
        use_loras(self.pipeline, self.loras, p.loras)
        denoiser = getattr(self.pipeline, "transformer", None)
        with diffusers_cache(denoiser, p.cache):
            return self._call(jobs)

    def _call(self, jobs: list[Job]) -> list[list[Any]]:
        p = jobs[0].params
        # A fresh scheduler per call: diffusers schedulers keep state between steps.
        self.pipeline.scheduler = make_scheduler(self.info.schedule.config, p.sampler)
        if len(jobs) == 1:  # one generator draws all n images at once, as dvllm and diffusers do
            generator: Any = torch.Generator("cpu").manual_seed(jobs[0].params.seed)
        else:  # one per image; a request's n images share its generator, drawn in turn
            generator = [g for job in jobs for g in [torch.Generator("cpu").manual_seed(job.params.seed)] * p.n]
        negative = None if p.negative_prompt is None else [job.params.negative_prompt for job in jobs]
        if p.image is not None:
            return self._edit(jobs, negative, generator)
        if self.info.video is not None:  # a video pipeline (Wan): each job's videos, [frames, H, W, 3] each
            out = self.pipeline([job.prompt for job in jobs], negative_prompt=negative, height=p.height,
                                width=p.width, num_frames=p.num_frames, num_inference_steps=p.num_inference_steps,
                                guidance_scale=p.guidance_scale, num_videos_per_prompt=p.n, generator=generator,
                                output_type="np")
            return [list(out.frames[i * p.n:(i + 1) * p.n]) for i in range(len(jobs))]
        out = self.pipeline([job.prompt for job in jobs], negative_prompt=negative, height=p.height, width=p.width,
                            num_inference_steps=p.num_inference_steps, guidance_scale=p.guidance_scale,
                            num_images_per_prompt=p.n, generator=generator, output_type="pil")
        return [out.images[i * p.n:(i + 1) * p.n] for i in range(len(jobs))]

    def _edit(self, jobs: list[Job], negative: list[str] | None, generator: Any) -> list[list[Any]]:
        p = jobs[0].params
        if len(jobs) == 1:  # one request: its image, or its several images as a list (Plus)
            image: Any = list(p.image) if isinstance(p.image, tuple) else p.image
            prompt: Any = jobs[0].prompt
            negative = None if negative is None else negative[0]
        else:  # QwenImageEditPipeline only (batch_tag): one image per prompt, all of one size
            image, prompt = [job.params.image for job in jobs], [job.prompt for job in jobs]
        out = self.pipeline(image=image, prompt=prompt, negative_prompt=negative, true_cfg_scale=p.guidance_scale,
                            height=p.height, width=p.width, num_inference_steps=p.num_inference_steps,
                            num_images_per_prompt=p.n, generator=generator, output_type="pil")
        return [out.images[i * p.n:(i + 1) * p.n] for i in range(len(jobs))]


def load_on_worker(**runner_kwargs: Any) -> tuple[PipelineRunner, ThreadPoolExecutor]:
    """The runner, loaded on the one thread that will run it. torch's OpenMP keeps a thread team per
    calling thread: a model loaded on one thread and run on another ran 1.4-2.9x slower on a 2-core CPU."""
    worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pipeline")
    return worker.submit(PipelineRunner, **runner_kwargs).result(), worker


class Batcher:
    """Groups jobs by key and runs one group at a time on a single worker thread (one pipeline call at
    a time, so /health and new arrivals stay served on the event loop)."""

    def __init__(self, runner: PipelineRunner, worker: ThreadPoolExecutor, max_batch_size: int = 1,
                 window_s: float = 0.0, on_batch: Callable[[int], None] | None = None) -> None:
        if max_batch_size < 1:
            raise ValueError(f"a static batch must be >= 1, got {max_batch_size}")
        if window_s < 0:
            raise ValueError(f"a batch window must be >= 0 s, got {window_s}")
        self.runner = runner
        self.max_batch_size = max_batch_size
        self.window_s = window_s
        self.on_batch = on_batch  # told each call's batch size (metrics)
        self._groups: dict[tuple, list[Job]] = {}
        self._wakeup = asyncio.Event()
        self._worker = worker
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self._worker.shutdown(wait=True)

    def submit(self, job: Job) -> None:
        self._groups.setdefault(job.key, []).append(job)
        self._wakeup.set()

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if not self._groups:
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            # The group whose oldest job has waited longest goes next: no group starves.
            key, jobs = min(self._groups.items(), key=lambda item: item[1][0].arrival)
            wait = jobs[0].arrival + self.window_s - time.monotonic()
            if len(jobs) < self.max_batch_size and wait > 0:
                self._wakeup.clear()
                try:  # until the window closes or a new job arrives (which may fill the batch)
                    await asyncio.wait_for(self._wakeup.wait(), wait)
                except TimeoutError:
                    pass
                continue
            batch = jobs[:self.max_batch_size]
            del jobs[:self.max_batch_size]
            if not jobs:
                del self._groups[key]
            await self._run(loop, batch)

    async def _run(self, loop: asyncio.AbstractEventLoop, batch: list[Job]) -> None:
        started = time.monotonic()
        for job in batch:
            job.started = started
        if self.on_batch is not None:
            self.on_batch(len(batch))
        try:
            images = await loop.run_in_executor(self._worker, self.runner.run, batch)
        except Exception as e:  # noqa: BLE001 - every job of the call hears of it
            for job in batch:
                if not job.future.done():
                    job.future.set_exception(e)
            return
        for job, job_images in zip(batch, images):
            if not job.future.done():  # its client may have gone
                job.future.set_result(job_images)
