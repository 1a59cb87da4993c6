"""How a model's files are found and read: the loading knobs of EngineConfig, in one object the loader takes
(models/loader.py owns what they mean)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dvllm.config import EngineConfig


@dataclass(frozen=True)
class LoadConfig:
    revision: str | None = None      # a Hub branch, tag or commit
    variant: str | None = None       # weight files of a variant ("fp16": *.fp16.safetensors), and no others
    download_dir: str | None = None  # the Hub cache to read and fill (None: huggingface_hub's default)
    local_files_only: bool = False   # never reach the Hub: what the cache (or folder) holds, or an error
    attention_backend: str | None = None  # diffusers' attention backend for the denoiser (None: its own)
    vae_tiling: bool = False              # the VAE decodes and encodes in tiles (diffusers' enable_tiling)
    vae_tile_size: int | None = None      # a tile's side in pixels (None: the VAE's own)
    base_model: str | None = None  # a single-file model's pipeline: the folder or Hub id of its configs and the rest
    vae: str | None = None         # a VAE over the model's own (a file, folder or Hub id)
    encoder_device: str | None = None  # where the text encoders run (None: with the denoiser)
    vae_dtype: str = "auto"            # the VAE's dtype ("auto": the model's, or float32 where its config asks)
    quantization: Any = None  # a QuantizationSpec (models/quantization.py): what is quantized, and how

    @classmethod
    def of(cls, config: EngineConfig) -> LoadConfig:
        """The engine's loading settings, its quantization spec parsed (and so checked: ValueError naming it)."""
        from dvllm.models.quantization import parse_quantization  # (torch: only where a spec is given)

        quantization = None if config.quantization is None else parse_quantization(config.quantization)
        return cls(revision=config.revision, variant=config.variant, download_dir=config.download_dir,
                   local_files_only=config.local_files_only, attention_backend=config.attention_backend,
                   vae_tiling=config.vae_tiling, vae_tile_size=config.vae_tile_size, base_model=config.base_model,
                   vae=config.vae, encoder_device=config.encoder_device, vae_dtype=config.vae_dtype,
                   quantization=quantization)

    def hub_kwargs(self) -> dict[str, Any]:
        """What huggingface_hub's snapshot_download and diffusers' from_pretrained both take."""
        return {"revision": self.revision, "cache_dir": self.download_dir, "local_files_only": self.local_files_only}


@dataclass(frozen=True)
class LoadedModel:
    """What a worker loaded, and where it holds it (its family's capabilities are the adapter's ModelInfo)."""

    name: str    # as the engine was given it (a folder, file, Hub id or preset)
    device: str  # e.g. "cuda:0", "cpu"
    dtype: str   # the denoiser's, "auto" resolved: e.g. "bfloat16"
    vae_dtype: str  # the VAE's (float32 where its config asks, or --vae-dtype)
    encoder_device: str  # where the text encoders run
    quantization: str | None = None  # the backend quantizing it (None: full weights)
    # dvllm's kernels in the worker's process (_extension.CustomOps.as_dict): not what identifies the model's pixels
    custom_ops: dict[str, Any] | None = field(default=None, compare=False, repr=False)
