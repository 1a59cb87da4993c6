"""LoRA adapters made in the tests: peft adapters with random (non-zero) weights on a tiny pipeline's
components, saved with the pipeline class's own `save_lora_weights`, as a user's trainer would."""
from __future__ import annotations

import copy
import os
from typing import Any

import torch

DENOISER_TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out",
                    "proj_mlp", "linear_1", "linear_2", "time_emb_proj", "ff.net.2", "proj_in", "conv2"]
TEXT_TARGETS = ["q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2"]


def make_lora(pipe: Any, folder: str, seed: int, components: tuple[str, ...] | None = None, rank: int = 4,
              alpha: float = 8.0, std: float = 0.2, metadata: bool = True) -> str:
    """Saves an adapter for `pipe` in `folder` and returns the folder. components: which of the pipeline's
    LoRA-loadable parts it changes (default: the denoiser only). With metadata=False the file keeps no
    alpha, and loaders take alpha = rank."""
    from peft import LoraConfig, inject_adapter_in_model
    from peft.utils import get_peft_model_state_dict

    denoiser = "unet" if hasattr(pipe, "unet") else "transformer"
    components = components or (denoiser,)
    generator = torch.Generator().manual_seed(seed)
    layers, configs = {}, {}
    for component in components:
        model = copy.deepcopy(getattr(pipe, component))
        targets = TEXT_TARGETS if component.startswith("text_encoder") else DENOISER_TARGETS
        names = [name for name, _ in model.named_modules()]
        present = [t for t in targets if any(n == t or n.endswith("." + t) for n in names)]
        config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=present,
                            init_lora_weights=False)
        inject_adapter_in_model(config, model, adapter_name="default")
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_" in name:
                    p.copy_(torch.randn(p.shape, generator=generator) * std)
        layers[f"{component}_lora_layers"] = get_peft_model_state_dict(model, adapter_name="default")
        configs[f"{component}_lora_adapter_metadata"] = config.to_dict()
    os.makedirs(folder, exist_ok=True)
    type(pipe).save_lora_weights(folder, **layers, **(configs if metadata else {}))
    return folder


def reference_images(pipe: Any, adapters: dict[str, str], loras: dict[str, float] | None, **call: Any) -> Any:
    """The pipeline's own output for one request: its adapters loaded with load_lora_weights (once per
    pipeline), the request's set active with set_adapters, or LoRA off for a request without any."""
    loaded = pipe.__dict__.setdefault("_test_loaded_loras", set())
    for name, path in adapters.items():
        if name not in loaded:
            pipe.load_lora_weights(path, adapter_name=name)
            loaded.add(name)
    if loras:
        pipe.enable_lora()
        pipe.set_adapters(list(loras), adapter_weights=list(loras.values()))
    elif loaded:
        pipe.disable_lora()
    return pipe(**call).images


def allow_peft_for_transformers(monkeypatch: Any) -> None:
    """transformers 5.24 asks for peft >= 0.22 before it loads an adapter into a text encoder, and the package
    index here has 0.21.2 at most: the reference pipeline's text-encoder loading lifts that version gate (the
    loading itself is transformers' and peft's own). dvllm never goes through it."""
    import transformers.integrations.peft as integration

    monkeypatch.setattr(integration, "check_peft_version", lambda **_: None)


def fail_first_load(layers: Any, monkeypatch: Any) -> list[str]:
    """The worker's first adapter load into a slot raises (as running out of device memory would); later loads
    go through. Returns the names of the adapters loaded, one entry per try."""
    real_load, calls = layers.load, []

    def failing_once(slot: int, weights: Any) -> None:
        calls.append(weights.name)
        if len(calls) == 1:
            raise RuntimeError("out of device memory (simulated)")
        real_load(slot, weights)

    monkeypatch.setattr(layers, "load", failing_once)
    return calls
