"""The model adapter interface: the scheduler and runner know families only through this."""
from __future__ import annotations

import math
from abc import ABC, abstractmethod
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, ContextManager

import torch

from dvllm.host_copy import device_index
from dvllm.models.layout import BatchLayout
from dvllm.sampling_params import image_sizes
from dvllm.step_cache import CacheLayout

# One text's conditioning, e.g. {"prompt_embeds": [1, L, D]}; the runner stacks them per key.
Conditions = dict[str, torch.Tensor]


@dataclass(frozen=True)
class ModelInfo:
    """What the driver needs to know of the model: small, picklable, no tensors."""

    name: str
    family: str
    pipeline_class: str
    scheduler_config: dict[str, Any]
    default_steps: int
    default_guidance: float
    default_height: int
    default_width: int
    size_factor: int  # height and width must be multiples of this
    latent_channels: int
    latent_scale: int  # pixels per latent pixel along each side
    # One text's Conditions: key -> shape (no batch dimension); the pool stores them flat, in this order.
    condition_shapes: dict[str, tuple[int, ...]]
    supports_cfg: bool = True
    cfg_needs_negative_prompt: bool = False  # Qwen-Image's "true CFG" runs only with a negative prompt
    cfg_threshold: float = 1.0  # CFG for guidance above this (Z-Image: above 0)
    supports_img2img: bool = False
    default_strength: float = 0.8  # the img2img pipeline's default
    # Inpainting (SamplingParams.mask_image): the per-image state it keeps at latent resolution, in channels
    # (StableDiffusionAdapter.prepare_inpaint says which); 0: the family does not inpaint.
    inpaint_channels: int = 0
    default_inpaint_strength: float = 1.0  # the inpainting pipeline's default
    requires_mask: bool = False   # an inpainting UNet (9 input channels): every image request brings a mask
    # The denoiser reads each row's input state (the 9-channel UNet's mask and masked-image latents, an edit
    # model's image latents) as conditions["image_inputs"]: [rows, numbers], zero-padded to the batch's longest.
    denoiser_takes_inputs: bool = False
    # Edit models (Qwen-Image-Edit): every request brings its images, which condition the prompt and the
    # denoiser instead of setting the start (no strength); at most max_input_images of them.
    requires_image: bool = False
    image_sets_start: bool = True
    max_input_images: int = 1
    # (input images' (width, height)s) -> the (height, width) of a request that names none; None: img2img's
    # rule (the image's size). A module-level function: picklable.
    edit_size: Callable[[tuple[tuple[int, int], ...]], tuple[int, int]] | None = None
    # (height, width, input images' (width, height)s) -> numbers per image of the request's private input
    # state (Qwen-Image-Edit's image latents; sizes None: the most); None: none beyond inpainting's.
    edit_numel: Callable[[int, int, tuple[tuple[int, int], ...] | None], int] | None = None
    # (input images' (width, height)s) -> each image's token grid (rows, columns), which the denoiser gets
    # per row as conditions["image_grids"].
    edit_grids: Callable[[tuple[tuple[int, int], ...]], tuple[tuple[int, int], ...]] | None = None
    # An edit model's text encoder reads the prompt with the images (Qwen-Image-Edit): encode_prompt gets them
    # and the prompt cache keys the images' digest too. False (FLUX.1 Kontext): the prompt alone.
    prompt_reads_images: bool = False
    # Packed latents (Flux, Qwen-Image): patches of latent_patch x latent_patch latent pixels become
    # one token of channels * latent_patch**2 features. 0: unpacked [C, h, w] latents.
    latent_patch: int = 0
    # (height, width, num_steps, scheduler config) -> extra set_timesteps arguments, for schedules that
    # depend on the image (flow matching's resolution-dependent shift). A module-level function: picklable.
    timestep_kwargs: Callable[[int, int, int, dict[str, Any]], dict[str, Any]] | None = None
    # What the pipeline's denoising loop passes to scheduler.step besides (output, t, sample), each only
    # when that step() takes it: SD and SDXL's prepare_extra_step_kwargs pass eta and generator; the DiT
    # pipelines pass nothing. default_eta is the pipeline's eta default (None: it takes no eta).
    step_kwargs: tuple[str, ...] = ()
    default_eta: float | None = None
    # The text encoder's length, as the pipeline's __call__ takes it (None: it takes none): its default
    # and the range a request may ask for. Masked text (Qwen-Image, Z-Image) lets any length in the range
    # share a forward; unmasked T5 text (Flux, SD3) would not, so those serve their default only.
    max_sequence_length: int | None = None
    sequence_length_range: tuple[int, int] | None = None
    # Step caching (SamplingParams.cache): how big a row's cache state is; None: the family serves none.
    cache_layout: CacheLayout | None = None
    # SDXL UNets trained with an aesthetic score in their time ids (the refiner; requires_aesthetics_score):
    # image requests only, each with a score for its prompt rows and one for its negative rows.
    aesthetic_scores: bool = False
    default_sampler: str | None = None  # None: the model's own scheduler (model_defaults.py may name another)
    device: str = ""  # where the worker holds it, and in which dtype ("auto" resolved): set by the worker
    dtype: str = ""

    def uses_cfg(self, guidance_scale: float, negative_prompt: str | None = None) -> bool:
        """As diffusers: guidance above 1 adds unconditional rows (with some models, only for a negative prompt)."""
        if self.cfg_needs_negative_prompt and negative_prompt is None:
            return False
        return self.supports_cfg and guidance_scale > self.cfg_threshold

    def latent_shape(self, height: int, width: int) -> tuple[int, ...]:
        """One image's latents as the denoiser takes them (no batch dimension)."""
        c, h, w = self.latent_channels, height // self.latent_scale, width // self.latent_scale
        if self.latent_patch:
            p = self.latent_patch
            return ((h // p) * (w // p), c * p * p)
        return (c, h, w)

    def latent_numel(self, height: int, width: int) -> int:
        return math.prod(self.latent_shape(height, width))

    def input_numel(self, height: int, width: int, image: Any, inpaint: bool) -> int:
        """Numbers per image of what a request's input image(s) leave in its private state: inpainting's
        mask and latents, an edit model's image latents (0: nothing, text-to-image and img2img)."""
        if inpaint:
            return self.inpaint_channels * (height // self.latent_scale) * (width // self.latent_scale)
        if image is None or self.edit_numel is None:
            return 0
        return self.edit_numel(height, width, image_sizes(image))

    def input_grids(self, image: Any) -> tuple[tuple[int, int], ...]:
        """An edit request's input images' token grids; () for other requests."""
        if image is None or self.edit_grids is None:
            return ()
        return self.edit_grids(image_sizes(image))

    def most_input_numel(self, height: int, width: int) -> int:
        """The most numbers per image a request of this size can bring as input state."""
        inpaint = self.input_numel(height, width, None, True)
        return max(inpaint, self.edit_numel(height, width, None) if self.edit_numel is not None else 0)

    @property
    def condition_numel(self) -> int:
        return sum(math.prod(shape) for shape in self.condition_shapes.values())


@dataclass
class CacheSpec:
    """Where a family's transformer has what the step-cache methods hook (worker/step_cache_hooks.py)."""

    layout: CacheLayout
    blocks: list[torch.nn.Module]     # in call order: the first is first_block's head, the last its tail
    attention: list[torch.nn.Module]  # what TaylorSeer predicts (diffusers' default attention patterns)
    attention_kinds: list[tuple[str, ...]]  # per module, its outputs' token kinds
    hidden_index: int | None = 1      # the hidden stream's place in a block's output tuple (None: the output)
    hidden_arg: str = "hidden_states"  # the blocks' argument that carries it
    # Where rows have sequences of their own lengths (Z-Image), the blocks' [rows, tokens] mask of real tokens:
    # first_block's measure then covers each row's real tokens only, so it cannot depend on the batch.
    mask_arg: str | None = None
    # The pipeline calls cond and uncond apart (Qwen-Image, with cache_context): each CFG branch decides
    # for itself. Otherwise a request's CFG rows are one call and one decision.
    separate_cfg_branches: bool = False


def transformer_cache_spec(blocks: list[torch.nn.Module], attention: list[tuple[torch.nn.Module, tuple[str, ...]]],
                           inner_dim: int, pixels_per_token: int, dtype: torch.dtype, text_tokens: int | None,
                           hidden_kind: str = "image", token_multiple: int = 1, text_bytes_extra: int | None = None,
                           **spec: Any) -> CacheSpec:
    layout = CacheLayout(inner_dim=inner_dim, pixels_per_token=pixels_per_token,
                         attention_outputs=tuple(kind for _, kinds in attention for kind in kinds),
                         text_tokens=text_tokens, element_bytes=torch.empty((), dtype=dtype).element_size(),
                         hidden_kind=hidden_kind, token_multiple=token_multiple, text_bytes_extra=text_bytes_extra)
    return CacheSpec(layout=layout, blocks=blocks, attention=[m for m, _ in attention],
                     attention_kinds=[kinds for _, kinds in attention], **spec)


class ModelAdapter(ABC):
    """Wraps one diffusers pipeline; its modules stay black boxes."""

    # model_index.json `_class_name`s this adapter serves
    pipeline_classes: ClassVar[tuple[str, ...]] = ()
    # keyword arguments for `Pipeline.from_pretrained` (e.g. skip optional parts)
    load_kwargs: ClassVar[dict[str, Any]] = {}
    # dtype="auto" on a GPU: the half precision the family's pipelines document (the UNets run in float16;
    # the DiTs in bfloat16, Flux overflowing in float16)
    half_dtype: ClassVar[torch.dtype] = torch.float16
    # The pipeline's own code runs the VAE in the denoiser's dtype (FluxKontextPipeline.prepare_latents): no
    # vae_dtype of its own
    vae_follows_dtype: ClassVar[bool] = False

    def __init__(self, pipeline: Any, name: str, device: torch.device, dtype: torch.dtype) -> None:
        self.pipeline = pipeline
        self.name = name
        self.device = device
        self.dtype = dtype
        self.encoder_device = device  # where encode_prompt runs the text encoders (place_text_encoders)
        # (rows, their index on the device) -> a context in which the forward runs on those of its rows (the
        # worker's RowScope.narrow)
        self.narrow_rows: Callable[[list[int], torch.Tensor], ContextManager[None]] = lambda rows, index: nullcontext()

    @property
    @abstractmethod
    def info(self) -> ModelInfo: ...

    def place_text_encoders(self, device: torch.device) -> None:
        """The text encoders on `device` (EngineConfig.encoder_device): encode_prompt runs them there, and
        `on_device` brings their conditions to the denoiser's device."""
        for name, component in self.pipeline.components.items():
            if name.startswith("text_encoder") and isinstance(component, torch.nn.Module):
                component.to(device)
        self.encoder_device = device

    def place_vae(self, dtype: torch.dtype) -> None:
        """The VAE in its own dtype (EngineConfig.vae_dtype): encode and decode cast to it and back."""
        if self.vae_follows_dtype and dtype != self.dtype:
            raise ValueError(f"vae_dtype: the {self.info.family} pipeline encodes its input images in the "
                             f"denoiser's dtype ({str(self.dtype).removeprefix('torch.')}); its VAE cannot run in "
                             "another")
        self.pipeline.vae.to(dtype)

    def on_device(self, conditions: list[Conditions]) -> list[Conditions]:
        """Conditions encoded on the encoders' device, on the denoiser's."""
        if self.encoder_device == self.device:
            return conditions
        return [{key: value.to(self.device) for key, value in c.items()} for c in conditions]

    @classmethod
    def before_loading(cls) -> None:
        """Whatever the process needs before this family's pipeline can be loaded (nothing, mostly)."""

    def call_per_group(self, keys: list[Any], out_like: torch.Tensor,
                       call: Callable[[list[int], Any], torch.Tensor]) -> torch.Tensor:
        """One transformer call per distinct key, for rows that cannot share a call (other input-image shapes).
        `call(rows, index)` gets the group's row numbers and what selects them (a slice when every row is in the
        one group: nothing is copied) and returns the group's output, which lands in those rows. Each call runs
        with the row scope narrowed to its rows, so modules that treat rows apart (LoRA layers) know them."""
        if len(set(keys)) == 1:
            return call(list(range(len(keys))), slice(None))
        out = torch.empty_like(out_like)
        for key in dict.fromkeys(keys):
            rows = [i for i, k in enumerate(keys) if k == key]
            index = device_index(rows, out_like.device)
            with self.narrow_rows(rows, index):
                out[index] = call(rows, index)
        return out

    def scheduler_config(self) -> dict[str, Any]:
        """The pipeline's scheduler config, with its class name: what every sampler is built from."""
        scheduler = self.pipeline.scheduler
        return {**scheduler.config, "_class_name": type(scheduler).__name__}

    def probe_condition_shapes(self) -> dict[str, tuple[int, ...]]:
        """One text's Conditions shapes, read off an encoding of the empty prompt."""
        with torch.inference_mode():
            probe = self.encode_prompt([("", False)])[0]
        return {key: tuple(value.shape[1:]) for key, value in probe.items()}

    @abstractmethod
    def encode_prompt(self, texts: list[tuple[str | None, bool]],
                      max_sequence_length: int | None = None) -> list[Conditions]:
        """One text-encoder pass for all (text, is_negative) items; one Conditions each. max_sequence_length:
        the request's (None: the pipeline's default), for families whose pipeline takes one."""

    def latent_shape(self, height: int, width: int) -> tuple[int, ...]:
        """Shape of one image's latents, without the batch dimension."""
        return self.info.latent_shape(height, width)

    @abstractmethod
    def prepare_latents(self, n: int, height: int, width: int, generator: torch.Generator,
                        init_noise_sigma: float) -> torch.Tensor:
        """Initial noise for n images, drawn exactly as the diffusers pipeline draws it."""

    def encode_image(self, image: Any, n: int, height: int, width: int, generator: torch.Generator,
                     start_noise: tuple[float, float]) -> torch.Tensor:
        """Image-to-image start latents: the image through the VAE, noised as the img2img pipeline does."""
        raise ValueError(f"image-to-image is not supported for the {self.info.family} family")

    @abstractmethod
    def denoise(self, latents: torch.Tensor, timesteps: torch.Tensor, conditions: Conditions,
                guidance: torch.Tensor, layout: BatchLayout) -> torch.Tensor:
        """One batched forward; every tensor has one row per model row. What the rows are (their size, texts'
        lengths, input images) the layout says, on the host: nothing here reads a tensor back to learn it."""

    def step_conditions(self, layout: BatchLayout, dtype: torch.dtype) -> Conditions:
        """Per-row inputs the forward takes beyond the stored conditions, built on the host from the layout
        and the rows' guidance (the worker copies them to the device without a wait); none for most families."""
        return {}

    def graph_key(self, layout: BatchLayout) -> Any:
        """What of the layout a forward's shapes and control flow depend on: a CUDA graph is captured per key."""
        return layout.image_size

    def combine_guidance(self, cond: torch.Tensor, uncond: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """Classifier-free guidance, as the diffusers pipelines write it; scale broadcasts per row."""
        return uncond + scale * (cond - uncond)

    @abstractmethod
    def decode(self, latents: torch.Tensor, image_size: tuple[int, int]) -> torch.Tensor:
        """Batched VAE decode to [B, 3, H, W] images in [0, 1]."""

    def cache_spec(self) -> CacheSpec | None:
        """The transformer's parts step caching hooks; None: the family serves no step caching."""
        return None

    def cache_layout(self, spec: CacheSpec | None = None) -> CacheLayout | None:
        """What ModelInfo carries of the spec. A transformer of one block has no tail apart from its head
        (first_block could keep no tail residual): it serves no caching."""
        spec = spec or self.cache_spec()
        return spec.layout if spec is not None and len(spec.blocks) >= 2 else None
