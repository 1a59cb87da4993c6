"""--attention-backend: diffusers' attention backends for the denoiser, refused at start when not installed; the
same images on a backend that computes the same attention (here, on the CPU: torch's math kernel)."""
from __future__ import annotations

import numpy as np
import pytest

from dvllm import DiffusionEngine, SamplingParams
from dvllm.models.attention_backend import installed_backends


@pytest.fixture(autouse=True)
def _restore_active_backend():
    """diffusers keeps the last backend set as its process-wide active one: put it back for the other tests."""
    from diffusers.models.attention_dispatch import _AttentionBackendRegistry

    active = _AttentionBackendRegistry._active_backend
    yield
    _AttentionBackendRegistry.set_active_backend(active)


def _images(path: str, **engine_args) -> list[np.ndarray]:
    engine = DiffusionEngine(model=path, device="cpu", dtype="float32", **engine_args)
    params = [SamplingParams(num_inference_steps=3, seed=s, guidance_scale=g, height=32, width=32, output_type="np")
              for s, g in ((1, 3.5), (2, 1.0))]
    outs = engine.generate(["a red circle", "a blue square"], params, use_tqdm=False)
    assert [o.error for o in outs] == [None, None]
    return [o.images[0] for o in outs], engine


def test_a_transformer_runs_on_the_backend_asked_for(flux_path):
    path = flux_path
    default, _ = _images(path)
    math, engine = _images(path, attention_backend="_native_math")
    processors = engine.executor.worker.runner.adapter.pipeline.transformer.attn_processors.values()
    assert {str(getattr(p, "_attention_backend", None)) for p in processors} == {"AttentionBackendName._NATIVE_MATH"}
    for a, b in zip(default, math):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)  # the same attention, another kernel


@pytest.mark.slow
def test_qwen_edit_runs_its_padded_rows_on_the_backend(qwen_image_edit_plus_path, monkeypatch):
    """dvllm's processor for edit rows of other image sizes dispatches as diffusers' own does."""
    from diffusers.models import attention_dispatch
    from PIL import Image
    from test_host_syncs import _requests

    from dvllm.models import qwen_rows

    calls = []
    real = attention_dispatch.dispatch_attention_fn
    monkeypatch.setattr(qwen_rows, "dispatch_attention_fn", lambda *a, **k: calls.append(1) or real(*a, **k))
    engine = DiffusionEngine(model=qwen_image_edit_plus_path, device="cpu", dtype="float32",
                             attention_backend="_native_math")
    requests = _requests(True, False, False, None, steps=2)
    params = [requests[0][1], type(requests[1][1])(**{**requests[1][1].__dict__,
                                                      "image": Image.new("RGB", (48, 32), (9, 90, 200))})]
    outs = engine.generate([requests[0][0], requests[1][0]], params, use_tqdm=False)
    assert [o.error for o in outs] == [None, None]
    assert calls  # the padded rows' attention went through diffusers' dispatch


def test_a_backend_not_installed_is_refused_at_start_naming_the_installed(sd_eps_path, flux_path):
    installed = installed_backends()
    assert "native" in installed and "flash" not in installed  # (flash-attn is no CPU package)
    with pytest.raises(ValueError, match=r"attention_backend 'flash' is not installed here; installed: .*native"):
        DiffusionEngine(model=flux_path, device="cpu", dtype="float32", attention_backend="flash")
    with pytest.raises(ValueError, match=r"'xformers' is not installed here \(pip install 'dvllm\[xformers\]'\)"):
        DiffusionEngine(model=sd_eps_path, device="cpu", dtype="float32", attention_backend="xformers")
    with pytest.raises(ValueError, match="a UNet's attention does not go through diffusers' backends"):
        DiffusionEngine(model=sd_eps_path, device="cpu", dtype="float32", attention_backend="_native_math")
    with pytest.raises(ValueError, match="did you mean 'flash'"):
        DiffusionEngine(model=flux_path, device="cpu", dtype="float32", attention_backend="flsh")
