"""The input processor: (request id, prompt, SamplingParams) -> a Request checked completely.

It runs once per request, at admission and before the request is queued: the async engine runs it
off both the event loop and the step loop, so a bad request is answered at once whatever the engine
is doing, and nothing that grows with one client's input (an image upload's decode, a sampler
schedule of many steps) runs where it could stall other clients. Thread-safe.
"""
from __future__ import annotations

import hashlib
import itertools
import json
import logging
import threading
import time
from collections import OrderedDict
from typing import Any, Callable

import diffusers
import numpy as np

from dvllm.config import EngineConfig
from dvllm.core.request import Request, check_fits
from dvllm.decode_budget import DecodeBudget
from dvllm.engine.result_cache import result_key
from dvllm.engine.control_images import control_key, control_numel, prepare_controls
from dvllm.lora.adapter_defaults import with_adapter_defaults
from dvllm.lora.ref import LoraRef
from dvllm.lora.registry import LoraRegistry
from dvllm.models.base import ModelInfo
from dvllm.sampler_names import did_you_mean, scheduler_class
from dvllm.samplers import SHORT_NAMES, PlanRefused, SamplerPlan, build_plan, history_slots
from dvllm.samplers.probe import probe_plan
from dvllm.request_sizes import as_images
from dvllm.sampling_params import SamplingParams, check_text
from dvllm.step_cache import check_served, not_served_why


logger = logging.getLogger(__name__)


class InputProcessor:
    def __init__(self, config: EngineConfig, info: ModelInfo, block_numel: int, pool_blocks: int,
                 loras: LoraRegistry | None = None, model_key: str = "",
                 valid_samplers: list[str] | None = None, decode_budget: DecodeBudget | None = None) -> None:
        """valid_samplers: what another processor of this model probed (a server's, for its core's);
        decode_budget: which decodes run tiled (the workers' tightest; None: none)."""
        self.config, self.info, self.loras = config, info, loras
        self.model_key = model_key  # what identifies the served model in result-cache keys
        if config.default_cache is not None and info.cache_layout is None:
            raise ValueError(f"default_cache: {not_served_why(info)}, so every request would be refused; leave "
                             "default_cache unset for this model")
        check_served(config.default_cache, info, "default_cache")
        self.block_numel = block_numel
        self.decode_budget = decode_budget or DecodeBudget()
        self.pool_blocks = pool_blocks  # the smallest worker's pool: every request must fit it alone
        self._lock = threading.Lock()
        self._plans: OrderedDict[tuple, SamplerPlan | ValueError] = OrderedDict()  # failures are cached too
        self._arrivals = itertools.count()
        self._most: OrderedDict[tuple, int] = OrderedDict()  # (sampler, strength, size) -> most steps it runs
        # Which samplers run this model is probed at start-up (every diffusers scheduler is tried: 0.4-1.4 s,
        # once per process and schedule: _ProbeMemo), not by the first request that names a bad one.
        self._valid_samplers = self._probe_samplers() if valid_samplers is None else list(valid_samplers)

    def process(self, request_id: str, prompt: str, params: SamplingParams | None,
                arrival_time: float | None = None) -> Request:
        """The request, resolved and checked; ValueError naming the field otherwise."""
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty string, got {request_id!r}")
        check_text("prompt", prompt, self.config.max_prompt_chars)
        if params is not None and params.loras and self.loras is not None:
            params = self._with_adapter_defaults(params)
        resolved = (params or SamplingParams()).resolve(self.info, self.config)
        info = self.info
        plan = self.plan(resolved)
        input_numel = info.input_numel(resolved.height, resolved.width, resolved.image, resolved.mask_image is not None,
                                       resolved.num_frames)
        request = Request(
            loras=self._loras(resolved.loras),
            request_id=request_id, prompt=prompt, params=resolved, num_steps=plan.num_steps,
            cfg=info.guidance.uses_cfg(resolved.guidance_scale, resolved.negative_prompt), plan=plan,
            arrival_time=time.time() if arrival_time is None else arrival_time, arrival_seq=next(self._arrivals),
            latent_blocks=self.blocks(info.latents.numel(*resolved.size)),
            cond_blocks=self.blocks(info.text.condition_numel), history_slots=plan.history_slots,
            input_blocks=self.blocks(input_numel), input_numel=input_numel,
            input_grids=info.input_grids(resolved.image),
            image_key=image_digest(resolved.image) if info.text.reads_images else None,
            cache_blocks=0 if resolved.cache is None else self.blocks(info.cache_layout.request_row(
                resolved.cache, resolved.height, resolved.width, resolved.max_sequence_length,
                (prompt, resolved.negative_prompt), resolved.num_frames)[1]),
        )
        request.controls = prepare_controls(resolved.controls, resolved.height, resolved.width, info.latents.scale)
        digests = tuple(control_key(c.image) for c in request.controls)
        if digests and info.images.control_input_is_image:  # pool state, shared (core/request_blocks.py)
            request.control_keys = digests
            request.control_blocks = self.blocks(control_numel(resolved.height, resolved.width))
        check_fits(request, self.config.max_batch_size, self.pool_blocks)
        request.decode_tiled = self._decode_tiled(request_id, resolved)
        # Only a seed the user chose can repeat: a drawn one would never hit, so it is not stored either.
        if self.config.result_cache_mb and params is not None and params.seed is not None:
            request.result_key = result_key(
                self.model_key, prompt, resolved, request.lora_load_ids,
                request.image_key or image_digest(resolved.image),
                None if resolved.mask_image is None else image_digest(resolved.mask_image),
                tuple((c.name, key.hex(), c.scale, c.start, c.end, c.mode)
                      for c, key in zip(request.controls, digests)),
                None if resolved.ip_adapter_image is None else
                (image_digest(resolved.ip_adapter_image), float(resolved.ip_adapter_scale)))
        return request

    def _decode_tiled(self, request_id: str, params: SamplingParams) -> bool:
        """Whether its decode calls (min(n, max_decode_batch) images each) would pass max_decode_mb untiled, and
        so run tiled; logged, since the output then comes from a tiled decode."""
        images = min(params.n, self.config.max_decode_batch)
        budget = self.decode_budget
        if params.output_type == "latent" or not budget.tiles(params.size, images):
            return False
        logger.info("%s decodes tiled: untiled, a decode of %d at %s is estimated at %.0f MiB, over max_decode_mb "
                    "(%.0f MiB)", request_id, images, "x".join(map(str, params.size)),
                    budget.estimate(params.size, images) / 2**20, budget.limit_bytes / 2**20)
        return True

    def _with_adapter_defaults(self, params: SamplingParams) -> SamplingParams:
        """The request's unset steps, guidance and sampler from its adapters' own defaults, where they have any."""
        params.validate()  # (the adapters' names checked before they are looked up)
        return with_adapter_defaults(params, self._adapter_defaults)

    def _adapter_defaults(self, name: str) -> dict:
        try:
            return self.loras.defaults(name)
        except ValueError:  # an unknown adapter: refused with the request's other checks, in their order
            return {}

    def _loras(self, loras: dict[str, float] | None) -> tuple[tuple[LoraRef, float], ...]:
        """Each named adapter's id, with its weight (its file checked unchanged since it was loaded: a stat)."""
        if not loras:
            return ()
        if self.loras is None:
            raise ValueError("loras: this engine serves no LoRA adapters (start it with enable_lora or lora_modules)")
        try:
            return tuple((self.loras.ref(name), weight) for name, weight in loras.items())
        except ValueError as e:
            raise ValueError(f"loras: {e}") from None

    def blocks(self, numel: int) -> int:
        return -(-numel // self.block_numel)

    # -- sampler plans ---------------------------------------------------------------------
    def plan(self, params: SamplingParams) -> SamplerPlan:
        """The request's schedule, built and probed once per (sampler, steps, strength, size-dependent
        arguments); a sampler or step count that cannot run is a ValueError that says what can."""
        steps, key = params.num_inference_steps, self._plan_key(params)
        with self._lock:
            cached = self._plans.get(key)
            if cached is not None:
                self._plans.move_to_end(key)
        if cached is None:
            try:
                cached = self._build(params.sampler, steps, params)
            except PlanRefused as e:  # already in the user's terms
                cached = e
            except Exception:  # noqa: BLE001 - any failure inside diffusers means "cannot run"
                cached = self._refusal(params)
            with self._lock:
                self._plans[key] = cached
                while len(self._plans) > self.config.sampler_plan_cache_size:
                    self._plans.popitem(last=False)
        if isinstance(cached, ValueError):
            raise ValueError(str(cached))
        return cached

    def _plan_key(self, params: SamplingParams) -> tuple:
        extra = self._timestep_kwargs(params.height, params.width, params.num_inference_steps)
        return (params.sampler, params.num_inference_steps, params.strength, params.eta, params.mask_image is not None,
                tuple(sorted((k, _hashable(v)) for k, v in extra.items())))

    def default_history_slots(self) -> int:
        """The history slots a default request's sampler (the model's own) keeps."""
        return history_slots(self.info.schedule.config, None, self.info.schedule.output_dtype_differs)

    def _timestep_kwargs(self, height: int, width: int, steps: int) -> dict[str, Any]:
        info = self.info
        return info.schedule.timestep_kwargs(height, width, steps, info.schedule.config) if info.schedule.timestep_kwargs else {}

    def _build(self, sampler: str | None, steps: int, params: SamplingParams) -> SamplerPlan:
        plan = build_plan(self.info.schedule.config, sampler, steps, params.strength, params.eta,
                          self.info.schedule.step_kwargs, renoise=params.mask_image is not None,
                          output_dtype_differs=self.info.schedule.output_dtype_differs, **self._timestep_kwargs(params.height, params.width, steps))
        probe_plan(plan, self._probe_shape())
        return plan

    def _runs(self, sampler: str | None, steps: int, params: SamplingParams) -> bool:
        try:
            self._build(sampler, steps, params)
            return True
        except Exception:  # noqa: BLE001
            return False

    def _refusal(self, params: SamplingParams) -> ValueError:
        """Why this plan cannot run, in the user's terms (never diffusers' or torch's message)."""
        sampler, steps = params.sampler, params.num_inference_steps
        name = sampler or self.info.schedule.config["_class_name"]
        known = sampler is None or sampler in SHORT_NAMES or scheduler_class(sampler) is not None
        default = self.info.defaults.steps
        if known and self._runs(sampler, default, params):
            if steps > default:
                most = self._most_steps(sampler, default, steps, params)
                return ValueError(f"num_inference_steps must be at most {most} for sampler {name!r} on this model, "
                                  f"got {steps}")
            return ValueError(f"num_inference_steps={steps} does not work with sampler {name!r} on this model; "
                              f"it runs {default} steps")
        valid = self.valid_samplers()
        short = [n for n in valid if n in SHORT_NAMES]
        classes = [n for n in valid if n not in SHORT_NAMES]
        # the short names always; the ~40 class names only to someone who gave a class name
        listed = valid if str(name).endswith("Scheduler") else short
        rest = "" if listed is valid else f", or the class name of one of {len(classes)} diffusers schedulers"
        what = "cannot run on this model" if known else "is not a sampler dvllm knows"
        return ValueError(f"sampler {name!r} {what}{did_you_mean(name, valid)}; valid samplers: {listed}{rest}")

    def _most_steps(self, sampler: str | None, good: int, bad: int, params: SamplingParams) -> int:
        """The largest step count in [good, bad) that runs, by bisection (schedules break past a point).
        Remembered, so that asking again with other step counts costs nothing."""
        key = (sampler, params.strength, params.eta, params.height, params.width, params.mask_image is not None)
        most = self._most.get(key)
        if most is not None and most < bad:
            return most
        while bad - good > 1:
            mid = (good + bad) // 2
            if self._runs(sampler, mid, params):
                good = mid
            else:
                bad = mid
        with self._lock:
            self._most[key] = good
            while len(self._most) > self.config.sampler_plan_cache_size:
                self._most.popitem(last=False)
        return good

    def _probe_shape(self) -> tuple[int, ...]:
        # The smallest latent the model takes: the scheduler sees the model's channels and layout.
        size = self.info.latents.size_factor
        return self.info.latents.shape(size, size)

    def valid_samplers(self) -> list[str]:
        """Short names and diffusers scheduler classes that run this model's default schedule (probed once,
        at start-up)."""
        return self._valid_samplers

    def _probe_samplers(self) -> list[str]:
        info, steps = self.info, self.info.defaults.steps
        params = SamplingParams(num_inference_steps=steps, height=info.defaults.height, width=info.defaults.width)

        def probe() -> tuple[str, ...]:
            candidates = list(SHORT_NAMES) + sorted(n for n in dir(diffusers) if scheduler_class(n) is not None)
            return tuple(n for n in candidates if self._runs(n, steps, params))

        try:  # everything _build reads of the model, for the default request
            key = (json.dumps(info.schedule.config, sort_keys=True), self._plan_key(params), info.schedule.step_kwargs,
                   info.schedule.output_dtype_differs, self._probe_shape())
        except TypeError:  # a config JSON cannot hold (none from diffusers' files): probed, not remembered
            return list(probe())
        return list(_PROBED.get(key, probe))


class _ProbeMemo:
    """Which samplers run a schedule, remembered per process (bounded). Every engine built in one process from
    one model (a benchmark's contenders, data-parallel lanes, a test suite's engines) would otherwise try the
    ~50 diffusers schedulers again at its start-up: 0.4-1.4 s each time."""

    def __init__(self, size: int) -> None:
        self._size = size
        self._lock = threading.Lock()
        self._answers: OrderedDict[tuple, tuple[str, ...]] = OrderedDict()

    def get(self, key: tuple, probe: Callable[[], tuple[str, ...]]) -> tuple[str, ...]:
        with self._lock:  # held while probing: a second engine of the model waits for the first's answer
            answer = self._answers.get(key)
            if answer is None:
                answer = self._answers[key] = probe()
                while len(self._answers) > self._size:
                    self._answers.popitem(last=False)
            self._answers.move_to_end(key)
            return answer


_PROBED = _ProbeMemo(size=16)


def image_digest(image: Any) -> str:
    """A digest of a request's images' pixels (bounded by max_image_pixels; computed here, off the loops)."""
    digest = hashlib.blake2b(digest_size=16)
    for i in as_images(image):
        digest.update(f"{i.mode}:{i.width}x{i.height};".encode())
        digest.update(i.tobytes())
    return digest.hexdigest()


def _hashable(value: Any) -> Any:
    return tuple(value) if isinstance(value, (list, np.ndarray)) else value
