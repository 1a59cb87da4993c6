"""The model adapter interface: the scheduler and runner know families only through this."""
from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, ContextManager, Protocol

import torch

from dvllm.host_copy import device_index
from dvllm.models.layout import BatchLayout
from dvllm.models.model_info import ModelInfo
from dvllm.step_caches.layout import CacheLayout

# One text's conditioning, e.g. {"prompt_embeds": [1, L, D]}; the runner stacks them per key.
Conditions = dict[str, torch.Tensor]


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
                           temporal_scale: int = 0, **spec: Any) -> CacheSpec:
    layout = CacheLayout(inner_dim=inner_dim, pixels_per_token=pixels_per_token,
                         attention_outputs=tuple(kind for _, kinds in attention for kind in kinds),
                         text_tokens=text_tokens, element_bytes=torch.empty((), dtype=dtype).element_size(),
                         hidden_kind=hidden_kind, token_multiple=token_multiple, text_bytes_extra=text_bytes_extra,
                         temporal_scale=temporal_scale)
    return CacheSpec(layout=layout, blocks=blocks, attention=[m for m, _ in attention],
                     attention_kinds=[kinds for _, kinds in attention], **spec)


def denoiser_component(pipeline: Any) -> str:
    """The name of a pipeline's denoiser: "transformer", or "unet" (what LoRA files name its layers by)."""
    return "transformer" if getattr(pipeline, "transformer", None) is not None else "unet"


def denoiser_of(pipeline: Any) -> torch.nn.Module:
    """A pipeline's denoiser: its transformer, or its UNet."""
    return getattr(pipeline, denoiser_component(pipeline))


class HookContext(Protocol):
    """What a forward whose modules run hooks (LoRA rows, step caching) is given by the worker, for its span
    (worker/forward_context.py's ForwardContext): the hooks read the forward's plans from it; the adapter only
    says which rows a call of its own runs on."""

    def narrow(self, rows: list[int], index: Any) -> ContextManager[None]: ...


def denoisers_of(pipeline: Any) -> list[torch.nn.Module]:
    """Every denoiser a pipeline runs: its transformer or UNet, and a two-expert model's second transformer."""
    second = getattr(pipeline, "transformer_2", None)
    return [denoiser_of(pipeline)] + ([second] if isinstance(second, torch.nn.Module) else [])


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
    # The diffusers class of the controlnets its denoiser takes (EngineConfig.controlnets); None: none yet
    controlnet_class: ClassVar[str | None] = None
    # The class of its union controlnets where that is another one (SDXL's ControlNetUnionModel; Flux's are
    # FluxControlNetModels with num_mode): a folder whose config names it loads as it
    union_controlnet_class: ClassVar[str | None] = None
    # How its denoiser takes an IP-Adapter (EngineConfig.ip_adapter): "unet" (diffusers' IPAdapterMixin) or
    # "flux" (FluxIPAdapterMixin); None: none yet
    ip_adapter_kind: ClassVar[str | None] = None

    def __init__(self, pipeline: Any, name: str, device: torch.device, dtype: torch.dtype) -> None:
        self.pipeline = pipeline
        self.name = name
        self.device = device
        self.dtype = dtype
        self.encoder_device = device  # where encode_prompt runs the text encoders (place_text_encoders)
        # Held around every call into the VAE where the VAE keeps state between calls: Wan's and Qwen-Image's
        # causal VAEs cache features in the module, and each encode or decode resets both caches, so the loop,
        # the encode stage (input images) and the decode stage would mix each other's batches. Other VAEs keep
        # nothing: their encodes and decodes still overlap.
        vae = getattr(pipeline, "vae", None)
        self.vae_lock: ContextManager[Any] = threading.Lock() if hasattr(vae, "clear_cache") else nullcontext()

    @property
    @abstractmethod
    def info(self) -> ModelInfo: ...

    @property
    def state_dtype(self) -> torch.dtype:
        """What the state pool keeps latents (and everything else) in: the dtype the pipeline steps its latents
        in. Most pipelines keep them in the denoiser's dtype; Wan's keep float32 beside a bfloat16 transformer."""
        return self.dtype

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

    def call_per_group(self, keys: list[Any], out_like: torch.Tensor, call: Callable[[list[int], Any], torch.Tensor],
                       context: HookContext | None) -> torch.Tensor:
        """One transformer call per distinct key, for rows that cannot share a call (other input-image shapes).
        `call(rows, index)` gets the group's row numbers and what selects them (a slice when every row is in the
        one group: nothing is copied) and returns the group's output, which lands in those rows. Each call runs
        with the forward's context narrowed to its rows, so hooks that treat rows apart (LoRA layers) know them."""
        if len(set(keys)) == 1:
            return call(list(range(len(keys))), slice(None))
        out = torch.empty_like(out_like)
        for key in dict.fromkeys(keys):
            rows = [i for i, k in enumerate(keys) if k == key]
            index = device_index(rows, out_like.device)
            with nullcontext() if context is None else context.narrow(rows, index):
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
        return self.info.latents.shape(height, width)

    @abstractmethod
    def prepare_latents(self, n: int, height: int, width: int, generator: torch.Generator,
                        init_noise_sigma: float) -> torch.Tensor:
        """Initial noise for n images, drawn exactly as the diffusers pipeline draws it."""

    def prepare_video_latents(self, n: int, height: int, width: int, frames: int, generator: torch.Generator,
                              init_noise_sigma: float) -> torch.Tensor:
        """A video family's initial noise for n videos of `frames` frames, drawn as its pipeline draws it."""
        raise ValueError(f"the {self.info.family} family makes images, not videos")

    def prepare_image_to_video(self, image: Any, n: int, height: int, width: int, frames: int,
                               generator: torch.Generator, init_noise_sigma: float) -> tuple[torch.Tensor, torch.Tensor]:
        """An image-to-video family's start: (initial noise, [n, numbers] of the state the image leaves)."""
        raise ValueError(f"the {self.info.family} family does not animate images")

    def control_input(self, image: torch.Tensor, controlnet: Any, n: int, generator: torch.Generator,
                      first: Any) -> torch.Tensor | None:
        """A ControlNet control's input for a request of n images, as the family's ControlNet pipeline makes it from
        the image prepared at admission ([1, 3, H, W] float32 in [0, 1]), on the device in the controlnet's dtype
        (`first`: the request's first controlnet, whose config some pipelines read for all of its controls);
        None where the controlnet takes the prepared image itself (SD's and SDXL's, info.images.control_input_is_image):
        that is kept in the state pool, one copy for every request that sends it (worker/control_state.py)."""
        return None

    def encode_image(self, image: Any, n: int, height: int, width: int, generator: torch.Generator,
                     start_noise: tuple[float, float]) -> torch.Tensor:
        """Image-to-image start latents: the image through the VAE, noised as the img2img pipeline does."""
        raise ValueError(f"image-to-image is not supported for the {self.info.family} family")

    @abstractmethod
    def denoise(self, latents: torch.Tensor, timesteps: torch.Tensor, conditions: Conditions,
                guidance: torch.Tensor, layout: BatchLayout, context: HookContext | None = None) -> torch.Tensor:
        """One batched forward; every tensor has one row per model row. What the rows are (their size, texts'
        lengths, input images) the layout says, on the host: nothing here reads a tensor back to learn it.
        `context`: where the forward's modules run hooks, what a call on some of its rows narrows (None: no
        hook runs, as in a compiled or captured forward)."""

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
    def decode(self, latents: torch.Tensor, image_size: tuple[int, ...]) -> torch.Tensor:
        """Batched VAE decode to [B, 3, H, W] images in [0, 1]; a video family's, of image_size (height, width,
        frames), to [B, frames, 3, H, W]."""

    def follow_defaults(self, info: ModelInfo) -> ModelInfo:
        """`info` with what depends on its request defaults made from them, once model_defaults.py's layers are
        applied (the loader calls it): nothing for most families."""
        return info

    def cache_spec(self) -> CacheSpec | None:
        """The transformer's parts step caching hooks; None: the family serves no step caching."""
        return None

    def cache_layout(self, spec: CacheSpec | None = None) -> CacheLayout | None:
        """What ModelInfo carries of the spec. A transformer of one block has no tail apart from its head
        (first_block could keep no tail residual): it serves no caching."""
        spec = spec or self.cache_spec()
        return spec.layout if spec is not None and len(spec.blocks) >= 2 else None
