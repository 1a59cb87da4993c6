"""LoRA layers and step caching hook the model through diffusers' own hook registry (as diffusers' caches do),
so the model's modules keep their own forward, and the hooks can be listed and removed the diffusers way."""
from __future__ import annotations

from diffusers import DiffusionPipeline
from diffusers.hooks import HookRegistry
from lora_utils import make_lora

from dvllm import DiffusionEngine, SamplingParams
from dvllm.worker.lora_layers import HOOK_NAME as LORA_HOOK
from dvllm.worker.step_cache_hooks import HOOK_NAME as CACHE_HOOK


def test_lora_and_cache_hooks_live_in_diffusers_registry(flux_path, tmp_path):
    engine = DiffusionEngine(model=flux_path, device="cpu", dtype="float32", enable_lora=True)
    engine.load_lora("l", make_lora(DiffusionPipeline.from_pretrained(flux_path), str(tmp_path / "l"), seed=0))
    params = SamplingParams(num_inference_steps=3, height=32, width=32, seed=1, loras={"l": 0.5},
                            cache={"method": "first_block", "threshold": 0.5})
    (out,) = engine.generate(["a"], [params], use_tqdm=False)
    assert out.error is None, out.error
    runner = engine.executor.worker.runner
    hooked = [m for m in runner.adapter.pipeline.transformer.modules() if hasattr(m, "_diffusers_hook")]
    names = {name for m in hooked for name in m._diffusers_hook.hooks}
    assert names == {LORA_HOOK, CACHE_HOOK}
    lora_layer = next(m for m in hooked if LORA_HOOK in m._diffusers_hook.hooks)
    assert "forward" in vars(lora_layer)  # the registry's wrapper, not a function of dvllm's own
    HookRegistry.check_if_exists_or_initialize(lora_layer).remove_hook(LORA_HOOK, recurse=False)
    assert vars(lora_layer)["forward"].__func__ is type(lora_layer).forward  # the module's own forward again
