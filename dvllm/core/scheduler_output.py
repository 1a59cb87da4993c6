"""What crosses from the driver to the workers and back each iteration: small metadata."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from dvllm.core.stage_stats import StageStats
from dvllm.lora.ref import LoraRef
from dvllm.request_sizes import size_of


@dataclass
class BlockTables:
    """Where a request's state lives in the worker's state pool (block ids)."""

    latents: list[list[int]]               # one list per image
    history: list[list[int]] | None        # one list per history slot of each image (image by image), multistep samplers
    cond: list[int]                        # the prompt's conditions (may be shared with other requests)
    uncond: list[int] | None               # the negative prompt's, with CFG
    cache: list[list[int]] | None = None   # step-cache state, one list per model row (cond rows, then uncond)
    inputs: list[list[int]] | None = None  # what its input image(s) left (inpainting, edits), one list per image
    write_cond: bool = True                # the worker must fill cond (a cache miss)
    write_uncond: bool = True
    # its controls' prepared images, one entry per control (shared like prompts: identical images, one copy),
    # and which of them the worker must fill
    controls: tuple[tuple[int, ...], ...] = ()
    write_controls: tuple[bool, ...] = ()


@dataclass(frozen=True)
class StartJob:
    """What a new request's start latents are made of (worker/start_latents.py): at admission, or ahead of it by
    the encode stage for a request with input images (their VAE encode)."""

    request_id: str
    n: int
    height: int
    width: int
    seed: int
    plan: Any
    image: Any = None
    mask: Any = None
    strength: float = 1.0
    edit: bool = False  # the images condition an edit model instead of setting the start
    num_frames: int | None = None  # a video's frames (None: an image)
    # its ControlNet controls (images prepared at admission): their inputs are made first, with its generator
    controls: tuple = ()

    @property
    def size(self) -> tuple[int, ...]:
        return size_of(self.height, self.width, self.num_frames)


@dataclass
class NewRequestData:
    """Sent once, when a request is admitted; afterwards the worker knows it by id."""

    request_id: str
    prompt: str
    negative_prompt: str | None
    n: int
    height: int
    width: int
    seed: int
    guidance_scale: float
    cfg: bool
    output_type: str
    plan: Any  # dvllm.samplers.SamplerPlan
    blocks: BlockTables
    preview_steps: frozenset[int] = frozenset()  # after these step counts, decode a preview
    image: Any = None  # image-to-image: the start image (PIL, RGB), sent once; edit models: a tuple of them
    mask: Any = None   # inpainting: the mask (PIL), white where to repaint
    strength: float | None = None  # image-to-image and inpainting
    input_numel: int = 0  # numbers per image of its input state (in blocks.inputs)
    input_grids: tuple[tuple[int, int], ...] = ()  # an edit's input images' token grids
    image_key: str | None = None  # their digest
    max_sequence_length: int | None = None  # the text encoder's length (None: the pipeline takes none)
    cache: Any = None  # its step cache (dvllm.step_cache.CacheConfig), or None
    loras: tuple[tuple[str, float], ...] = ()       # (adapter digest, weight): applied to all its rows
    text_loras: tuple[tuple[str, float], ...] = ()  # those that change the text encoders too
    aesthetic_scores: tuple[float, float] | None = None  # (prompt's, negative's), for models that take them
    num_frames: int | None = None  # a video's frames (None: an image)
    guidance_scale_2: float | None = None  # a two-expert model's scale while its second expert runs
    decode_tiled: bool = False  # its VAE decodes (previews too) run in tiles (admission chose: decode_budget.py)
    controls: tuple = ()  # dvllm.controls.Control with the image prepared at admission ([1, 3, H, W] float32)
    image_prompt: Any = None  # dvllm.ip_adapters.ImagePrompt: its IP-Adapter image prompt (None: none)

    @property
    def size(self) -> tuple[int, ...]:
        return size_of(self.height, self.width, self.num_frames)

    def start_job(self) -> StartJob:
        return StartJob(self.request_id, self.n, self.height, self.width, self.seed, self.plan, self.image,
                        self.mask, self.strength, bool(self.input_grids), self.num_frames, self.controls)


@dataclass
class ResumedRequestData:
    """A preempted request readmitted: its swapped-out state goes into these blocks."""

    request_id: str
    blocks: BlockTables


@dataclass
class SchedulerOutput:
    iteration: int
    # In this order on the worker: load LoRA adapters into slots (slot, adapter id: the worker reads the file
    # itself), swap out the preempted, then fill the new and the resumed.
    lora_loads: list[tuple[int, LoraRef]] = field(default_factory=list)
    # Adapters to read into the worker's host memory, off its step loop (core/lora_reads.py), first of all
    lora_reads: list[LoraRef] = field(default_factory=list)
    preempted_ids: list[str] = field(default_factory=list)
    new_requests: list[NewRequestData] = field(default_factory=list)
    resumed_requests: list[ResumedRequestData] = field(default_factory=list)
    # One denoiser forward: these requests (one latent shape) each take their next step. The scheduler
    # alone counts progress: it says which step each takes, and which take their last (to decode).
    scheduled_ids: list[str] = field(default_factory=list)
    step_indices: list[int] = field(default_factory=list)  # aligned with scheduled_ids
    finishing_ids: list[str] = field(default_factory=list)
    num_rows: int = 0  # denoiser rows of that forward (CFG rows included)
    # Requests whose state the workers must drop (aborted).
    freed_ids: list[str] = field(default_factory=list)
    # Requests are in the worker's decode stage and nothing else is to run: the worker waits (briefly) for
    # their images instead.
    await_decodes: bool = False
    await_encodes: bool = False  # likewise, for texts of waiting requests the encode stage is on
    await_lora_reads: bool = False  # likewise, for adapters of waiting requests being read
    # The worker's encode stage: texts (text, negative, max_sequence_length, images' digest) to encode ahead of
    # admission, first of all; and texts to forget (no waiting request needs them).
    encode_jobs: list[tuple] = field(default_factory=list)
    encode_drops: list[tuple] = field(default_factory=list)
    encode_images: dict[str, Any] = field(default_factory=dict)  # digest -> the images an edit's texts are read with
    encode_starts: list[StartJob] = field(default_factory=list)  # start latents of waiting requests with images
    encode_image_prompts: dict[str, Any] = field(default_factory=dict)  # request id -> its IP-Adapter image prompt

    @property
    def is_empty(self) -> bool:
        return not (self.new_requests or self.resumed_requests or self.scheduled_ids or self.freed_ids
                    or self.preempted_ids or self.await_decodes or self.await_encodes or self.encode_jobs
                    or self.encode_drops or self.lora_reads or self.await_lora_reads
                    or self.encode_starts or self.encode_image_prompts)


@dataclass
class RunnerOutput:
    # Requests that took their last step, this step or (through the decode stage) an earlier one: their final
    # images (in the requested output type).
    images: dict[str, list[Any]] = field(default_factory=dict)
    # Requests that failed on the worker, with the message; the worker has freed them.
    errors: dict[str, str] = field(default_factory=dict)
    # Partial images of requests that asked for previews, decoded this step (or, by the decode stage, since
    # the last one).
    previews: dict[str, list[Any]] = field(default_factory=dict)
    preview_steps: dict[str, int] = field(default_factory=dict)  # the step count each request's previews show
    # Requests that took their last step and whose latents went to the decode stage: their images come in a
    # later output (their state-pool blocks are free now).
    decoding_ids: list[str] = field(default_factory=list)
    # Step caching this iteration: requests for which the step was cached (every branch skipped), and the
    # cache rows that skipped and that computed.
    cached_ids: list[str] = field(default_factory=list)
    cache_rows: tuple[int, int] = (0, 0)
    # LoRA slots the worker could not load an adapter into (left empty; their requests are in errors).
    failed_lora_slots: list[int] = field(default_factory=list)
    # Adapter reads that ended since the last output (digests; a failed one fails at its load), and adapters the
    # worker's host cache let go.
    loras_read: list[str] = field(default_factory=list)
    loras_dropped: list[str] = field(default_factory=list)
    # The encode stage since the last output: texts now ready to take, and texts it could not encode (-> why).
    encoded: list[tuple] = field(default_factory=list)
    encode_errors: dict[tuple, str] = field(default_factory=dict)
    # Wall time of the step on the worker: the driver's round trip minus this is the executor's overhead.
    execute_seconds: float = 0.0
    # The step's busy seconds and items per stage (encode, denoise, decode in the loop; the decode stage's since
    # the last output): the stage metrics.
    stages: StageStats = field(default_factory=StageStats)
    # Each stage process's heartbeat as the step ends (StageProcess.health, with its "stage" and "index"): the
    # encode and decode workers', the worker group's members'.
    stage_processes: list[dict] = field(default_factory=list)
