"""No step waits on the device: one engine step of every family, with and without LoRA and with each step
cache method, reads nothing back from the device and copies nothing to it with a blocking copy
(host_syncs.py says how that is seen on the CPU). first_block and teacache caching alone need their decision
on the host: one read per step, for all their requests together. And every family's batched denoiser call traces whole
under torch.compile(fullgraph=True): a graph break is where a CUDA graph capture would fail.
"""
from __future__ import annotations

import dataclasses
import warnings

import numpy as np
import pytest
import torch
from diffusers import DiffusionPipeline
from host_syncs import HostSyncs
from lora_utils import make_lora
from PIL import Image

from dvllm import DiffusionEngine, SamplingParams

# family -> (fixture, edit model, UNet: has ancestral samplers on its own noise)
FAMILIES = {
    "sd": ("sd_eps_path", False, True),
    "sd-lcm": ("sd_guidance_embed_path", False, True),
    "sdxl": ("sdxl_path", False, True),
    "sd3": ("sd3_path", False, False),
    "flux": ("flux_path", False, False),
    "flux-kontext": ("kontext_path", True, False),
    "qwen-image": ("qwen_image_path", False, False),
    "qwen-image-edit": ("qwen_image_edit_plus_path", True, False),
    "z-image": ("z_image_path", False, False),
}
# Video families (their requests name a frame count), apart from FAMILIES, which test_graph_replay.py replays
VIDEO = {"wan": ("wan_path", False, False), "wan-i2v": ("wan_i2v_path", True, False),
         "wan-ti2v": ("wan_ti2v_path", True, False)}
SYNC_FAMILIES = {**FAMILIES, **VIDEO}
CACHING = ("sd3", "flux", "qwen-image", "z-image", "wan")
MAG = {"method": "mag", "mag_ratios": [1.0] * 4, "num_inference_steps": 4, "threshold": 0.5}
CACHES = {"first_block": {"method": "first_block", "threshold": 0.5}, "taylorseer": {"method": "taylorseer"},
          "mag": MAG}
# Inside diffusers, not dvllm's to remove: QwenImageTransformer2DModel makes a 0-d tensor from a Python int on
# the device whenever a text mask is passed (texts of different lengths in one forward).
DIFFUSERS_SITES = {("as_tensor(..., device=...) (a blocking copy)", "transformer_qwenimage.py")}

CASES = [(f, False, None) for f in SYNC_FAMILIES] + [(f, True, None) for f in SYNC_FAMILIES]
CASES += [(f, True, method) for f in CACHING for method in CACHES]
FLUX_CACHES = {"teacache": {"method": "teacache", "rel_l1_thresh": 0.6}}  # methods served for Flux only
CASES += [("flux", True, method) for method in FLUX_CACHES]
# The methods that decide from the data read their decisions back: one read per step, all their requests together
READS_BACK = {"first_block": "dvllm/step_caches/first_block.py:", "teacache": "dvllm/step_caches/teacache.py:"}


@pytest.fixture(scope="module")
def kontext_path(tmp_path_factory) -> str:
    from test_flux_kontext import tiny_flux_kontext_pipeline

    path = tmp_path_factory.mktemp("tiny-flux-kontext")
    tiny_flux_kontext_pipeline().save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def wan_i2v_path(tmp_path_factory) -> str:
    from conftest import _saved, tiny_wan_i2v_pipeline

    return _saved(tmp_path_factory, "tiny-wan-i2v", tiny_wan_i2v_pipeline())


@pytest.fixture(scope="module")
def wan_ti2v_path(tmp_path_factory) -> str:
    from conftest import _saved, tiny_wan_ti2v_pipeline

    return _saved(tmp_path_factory, "tiny-wan-ti2v", tiny_wan_ti2v_pipeline())


@pytest.fixture(scope="module")
def lora_folders(tmp_path_factory) -> dict[str, str]:
    return {}


def _lora(path: str, folders: dict[str, str], tmp_path_factory) -> str:
    if path not in folders:
        pipe = DiffusionPipeline.from_pretrained(path)
        folders[path] = make_lora(pipe, str(tmp_path_factory.mktemp("lora")), seed=0)
    return folders[path]


def _requests(edit: bool, unet: bool, lora: bool, cache: dict | None, steps: int = 4, video: bool = False,
              sampler: str | None = None) -> list[tuple[str, SamplingParams]]:
    """Three requests of one size: with and without CFG, two images (videos) for one, other seeds and texts.
    `sampler`: all three's (default: the model's own, and euler_a for a UNet's first)."""
    rng = np.random.default_rng(0)
    image = Image.fromarray(rng.integers(0, 255, (32, 32, 3), dtype=np.uint8)) if edit else None
    common = dict(num_inference_steps=steps, height=32, width=32, image=image, cache=cache,
                  num_frames=5 if video else None)
    first = sampler or ("euler_a" if unet else None)
    return [
        ("a red cat on a mat", SamplingParams(guidance_scale=5.0, seed=1, negative_prompt="blurry", n=2,
                                              sampler=first, loras={"l": 0.8} if lora else None, **common)),
        ("x", SamplingParams(guidance_scale=1.0, seed=2, sampler=sampler, **common)),
        ("dog", SamplingParams(guidance_scale=3.0, seed=3, negative_prompt="bad, ugly, low quality", sampler=sampler,
                               **common)),
    ]


# The step tests run Wan's rows with its own sampler, UniPC, which the fused update steps (stepped per request by
# diffusers' UniPCMultistepScheduler it copied its host-kept sigmas to the device and solved with torch.linalg, both
# waits on a GPU); test_a_per_request_sampler_syncs_only_inside_diffusers covers a sampler diffusers still steps.
VIDEO_SAMPLER = None
# not vectorized: each request steps its own diffusers scheduler, which waits on the device in its step
FALLBACK_SAMPLER, FALLBACK_SITE = "SASolverScheduler", "diffusers/schedulers/scheduling_sasolver.py:"


def _fallback_tensors(engine: DiffusionEngine) -> list[torch.Tensor]:
    """The sigmas of the requests' per-request (diffusers) schedulers: made at admission, kept on the host."""
    states = engine.executor.worker.runner.states.values()
    return [s.fallback.sigmas for s in states if s.fallback is not None and torch.is_tensor(s.fallback.sigmas)]


def _own_sites(syncs: HostSyncs) -> dict:
    return {(what, where): n for (what, where), n in syncs.sites.items()
            if not any(what == w and site in where for w, site in DIFFUSERS_SITES)}


# Each engine sizes its pool from what the whole device has left (as vLLM does): a test's second engine takes
# a share beside its first one's, and each CUDA test releases its engines (release_gpu) so the next one starts
# from an empty GPU.
GPU_SHARE = {"gpu_memory_utilization": 0.25}
SECOND_GPU_SHARE = {"gpu_memory_utilization": 0.5}


@pytest.fixture
def release_gpu():
    """After a CUDA test, its engines' memory back to the device, also when it failed: pytest keeps the last
    failure's traceback (sys.last_traceback), whose frames would hold that test's engines and their pools."""
    yield
    import gc
    import sys

    for name in ("last_type", "last_value", "last_traceback", "last_exc"):
        if hasattr(sys, name):
            delattr(sys, name)
    gc.collect()
    torch.cuda.empty_cache()


IDS = [f"{f}{'-lora' if lora else ''}{'-' + m if m else ''}" for f, lora, m in CASES]


def _engine_at_a_middle_step(family: str, lora: bool, method: str | None, device: str, request, lora_folders,
                             tmp_path_factory, sampler: str | None = None) -> DiffusionEngine:
    """An engine with three requests admitted and two steps run (a cache is primed by then). Video families'
    requests take VIDEO_SAMPLER unless `sampler` is given."""
    fixture, edit, unet = SYNC_FAMILIES[family]
    path = request.getfixturevalue(fixture)
    engine = DiffusionEngine(model=path, device=device, dtype="float32", enable_lora=lora,
                             **(GPU_SHARE if device == "cuda" else {}))
    if lora:
        engine.load_lora("l", _lora(path, lora_folders, tmp_path_factory))
    video = family in VIDEO
    requests = _requests(edit, unet, lora, {**CACHES, **FLUX_CACHES}.get(method), video=video,
                         sampler=sampler or (VIDEO_SAMPLER if video else None))
    for i, (prompt, params) in enumerate(requests):
        engine.add_request(str(i), prompt, params)
    engine.step()  # admission (encoding reads the texts' lengths once) and the first step
    engine.step()
    return engine


@pytest.mark.parametrize("family, lora, method", CASES, ids=IDS)
@pytest.mark.slow
def test_a_step_reads_nothing_back_from_the_device(family, lora, method, request, lora_folders, tmp_path_factory):
    engine = _engine_at_a_middle_step(family, lora, method, "cpu", request, lora_folders, tmp_path_factory)
    with HostSyncs(host=_fallback_tensors(engine)) as syncs:
        outputs = engine.step()
    assert not [o.error for o in outputs if o.error], outputs
    assert engine.has_unfinished_requests()  # a middle step: no request finished (a decode reads back)
    own = _own_sites(syncs)
    allowed = 1 if method in READS_BACK else 0
    report = "\n".join(f"  {n} x {what} at {where}" for (what, where), n in own.items())
    assert sum(own.values()) <= allowed, f"{family}: host syncs in one step:\n{report}"
    # that one read is the method's decision, nothing else
    assert all(where.startswith(READS_BACK[method]) for _, where in own), report


def test_a_per_request_sampler_syncs_only_inside_diffusers(request, lora_folders, tmp_path_factory):
    """A sampler diffusers steps per request (SA-Solver on Wan): its waits are the scheduler's, none of dvllm's."""
    engine = _engine_at_a_middle_step("wan", False, None, "cpu", request, lora_folders, tmp_path_factory,
                                      sampler=FALLBACK_SAMPLER)
    host = _fallback_tensors(engine)
    assert len(host) == 3  # every request steps through its own diffusers scheduler
    with HostSyncs(host=host) as syncs:
        outputs = engine.step()
    assert not [o.error for o in outputs if o.error], outputs
    assert syncs.count > 0, "the detector must see the scheduler's copies of its sigmas"
    assert all(where.startswith(FALLBACK_SITE) for _, where in syncs.sites), \
        syncs.report()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA's own sync check needs a GPU")
@pytest.mark.parametrize("family, lora, method", CASES, ids=IDS)
def test_a_cuda_step_syncs_within_the_allowance(family, lora, method, request, lora_folders, tmp_path_factory,
                                                release_gpu):
    """The same on a GPU, counted by CUDA itself (torch.cuda.set_sync_debug_mode warns at each sync)."""
    engine = _engine_at_a_middle_step(family, lora, method, "cuda", request, lora_folders, tmp_path_factory)
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            outputs = engine.step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert not [o.error for o in outputs if o.error], outputs
    # torch's own notice that the mode is a prototype is no sync (the GPU run of 2026-12-04 counted it as one)
    syncs = [str(w.message) for w in caught if "synchroniz" in str(w.message)
             and "prototype feature" not in str(w.message)]
    # a decision read back (READS_BACK); diffusers' own copy in Qwen-Image's transformer (DIFFUSERS_SITES)
    allowed = (method in READS_BACK) + family.startswith("qwen-image")
    assert len(syncs) <= allowed, syncs


@pytest.mark.parametrize("family", list(SYNC_FAMILIES))
@pytest.mark.slow
def test_every_family_batched_forward_traces_whole(family, request, monkeypatch):
    fixture, edit, unet = SYNC_FAMILIES[family]
    engine = DiffusionEngine(model=request.getfixturevalue(fixture), device="cpu", dtype="float32")
    runner = engine.executor.worker.runner
    torch._dynamo.reset()
    # backend "eager": only dynamo's tracing, which is where a graph break shows (fullgraph makes it an error)
    runner.denoiser.compiled = torch.compile(runner.adapter.denoise, fullgraph=True, backend="eager")
    torch._dynamo.utils.counters.clear()
    requests = _requests(edit, unet, False, None, steps=2, video=family in VIDEO)
    outs = engine.generate([prompt for prompt, _ in requests], [p for _, p in requests], use_tqdm=False)
    assert [o.error for o in outs] == [None] * len(outs)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1  # it traced: the forward ran compiled


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("lora", [False, True], ids=["plain", "lora"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_family_replays_a_cuda_graph_with_the_eager_images(family, lora, request, lora_folders,
                                                                 tmp_path_factory, release_gpu):
    """On a GPU, with CUDA's own graphs (test_graph_replay.py proves the same on the CPU with a stand-in)."""
    fixture, edit, unet = FAMILIES[family]
    path = request.getfixturevalue(fixture)
    requests = _requests(edit, unet, lora, None, steps=3)
    prompts, params = [prompt for prompt, _ in requests], [dataclasses.replace(p, output_type="np") for _, p in requests]
    engines = [DiffusionEngine(model=path, device="cuda", dtype="float32", cuda_graph=graphs, enable_lora=lora,
                               **share) for graphs, share in ((False, GPU_SHARE), (True, SECOND_GPU_SHARE))]
    if lora:
        for e in engines:
            e.load_lora("l", _lora(path, lora_folders, tmp_path_factory))
    eager = engines[0].generate(prompts, params, use_tqdm=False)
    engine = engines[1]
    graphs = engine.generate(prompts, params, use_tqdm=False)
    captured = engine.executor.worker.runner.denoiser.graphs
    assert captured and all(g is not None for g in captured.values()), f"{family}: fell back to eager"
    for want, got in zip(eager, graphs):
        assert got.error is None, got.error
        for a, b in zip(got.images, want.images):
            np.testing.assert_allclose(a, b, atol=1e-3, rtol=0)  # as test_compiled_denoiser's SD check
