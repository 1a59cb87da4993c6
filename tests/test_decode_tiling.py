"""max_decode_mb: a request whose untiled decode is estimated above it decodes in tiles, that request only, and its
video equals WanPipeline's with the VAE's tiling on (same seed); a smaller request beside it stays untiled and
equals the untiled pipeline. At 32 px tiles the tiny VAE's tiled decode is not its untiled one (0.26 apart on
[-1, 1]): the test says which of the two the fallback gives. The threshold is set from the budget's own measure,
between the two requests' estimates, so the choice does not depend on the machine."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from diffusers import WanPipeline

from dvllm import DiffusionEngine, SamplingParams
from dvllm.config import EngineConfig
from dvllm.decode_budget import DecodeBudget
from dvllm.worker.memory_profile import gpu_pool_bytes, worst_size

TOL = 1e-3  # tests/test_wan.py's frames tolerance
TILE = 32   # vae_tile_size: smaller than the large video, larger than the small one
LARGE = {"height": 48, "width": 64, "num_frames": 5}
SMALL = {"height": 16, "width": 16, "num_frames": 5}
COMMON = {"num_inference_steps": 3, "guidance_scale": 4.0, "output_type": "np"}
PROMPTS = ("a red kite over the sea", "a small boat")


def P(**kw) -> SamplingParams:
    return SamplingParams(**{**COMMON, **kw})


def requests() -> list[SamplingParams]:
    return [P(seed=1, **LARGE), P(seed=2, **SMALL)]


@pytest.fixture(scope="module")
def threshold_mb(wan_path) -> float:
    """Between the two requests' estimated decodes (the per-pixel measure is the engine's own)."""
    budget = DiffusionEngine(model=wan_path, device="cpu", dtype="float32", max_decode_mb=1.0,
                             decode_stage=False).processor.decode_budget
    assert budget.can_tile and budget.bytes_per_pixel > 0
    large, small = (budget.estimate(tuple(s.values()), 1) for s in (LARGE, SMALL))
    assert small < large
    return (small + large) / 2 / 2**20


@pytest.fixture(scope="module")
def references(wan_path) -> dict[str, np.ndarray]:
    """WanPipeline's videos: the large one untiled and tiled (TILE px tiles, a quarter's overlap), the small one."""
    pipe = WanPipeline.from_pretrained(wan_path)
    pipe.set_progress_bar_config(disable=True)

    def video(prompt: str, p: SamplingParams) -> np.ndarray:
        return pipe(prompt, num_inference_steps=p.num_inference_steps, height=p.height, width=p.width,
                    num_frames=p.num_frames, guidance_scale=p.guidance_scale, output_type="np",
                    generator=torch.Generator("cpu").manual_seed(p.seed)).frames[0]

    large, small = requests()
    out = {"large": video(PROMPTS[0], large), "small": video(PROMPTS[1], small)}
    pipe.vae.enable_tiling(tile_sample_min_height=TILE, tile_sample_min_width=TILE,
                           tile_sample_stride_height=TILE * 3 // 4, tile_sample_stride_width=TILE * 3 // 4)
    out["large tiled"] = video(PROMPTS[0], large)
    return out


def diff(a, b) -> float:
    return float(np.abs(np.asarray(a) - np.asarray(b)).max())


@pytest.mark.parametrize("where", [{"decode_stage": False}, {"decode_stage": True}, {"decode_workers": 1}],
                         ids=["loop", "decode stage", "decode worker"])
def test_a_decode_over_max_decode_mb_runs_tiled_as_the_pipelines_tiled_vae(wan_path, threshold_mb, references,
                                                                             where):
    engine = DiffusionEngine(model=wan_path, device="cpu", dtype="float32", max_decode_mb=threshold_mb,
                             vae_tile_size=TILE, **where)
    try:
        large, small = engine.generate(list(PROMPTS), requests(), use_tqdm=False)
    finally:
        engine.shutdown()
    assert large.error is None and small.error is None
    assert (large.decode_tiled, small.decode_tiled) == (True, False)
    assert diff(large.images[0], references["large tiled"]) <= TOL
    assert diff(large.images[0], references["large"]) > 20 * TOL  # not the untiled decode: tiling moved it
    assert diff(small.images[0], references["small"]) <= TOL
    assert not engine.executor.worker.runner.adapter.pipeline.vae.use_tiling  # tiled for that request only


@pytest.mark.parametrize("decode_stage", [False, True], ids=["loop", "decode stage"])
def test_an_untiled_decode_out_of_memory_runs_again_in_tiles(wan_path, references, monkeypatch, decode_stage):
    """No estimate tiles here (the bound is far above both); the VAE runs out of memory on the large video's
    untiled call (as a GPU would), and that call runs again tiled instead of failing the request."""
    engine = DiffusionEngine(model=wan_path, device="cpu", dtype="float32", max_decode_mb=1e6, vae_tile_size=TILE,
                             decode_stage=decode_stage)
    vae, refused = engine.executor.worker.runner.adapter.pipeline.vae, []
    real = vae.decode

    def decode(z, *args, **kwargs):
        if not vae.use_tiling and z.shape[-1] * vae.spatial_compression_ratio > TILE:
            refused.append(tuple(z.shape))
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return real(z, *args, **kwargs)
    monkeypatch.setattr(vae, "decode", decode)
    try:
        large, small = engine.generate(list(PROMPTS), requests(), use_tqdm=False)
    finally:
        engine.shutdown()
    assert large.error is None and small.error is None and len(refused) == 1
    assert (large.decode_tiled, small.decode_tiled) == (False, False)  # (admission did not choose it)
    assert diff(large.images[0], references["large tiled"]) <= TOL
    assert diff(small.images[0], references["small"]) <= TOL
    assert not vae.use_tiling


def test_without_max_decode_mb_nothing_tiles_and_nothing_is_measured(wan_path):
    engine = DiffusionEngine(model=wan_path, device="cpu", dtype="float32", decode_stage=False)
    budget = engine.processor.decode_budget
    assert budget.limit_bytes is None and budget.bytes_per_pixel == 0.0
    assert not budget.tiles((1024, 1024, 129), 4)


@pytest.mark.parametrize("kwargs, message", [
    ({"max_decode_mb": 0}, "max_decode_mb must be a finite number > 0"),
    ({"max_decode_mb": float("inf")}, "max_decode_mb must be a finite number > 0"),
    ({"max_decode_mb": 64, "vae_tiling": True}, "vae_tiling tiles every decode already"),
    ({"vae_tile_size": 32}, "neither vae_tiling nor max_decode_mb"),
])
def test_bad_decode_bounds_are_refused_before_the_model_loads(kwargs, message):
    with pytest.raises(ValueError, match=message):
        DiffusionEngine(model="/nonexistent/model", device="cpu", **kwargs)


def test_the_budget_tiles_past_its_limit_and_two_workers_keep_the_tightest():
    budget = DecodeBudget(limit_bytes=1000, bytes_per_pixel=2.0, can_tile=True)
    assert budget.estimate((10, 10, 5), 1) == 1000 and not budget.tiles((10, 10, 5), 1)
    assert budget.tiles((10, 10, 5), 2) and budget.tiles((23, 22), 1)
    assert not DecodeBudget(1000, 2.0, can_tile=False).tiles((100, 100), 1)  # a VAE that cannot tile never does
    other = DecodeBudget(limit_bytes=None, bytes_per_pixel=3.0, can_tile=True)
    assert budget.tightest(other) == DecodeBudget(1000, 3.0, True)
    assert DecodeBudget().tightest(DecodeBudget()) == DecodeBudget()


def test_the_gpu_profile_measures_the_worst_decode_as_it_will_run(sd_eps_path, monkeypatch):
    adapter = DiffusionEngine(model=sd_eps_path, device="cpu", dtype="float32").executor.worker.runner.adapter
    vae, tiled_seen = adapter.pipeline.vae, []
    real = adapter.decode

    def decode(latents, size):
        tiled_seen.append(vae.use_tiling)
        return real(latents, size)
    monkeypatch.setattr(adapter, "decode", decode)

    class Memory:
        def measure(self, run) -> int:
            run()
            return 2**30

        def free_and_total(self) -> tuple[int, int]:
            return 70 * 2**30, 80 * 2**30

    config = EngineConfig(max_image_pixels=48 * 48, max_decode_batch=2, decode_stage=False)
    pixels = 2 * np.prod(worst_size(adapter.info, config))
    for limit, tiles in ((int(pixels) - 1, True), (int(pixels), False)):  # 1 byte a pixel: the worst is `pixels`
        tiled_seen.clear()
        gpu_pool_bytes(adapter, config, Memory(), DecodeBudget(limit, 1.0, can_tile=True))
        assert tiled_seen == [tiles] and not vae.use_tiling
