"""What the driver knows of a model family, as small capability specs a new family fills in.

Each spec answers one question the engine asks: what does a request get for what it leaves out (Defaults),
how do timesteps and sampler steps run (Schedule), when does CFG add rows (Guidance), what shape are the
latents (Latents), what does a prompt become (Text), which input images may a request bring (ImageInputs).
All are small, picklable and hold no tensors: they cross to the engine from the workers. Where the model was
loaded from, and on which device in which dtype, is the loading layer's (load_config.LoadedModel).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

from dvllm.param_defaults import DEFAULT_PIXELS_FACTOR
from dvllm.request_sizes import image_sizes, size_of
from dvllm.step_caches.layout import CacheLayout

# (input images' (width, height)s) -> ...; module-level functions or partials of them, so that they pickle
ImageSizes = tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class Defaults:
    """What a request gets for a field it leaves out: the pipeline's `__call__` defaults, then
    model_defaults.py's layers over them (the fields that module names)."""

    steps: int
    guidance: float
    height: int
    width: int
    sampler: str | None = None  # None: the model's own scheduler
    # A two-expert model's guidance while its low-noise expert runs (SamplingParams.guidance_scale_2). None: as the
    # pipeline, the request's guidance_scale.
    guidance_2: float | None = None
    strength: float = 0.8  # the img2img pipeline's default
    inpaint_strength: float = 1.0  # the inpainting pipeline's default


@dataclass(frozen=True)
class Schedule:
    """How the pipeline's denoising loop drives its scheduler."""

    config: dict[str, Any]  # the scheduler's config, `_class_name` included
    # (height, width, num_steps, scheduler config) -> extra set_timesteps arguments, for schedules that depend
    # on the image (flow matching's resolution-dependent shift)
    timestep_kwargs: Callable[[int, int, int, dict[str, Any]], dict[str, Any]] | None = None
    # What the loop passes to scheduler.step besides (output, t, sample), each only when that step() takes it:
    # SD and SDXL's prepare_extra_step_kwargs pass eta and generator; the DiT pipelines pass nothing.
    step_kwargs: tuple[str, ...] = ()
    eta: float | None = None  # the pipeline's eta default (None: it takes no eta)
    # The denoiser's output dtype is not the latents' (Wan keeps float32 latents beside a bfloat16 transformer).
    # The schedulers then round through the output's dtype in their own ways: the fused update repeats UniPC's
    # and DPM-Solver++'s (one product, see SamplerPlan.x0_term_in_model_dtype); the others are stepped by
    # diffusers per request.
    output_dtype_differs: bool = False


@dataclass(frozen=True)
class Guidance:
    """When classifier-free guidance adds unconditional rows."""

    supported: bool = True  # False: guidance is embedded (Flux, LCM UNets), never extra rows
    needs_negative_prompt: bool = False  # Qwen-Image's "true CFG" runs only with a negative prompt
    threshold: float = 1.0  # CFG for guidance above this (Z-Image: above 0)

    def uses_cfg(self, guidance_scale: float, negative_prompt: str | None = None) -> bool:
        """As diffusers: guidance above the threshold adds unconditional rows (with some models, only for a
        negative prompt)."""
        if self.needs_negative_prompt and negative_prompt is None:
            return False
        return self.supported and guidance_scale > self.threshold


@dataclass(frozen=True)
class Latents:
    """The latent space the denoiser works in."""

    channels: int
    scale: int  # pixels per latent pixel along each side
    size_factor: int  # height and width must be multiples of this
    # Packed latents (Flux, Qwen-Image): patches of patch x patch latent pixels become one token of
    # channels * patch**2 features. 0: unpacked [C, h, w] latents.
    patch: int = 0
    # Video latents (Wan): [C, frames, h, w], the VAE keeping the first frame and compressing each
    # `temporal_scale` after it into one latent frame. 0: image latents.
    temporal_scale: int = 0
    # The longest height or width in pixels the denoiser has positions for (Z-Image's RoPE tables; on a GPU an
    # index past them is a device-side assert that ends the process). None: any.
    max_side: int | None = None

    def shape(self, height: int, width: int, frames: int | None = None) -> tuple[int, ...]:
        """One image's (or one video's: its frames) latents as the denoiser takes them (no batch dimension)."""
        c, h, w = self.channels, height // self.scale, width // self.scale
        if self.temporal_scale:
            return (c, latent_frames(frames or 1, self.temporal_scale), h, w)
        if self.patch:
            p = self.patch
            return ((h // p) * (w // p), c * p * p)
        return (c, h, w)

    def numel(self, height: int, width: int, frames: int | None = None) -> int:
        return math.prod(self.shape(height, width, frames))

    def plane_numel(self, height: int, width: int) -> int:
        """Numbers in one channel at latent resolution."""
        return (height // self.scale) * (width // self.scale)


def latent_frames(frames: int, temporal_scale: int) -> int:
    """A video's latent frames: its first frame, then one for each `temporal_scale` after it."""
    return (frames - 1) // temporal_scale + 1


@dataclass(frozen=True)
class Video:
    """What a video family's requests get and may ask for (SamplingParams.num_frames, fps)."""

    frames: int  # the pipeline's num_frames default
    fps: float   # the model's published frame rate: what its MP4s are written at unless a request says
    # num_frames - 1 must be a multiple of this (the VAE's temporal compression)
    frame_multiple: int = 4
    # The most frames the denoiser has positions for (Wan's RoPE table): past it its forward fails. None: any.
    max_frames: int | None = None


@dataclass(frozen=True)
class Text:
    """What one prompt becomes."""

    # One text's conditions: key -> shape (no batch dimension); the pool stores them flat, in this order.
    condition_shapes: dict[str, tuple[int, ...]]
    # The text encoder's length as the pipeline's __call__ takes it (None: it takes none): its default and
    # the range a request may ask for. Masked text (Qwen-Image, Z-Image) lets any length in the range share
    # a forward; unmasked T5 text (Flux, SD3) would not, so those serve their default only.
    max_sequence_length: int | None = None
    sequence_length_range: tuple[int, int] | None = None
    # The text encoder reads the prompt with the request's images (Qwen-Image-Edit): encode_prompt gets them
    # and the prompt cache keys the images' digest too.
    reads_images: bool = False

    @property
    def condition_numel(self) -> int:
        return sum(math.prod(shape) for shape in self.condition_shapes.values())


@dataclass(frozen=True)
class ImageInputs:
    """The images a request may bring, and what they become. The default: text-to-image only."""

    img2img: bool = False  # SamplingParams.image sets the start latents (with strength)
    # Inpainting (SamplingParams.mask_image): the per-image state it keeps at latent resolution, in channels
    # (StableDiffusionAdapter.prepare_inpaint says which); 0: the family does not inpaint.
    inpaint_channels: int = 0
    requires_mask: bool = False  # an inpainting UNet (9 input channels): every image request brings a mask
    # The denoiser reads each row's input state (the 9-channel UNet's mask and masked-image latents, an edit
    # model's image latents) as conditions["image_inputs"]: [rows, numbers], zero-padded to the batch's longest.
    denoiser_takes_inputs: bool = False
    # Edit models (Qwen-Image-Edit, FLUX.1 Kontext): every request brings its images, which condition the
    # prompt and the denoiser instead of setting the start (no strength); at most max_images of them.
    required: bool = False
    sets_start: bool = True
    max_images: int = 1
    # (input sizes) -> the (height, width) of a request that names none; None: img2img's rule (the image's)
    edit_size: Callable[[ImageSizes], tuple[int, int]] | None = None
    # (height, width, input sizes or None: the most) -> numbers per image of the request's private input
    # state (Qwen-Image-Edit's image latents); None: none beyond inpainting's
    edit_numel: Callable[[int, int, ImageSizes | None], int] | None = None
    # (input sizes) -> each image's token grid (rows, columns), which the denoiser gets as conditions["image_grids"]
    edit_grids: Callable[[ImageSizes], ImageSizes] | None = None
    # SDXL UNets trained with an aesthetic score in their time ids (the refiner; requires_aesthetics_score):
    # image requests only, each with a score for its prompt rows and one for its negative rows.
    aesthetic_scores: bool = False
    # A request with ControlNet controls and no size takes its first control image's (SD's and SDXL's ControlNet
    # pipelines); False: the model's default, as FluxControlNetPipeline
    control_sets_size: bool = True
    # The controlnets take the prepared control image itself (SD's and SDXL's): it is request state in the pool, a
    # shared entry per distinct image; False: the family makes each control's input from it at the request's start
    # (ModelAdapter.control_input; Flux's: a VAE sample drawn from its generator), held with the request
    control_input_is_image: bool = True
    # A request's controls all name one controlnet (Qwen-Image's: QwenImageMultiControlNetModel takes several
    # images of one controlnet, not several controlnets)
    controls_one_controlnet: bool = False
    # Image-to-video (Wan I2V): (height, width, frames) -> numbers per video of the state its image leaves (the
    # encoded condition frames, the image encoder's embedding); None: not an image-to-video model
    video_numel: Callable[[int, int, int], int] | None = None
    # Wan 2.2 TI2V: the image's latents are the video's first latent frame (its input state), written over the
    # latents at the start and after every step instead of read by the denoiser; the image is optional
    first_frame: bool = False
    # ControlNet controls served beside the input image (image-to-image and inpainting: diffusers' ControlNet
    # img2img and inpainting pipelines); False: controls are text-to-image only
    controls: bool = False


@dataclass(frozen=True)
class ModelInfo:
    """A family's answers to the engine, one spec per concern."""

    family: str
    pipeline_class: str
    defaults: Defaults
    schedule: Schedule
    latents: Latents
    text: Text
    guidance: Guidance = field(default_factory=Guidance)
    images: ImageInputs = field(default_factory=ImageInputs)
    cache_layout: CacheLayout | None = None  # step caching (SamplingParams.cache); None: the family serves none
    video: Video | None = None  # a video family's frames and rate; None: the family makes images
    # Two experts (Wan 2.2 A14B): the timestep at and above which the first (high-noise) denoiser runs a row, the
    # second below it, each with its own guidance scale (SamplingParams.guidance_scale_2). None: one denoiser.
    expert_boundary: float | None = None
    # The engine's union controlnets (EngineConfig.controlnets): their control modes' counts by name, as the worker
    # loaded them (executor/worker.py); a control on one names a mode below it, a control on another names none
    control_modes: dict[str, int] = field(default_factory=dict)

    def expert(self, timestep: float) -> int:
        """The expert that runs a step at `timestep`: 0, or 1 below a two-expert model's boundary."""
        return int(self.expert_boundary is not None and timestep < self.expert_boundary)

    def pixel_limit(self, max_image_pixels: int | None) -> int:
        """The engine's max_image_pixels, or its default for this model: a few times an image model's native area;
        a video model's native area (each frame of a video costs what an image does)."""
        factor = 1 if self.video is not None else DEFAULT_PIXELS_FACTOR
        return max_image_pixels or factor * self.defaults.height * self.defaults.width

    @property
    def default_size(self) -> tuple[int, ...]:
        """A request's size when it names none: (height, width), and a video model's frames."""
        return size_of(self.defaults.height, self.defaults.width, None if self.video is None else self.video.frames)

    def input_numel(self, height: int, width: int, image: Any, inpaint: bool, frames: int | None = None) -> int:
        """Numbers per image of what a request's input image(s) leave in its private state: inpainting's
        mask and latents, an edit model's image latents, an image-to-video model's condition (0: nothing,
        text-to-image and img2img)."""
        if image is not None and self.images.video_numel is not None:
            return self.images.video_numel(height, width, frames or 1)
        if inpaint:
            return self.images.inpaint_channels * self.latents.plane_numel(height, width)
        if image is None or self.images.edit_numel is None:
            return 0
        return self.images.edit_numel(height, width, image_sizes(image))

    def input_grids(self, image: Any) -> ImageSizes:
        """An edit request's input images' token grids; () for other requests."""
        if image is None or self.images.edit_grids is None:
            return ()
        return self.images.edit_grids(image_sizes(image))

    def most_input_numel(self, height: int, width: int, frames: int | None = None) -> int:
        """The most numbers per image a request of this size (and frames) can bring as input state."""
        inpaint = self.input_numel(height, width, None, True)
        edit = self.images.edit_numel(height, width, None) if self.images.edit_numel is not None else 0
        video = self.images.video_numel(height, width, frames or 1) if self.images.video_numel is not None else 0
        return max(inpaint, edit, video)
