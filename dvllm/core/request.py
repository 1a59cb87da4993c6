"""One request's bookkeeping on the driver: ids, counters, status. No tensors."""
from __future__ import annotations

import enum
import hashlib
import json
import math
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from dvllm.core.block_manager import CachedEntry
from dvllm.core.scheduler_output import BlockTables, NewRequestData, StartJob
from dvllm.core.step_pace import StepPace
from dvllm.ip_adapters import ImagePrompt
from dvllm.lora.ref import LoraRef
from dvllm.outputs import RequestMetrics, RequestOutput
from dvllm.request_sizes import as_images
from dvllm.sampling_params import SamplingParams


def prompt_cache_key(role: str, text: str | None, max_sequence_length: int | None = None,
                     text_loras: tuple[tuple[str, float], ...] = (), image_key: str | None = None) -> bytes:
    """What identifies one text's conditions: its role, text and the request fields that change its
    encoding (the text length; the text-encoder LoRA adapters, by file digest, with their weights; the digest
    of the images an edit model reads the prompt with)."""
    fields = [role, text, max_sequence_length] + ([[list(a) for a in text_loras]] if text_loras else [])
    fields += [image_key] if image_key else []
    payload = json.dumps(fields, ensure_ascii=False).encode("utf-8", "surrogatepass")
    return hashlib.blake2b(payload, digest_size=16).digest()


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"
    FINISHED_ERROR = "error"
    FINISHED_ABORTED = "aborted"


@dataclass(eq=False)
class Request:
    request_id: str
    prompt: str
    params: SamplingParams  # resolved: no None left
    num_steps: int          # denoiser forwards the request takes (its sampler plan's length)
    cfg: bool               # whether it adds unconditional rows
    plan: Any               # the sampler plan; opaque here, sent to the worker once
    arrival_time: float
    arrival_seq: int
    latent_blocks: int = 1    # state-pool blocks per image's latents (and per history slot of an image)
    cond_blocks: int = 1      # state-pool blocks per prompt's conditions
    history_slots: int = 0    # earlier x0 its multistep sampler keeps per image (runs of latent_blocks)
    cache_blocks: int = 0     # state-pool blocks per model row for its step cache (0: none)
    input_blocks: int = 0     # state-pool blocks per image for what its input image(s) left (inpainting, edits)
    input_numel: int = 0      # the numbers in them
    input_grids: tuple[tuple[int, int], ...] = ()  # an edit's input images' token grids
    image_key: str | None = None  # an edit's images' digest: its prompt's conditions depend on them
    result_key: bytes | None = None  # its result-cache key (engine/result_cache.py); None: not cacheable
    cached_steps: int = 0     # steps whose remaining blocks it skipped or predicted
    # its LoRA adapters, by id (their weights are read where they are applied), and their weights
    loras: tuple[tuple[LoraRef, float], ...] = ()
    status: RequestStatus = RequestStatus.WAITING
    num_steps_done: int = 0
    steps_in_flight: int = 0  # scheduled and not yet updated (async scheduling: up to two)
    last_scheduled: int = -1  # scheduler iteration it last took a step in
    images: list[Any] = field(default_factory=list)
    error: str | None = None
    first_scheduled_time: float | None = None
    finished_time: float | None = None
    # state-pool bookkeeping (driver side; the tensors are on the worker)
    blocks: BlockTables | None = None
    cond_entry: CachedEntry | None = None
    uncond_entry: CachedEntry | None = None
    swapped: bool = False       # preempted: its state waits in the worker's host memory
    num_preemptions: int = 0
    arrival_iteration: int = 0  # the scheduler's steps run when it arrived (priority aging's clock)
    failed_workers: set[int] = field(default_factory=set)  # workers that died while holding it
    pace: StepPace = field(default_factory=StepPace)  # its recent step times: the ETA of its progress outputs
    decode_tiled: bool = False  # its decode runs in tiles: untiled, it would pass max_decode_mb (decode_budget.py)
    controls: tuple = ()  # its ControlNet controls, each image prepared at admission (engine/control_images.py)
    control_keys: tuple[bytes, ...] = ()  # their prepared images' digests: pool entries shared when identical
    control_blocks: int = 0   # state-pool blocks per control image
    control_entries: tuple[CachedEntry, ...] = ()

    def reset(self) -> None:
        """Its worker died: start over from the seed (the images come out the same)."""
        self.status, self.num_steps_done, self.last_scheduled = RequestStatus.WAITING, 0, -1
        self.steps_in_flight = 0
        self.blocks = self.cond_entry = self.uncond_entry = None
        self.control_entries = ()
        self.swapped, self.images, self.cached_steps = False, [], 0
        self.pace.reset()

    @property
    def rows(self) -> int:
        """Denoiser rows per forward."""
        return self.params.n * (2 if self.cfg else 1)

    @property
    def pixels(self) -> int:
        """What it weighs against max_running_pixels: rows x frames x height x width."""
        return self.rows * math.prod(self.params.size)

    @property
    def private_blocks(self) -> int:
        """Blocks only this request uses: latents, history for multistep samplers, step-cache state, inputs."""
        per_image = self.latent_blocks * (1 + self.history_slots) + self.input_blocks
        return self.params.n * per_image + self.rows * self.cache_blocks

    @property
    def max_blocks(self) -> int:
        """Blocks it needs when no prompt embedding or control image is shared: must fit the pool alone."""
        return self.private_blocks + self.cond_blocks * (2 if self.cfg else 1) + self.shared_control_blocks

    @property
    def shared_control_blocks(self) -> int:
        """Blocks its distinct control images take (two controls with one image share one copy)."""
        return len(set(self.control_keys)) * self.control_blocks

    @property
    def shared_entries(self) -> list[CachedEntry]:
        """The pool entries it holds that others may share: its texts' conditions and its control images."""
        return [e for e in (self.cond_entry, self.uncond_entry, *self.control_entries) if e is not None]

    @cached_property
    def cond_keys(self) -> tuple[bytes, bytes | None]:
        """Prompt-cache keys of its conditions (positive, and negative with CFG): digests, so the cache
        holds a few bytes per entry however long the texts are."""
        length, text_loras = self.params.max_sequence_length, self.text_loras
        images = self.image_key
        negative = prompt_cache_key("negative", self.params.negative_prompt, length, text_loras, images) \
            if self.cfg else None
        return prompt_cache_key("prompt", self.prompt, length, text_loras, images), negative

    @property
    def num_input_images(self) -> int:
        """Images its admission has the worker encode (image-to-image, inpainting, edits)."""
        return len(as_images(self.params.image))

    @property
    def lora_adapters(self) -> list[LoraRef]:
        return [ref for ref, _ in self.loras]

    @property
    def row_loras(self) -> tuple[tuple[str, float], ...]:
        """(adapter digest, weight) of each adapter: what the worker applies to its rows."""
        return tuple((ref.digest, weight) for ref, weight in self.loras)

    @property
    def text_loras(self) -> tuple[tuple[str, float], ...]:
        """Those of its adapters that change the text encoders: they change its prompt embeddings."""
        return tuple((ref.digest, weight) for ref, weight in self.loras if ref.has_text_encoder)

    @property
    def lora_load_ids(self) -> tuple[tuple[int, float], ...]:
        """(adapter load id, weight) of each adapter: an adapter loaded again is another one to the result cache."""
        return tuple((ref.uid, weight) for ref, weight in self.loras)

    @property
    def preview_steps(self) -> frozenset[int]:
        """Step counts after which a preview is decoded: num_previews of them, evenly spread."""
        count = min(self.params.num_previews, self.num_steps - 1)
        return frozenset((j + 1) * self.num_steps // (count + 1) for j in range(count))

    @property
    def shape_key(self) -> tuple[int, ...]:
        """Requests share a forward only if their latents have one shape: one size (and a video's frames)."""
        return self.params.size

    @property
    def priority(self) -> int:
        return self.params.priority

    @property
    def deadline_time(self) -> float | None:
        """When its images are due (time.time()), or None."""
        deadline = self.params.deadline_s
        return None if deadline is None else self.arrival_time + deadline

    @property
    def deadline_met(self) -> bool | None:
        """Once finished with a deadline: its images came, in time."""
        due = self.deadline_time
        if due is None or not self.is_finished:
            return None
        return self.status == RequestStatus.FINISHED and self.finished_time <= due

    @property
    def steps_scheduled(self) -> int:
        """Steps taken or in flight: the next one scheduled is this one (progress is deterministic)."""
        return self.num_steps_done + self.steps_in_flight

    @property
    def is_finished(self) -> bool:
        return self.status not in (RequestStatus.WAITING, RequestStatus.RUNNING)

    def start_job(self) -> StartJob:
        """What its start latents are made of (the encode stage may make them ahead of admission)."""
        p = self.params
        return StartJob(self.request_id, p.n, p.height, p.width, p.seed, self.plan, p.image, p.mask_image, p.strength,
                        bool(self.input_grids), p.num_frames)

    def new_request_data(self, tables: BlockTables) -> NewRequestData:
        """What the worker needs of it at admission, with the blocks it was given."""
        request, p = self, self.params
        return NewRequestData(
            request_id=request.request_id, prompt=request.prompt, negative_prompt=p.negative_prompt, n=p.n,
            height=p.height, width=p.width, num_frames=p.num_frames, seed=p.seed, guidance_scale=p.guidance_scale, guidance_scale_2=p.guidance_scale_2, cfg=request.cfg,
            output_type=p.output_type, plan=request.plan, blocks=tables, preview_steps=request.preview_steps,
            image=p.image, mask=p.mask_image, strength=p.strength, input_numel=request.input_numel,
            input_grids=request.input_grids, image_key=request.image_key,
            max_sequence_length=p.max_sequence_length, cache=p.cache,
            loras=request.row_loras, text_loras=request.text_loras,
            aesthetic_scores=None if p.aesthetic_score is None else (p.aesthetic_score, p.negative_aesthetic_score),
            decode_tiled=request.decode_tiled, controls=request.controls,
            image_prompt=None if p.ip_adapter_image is None else ImagePrompt(p.ip_adapter_image, p.ip_adapter_scale),
        )

    def output(self, previews: list[Any] | None = None, preview_step: int | None = None) -> RequestOutput:
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            seed=self.params.seed,
            num_inference_steps=self.num_steps,
            num_steps_done=self.num_steps_done,
            finished=self.is_finished,
            metrics=RequestMetrics(self.arrival_time, self.first_scheduled_time, self.finished_time,
                                   cached_steps=None if self.params.cache is None else self.cached_steps,
                                   deadline_met=self.deadline_met),
            images=self.images,
            error=self.error,
            previews=previews or [],
            preview_step=preview_step if previews else None,
            eta_s=0.0 if self.is_finished else self.pace.eta(self.num_steps - self.num_steps_done),
            decode_tiled=self.decode_tiled,
        )


def check_fits(request: Request, max_batch_size: int, num_blocks: int) -> None:
    """A request must fit one forward and the whole pool on its own, or it could never run."""
    if request.rows > max_batch_size:
        raise ValueError(
            f"n={request.params.n} needs {request.rows} denoiser rows"
            f"{' (doubled by CFG)' if request.cfg else ''} but max_batch_size is {max_batch_size}"
        )
    if request.max_blocks > num_blocks:
        if request.cache_blocks and request.max_blocks - request.rows * request.cache_blocks <= num_blocks:
            method = request.params.cache.method
            raise ValueError(
                f"cache: {method}'s state for n={request.params.n} at {request.params.width}x{request.params.height} "
                f"needs {request.rows * request.cache_blocks} state-pool blocks, more than the pool's {num_blocks} "
                "leave for it: use a method that keeps less state, lower n or the size, or raise state_pool_mb"
            )
        raise ValueError(
            f"n={request.params.n} at {request.params.width}x{request.params.height} needs "
            f"{request.max_blocks} state-pool blocks but the pool has {num_blocks}: "
            "lower n or the size, or raise state_pool_mb"
        )
