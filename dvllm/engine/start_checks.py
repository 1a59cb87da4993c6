"""What the engine's settings ask of the model, its files and its adapters, refused before anything loads: each
package's fields (resolved into its config: engine/configs.py), the adapters that --lora-modules names, the
quantization spec and what the other settings ask of it, and the model's files (no model code runs: torch and
diffusers only where a quantization spec is given). Every way of starting an engine (DiffusionEngine,
AsyncDiffusionEngine, dvllm serve) calls it once, right after the engine config is made."""
from __future__ import annotations

from dvllm.config import EngineConfig
from dvllm.engine.configs import EngineConfigs
from dvllm.lora.files import check_lora_modules
from dvllm.models.load_config import LoadConfig
from dvllm.models.model_files import check_model_files


def check_at_start(config: EngineConfig) -> EngineConfigs:
    """The packages' configs; ValueError naming the setting (or file) that cannot work."""
    configs = EngineConfigs.of(config)  # each package's fields, checked by their owner
    check_lora_modules(config)  # a typo'd adapter fails now, not after the model loads
    if config.quantization is not None or str(config.model).lower().endswith(".gguf"):
        from dvllm.models.quantization import check_use

        check_use(LoadConfig.of(config).quantization, config.model, config.load_format, config.enable_lora)
    check_model_files(config)  # model, vae and base_model paths, a GGUF's header, the defaults' size
    return configs
