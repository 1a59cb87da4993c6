"""The engine's IP-Adapter loaded at start through diffusers' own loader, and its image embeddings.

The CLIP image encoder (ip_adapter_image_encoder, else the image_encoder folder beside the weights, where
load_ip_adapter looks for SD's) is loaded in the denoiser's dtype and registered on the pipeline the model adapter
holds; `load_ip_adapter` then reads the weights, makes the feature extractor, sets the denoiser's IP-Adapter
attention processors and its image projection. A UNet's projection is taken off it (a forward without image
prompts then runs as the UNet without the adapter; Flux's transformer only runs its own when given embeds) and
each IP-Adapter processor is replaced by one that scales row by row (image_prompts.py, image_prompts_flux.py).

A request's image embeds are made once, as the pipeline's encode_image makes them: the image encoder's
image_embeds, with zeros for the unconditional rows, or (SD plus adapters, whose projection is not an
ImageProjection) its penultimate hidden states, with those of an all-zero image for the unconditional rows.
Flux serves no unconditional rows (its true CFG is not served). The last few images' embeds are kept, so
repeated image prompts are encoded once. With the encode stage on, a request that waits behind a running batch
has its image encoded on the stage's thread (worker/encode_stage.py) and the loop takes the embeds at admission;
the loop encodes the others at admission (the stage off, or an idle engine, where no one is stalled). Both sides
encode under one lock, so the kept embeds stay coherent and an image the stage is encoding is not encoded twice.
"""
from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from typing import Any, Callable

import torch

from dvllm.ip_adapters import Location, folder_location, weights_location
from dvllm.models.base import ModelAdapter, denoiser_of
from dvllm.worker.forward_context import ForwardHooks
from dvllm.worker.image_prompts import ImagePromptRows, RowScaledIPAttnProcessor
from dvllm.worker.request_state import RequestState

_KEPT_EMBEDS = 16  # images whose embeds are kept


class IPAdapter:
    def __init__(self, adapter: ModelAdapter, projection: torch.nn.Module) -> None:
        pipe = adapter.pipeline
        self.encoder, self.feature_extractor = pipe.image_encoder, pipe.feature_extractor
        self.projection = projection
        from diffusers.models.embeddings import ImageProjection

        layer = projection.image_projection_layers[0]
        # an SD plus adapter reads hidden states (Flux's pipeline reads image_embeds whatever its projection)
        self.hidden_states = adapter.ip_adapter_kind == "unet" and not isinstance(layer, ImageProjection)
        self.device = adapter.device
        # digest -> (embeds, the CUDA event after which they are ready: another thread's stream may have made them)
        self._kept: OrderedDict[str, tuple[tuple[torch.Tensor, torch.Tensor], Any]] = OrderedDict()
        self._lock = threading.Lock()  # the encode stage's thread and the loop: one encode (and cache) at a time

    def embeds(self, state: RequestState) -> tuple[torch.Tensor, torch.Tensor]:
        """The request's (conditional, unconditional) image embeds, each [1, ...] (made at its first step)."""
        if state.image_prompt_embeds is None:
            state.image_prompt_embeds = self.encode(state.data.image_prompt.image)
        return state.image_prompt_embeds

    def encode_admitted(self, states: list[RequestState],
                        ahead: Callable[[str], tuple[torch.Tensor, torch.Tensor] | None] | None = None
                        ) -> dict[str, str]:
        """The image prompts of requests admitted now encoded (before their first step), unless `ahead(request)`
        has their embeds (the encode stage made them); {request: why} for those whose encode failed (they fail
        alone)."""
        errors = {}
        for state in states:
            if state.data.image_prompt is not None:
                if state.image_prompt_embeds is None and ahead is not None:
                    state.image_prompt_embeds = ahead(state.request_id)
                try:
                    self.embeds(state)
                except Exception as e:  # noqa: BLE001 - it fails that request only
                    errors[state.request_id] = f"image prompt encoding failed: {type(e).__name__}: {e}"
        return errors

    @torch.inference_mode()
    def encode(self, image: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """The image's (conditional, unconditional) embeds, ready on the caller's CUDA stream (the encode stage's
        thread or the loop's)."""
        digest = hashlib.sha256(f"{image.mode}{image.size}".encode() + image.tobytes()).hexdigest()
        with self._lock:
            held = self._kept.get(digest)
            if held is not None:
                self._kept.move_to_end(digest)
                embeds, made = held
                if made is not None:
                    stream = torch.cuda.current_stream()
                    stream.wait_event(made)
                    for tensor in embeds:
                        tensor.record_stream(stream)
                return embeds
            embeds = self._run_encoder(image)
            made = None
            if self.device.type == "cuda":
                made = torch.cuda.Event()
                made.record()
            self._kept[digest] = embeds, made
            if len(self._kept) > _KEPT_EMBEDS:
                self._kept.popitem(last=False)
        return embeds

    def _run_encoder(self, image: Any) -> tuple[torch.Tensor, torch.Tensor]:
        encoder = self.encoder
        pixels = self.feature_extractor(image, return_tensors="pt").pixel_values.to(self.device, encoder.dtype)
        if self.hidden_states:
            cond = encoder(pixels, output_hidden_states=True).hidden_states[-2]
            uncond = encoder(torch.zeros_like(pixels), output_hidden_states=True).hidden_states[-2]
        else:
            cond = encoder(pixels).image_embeds
            uncond = torch.zeros_like(cond)  # (SD's; Flux has no unconditional rows to read it)
        return cond, uncond


def load_ip_adapter(weights: str | None, image_encoder: str | None, adapter: ModelAdapter) -> IPAdapter | None:
    """The adapter loaded into the pipeline (None: the engine serves none); ValueError naming what does not load,
    or the family that takes none."""
    if weights is None:
        return None
    if adapter.ip_adapter_kind is None:
        raise ValueError(f"ip_adapter: the {adapter.info.family} family takes no IP-Adapter in dvllm yet "
                         "(SD 1.x/2.x, SDXL and Flux do)")
    pipe, where = adapter.pipeline, weights_location(weights)
    at = folder_location(image_encoder) if image_encoder is not None else \
        Location(where.root, "/".join(p for p in (where.subfolder, "image_encoder") if p))
    try:
        from transformers import CLIPVisionModelWithProjection

        encoder = CLIPVisionModelWithProjection.from_pretrained(at.root, subfolder=at.subfolder or None,
                                                                torch_dtype=adapter.dtype)
    except Exception as e:  # a missing folder, another model: the operator's to fix
        raise ValueError(f"ip_adapter_image_encoder: {at.root}{'/' + at.subfolder if at.subfolder else ''} does "
                         f"not load as a CLIPVisionModelWithProjection: {e}") from e
    pipe.register_modules(image_encoder=encoder.to(adapter.device).eval())
    try:
        pipe.load_ip_adapter(where.root, subfolder=where.subfolder, weight_name=where.name)
    except Exception as e:  # a missing file, another model's weights: the operator's to fix
        raise ValueError(f"ip_adapter: {weights} does not load as this model's IP-Adapter: {e}") from e
    denoiser = denoiser_of(pipe)
    projection = denoiser.encoder_hid_proj
    if adapter.ip_adapter_kind == "unet":
        denoiser.encoder_hid_proj = None
    return IPAdapter(adapter, projection)


def install_row_processors(ip_adapter: IPAdapter, adapter: ModelAdapter, hooks: ForwardHooks) -> None:
    """Every IP-Adapter processor of the denoiser replaced by a row-scaled one with its weights."""
    rows = ImagePromptRows(ip_adapter.projection, hooks)
    denoiser = denoiser_of(adapter.pipeline)
    if adapter.ip_adapter_kind == "flux":
        from diffusers.models.transformers.transformer_flux import FluxAttnProcessor, FluxIPAdapterAttnProcessor

        from dvllm.worker.image_prompts_flux import RowScaledFluxIPAttnProcessor

        def replaced(processor: Any) -> Any:
            return RowScaledFluxIPAttnProcessor(processor, FluxAttnProcessor(), rows) \
                if isinstance(processor, FluxIPAdapterAttnProcessor) else processor
    else:
        from diffusers.models.attention_processor import AttnProcessor2_0, IPAdapterAttnProcessor2_0

        def replaced(processor: Any) -> Any:
            if type(processor).__name__.startswith("IPAdapter") and \
                    not isinstance(processor, IPAdapterAttnProcessor2_0):
                raise ValueError(f"ip_adapter: the UNet's attention runs {type(processor).__name__} (xformers); "
                                 "IP-Adapter is served with attention_backend native")
            return RowScaledIPAttnProcessor(processor, AttnProcessor2_0(), rows) \
                if isinstance(processor, IPAdapterAttnProcessor2_0) else processor
    denoiser.set_attn_processor({name: replaced(p) for name, p in denoiser.attn_processors.items()})
