"""model_index.json `_class_name` -> the adapter that serves it."""
from __future__ import annotations

from dvllm.models.base import ModelAdapter
from dvllm.models.flux import FluxAdapter
from dvllm.models.flux_kontext import FluxKontextAdapter
from dvllm.models.qwen_image import QwenImageAdapter
from dvllm.models.qwen_image_edit import QwenImageEditAdapter
from dvllm.models.stable_diffusion import StableDiffusionAdapter
from dvllm.models.stable_diffusion_3 import StableDiffusion3Adapter
from dvllm.models.stable_diffusion_xl import StableDiffusionXLAdapter
from dvllm.models.wan import WanAdapter
from dvllm.models.wan_i2v import WanImageToVideoAdapter
from dvllm.models.z_image import ZImageAdapter

ADAPTERS: tuple[type[ModelAdapter], ...] = (
    StableDiffusionAdapter, StableDiffusionXLAdapter, StableDiffusion3Adapter, FluxAdapter, QwenImageAdapter,
    QwenImageEditAdapter, ZImageAdapter, FluxKontextAdapter, WanAdapter, WanImageToVideoAdapter,
)


def supported_pipelines() -> list[str]:
    return sorted(name for adapter in ADAPTERS for name in adapter.pipeline_classes)


def adapter_for(pipeline_class: str) -> type[ModelAdapter]:
    for adapter in ADAPTERS:
        if pipeline_class in adapter.pipeline_classes:
            return adapter
    raise ValueError(f"pipeline class {pipeline_class!r} is not supported; dvllm serves {supported_pipelines()}")
