"""The core promise: batching never changes an image.

Every request's image equals what the diffusers pipeline gives for the same seed,
prompt and parameters (max abs diff <= 1e-3 on [0, 1] images, CPU float32), whatever
else shares the batch. The engine loads the tiny pipelines through its real loader.
"""
from __future__ import annotations

import diffusers
import numpy as np
import pytest
import torch
from diffusers import (DDIMScheduler, DPMSolverMultistepScheduler, EulerAncestralDiscreteScheduler,
                       EulerDiscreteScheduler, LCMScheduler, PNDMScheduler, StableDiffusionPipeline,
                       StableDiffusionXLPipeline)

from dvllm import DiffusionEngine, SamplingParams

TOL = 1e-3
# The documented meaning of each short name, written out independently of dvllm's registry.
SCHEDULERS = {
    "ddim": (DDIMScheduler, {}),
    "euler": (EulerDiscreteScheduler, {}),
    "euler_a": (EulerAncestralDiscreteScheduler, {}),
    "dpmpp_2m": (DPMSolverMultistepScheduler, {"algorithm_type": "dpmsolver++", "solver_order": 2}),
    "dpmpp_2m_karras": (DPMSolverMultistepScheduler,
                        {"algorithm_type": "dpmsolver++", "solver_order": 2, "use_karras_sigmas": True}),
    "lcm": (LCMScheduler, {}),
    "PNDMScheduler": (PNDMScheduler, {}),  # no vectorized update: the per-request fallback
}


def reference(pipe, prompt: str, p: SamplingParams) -> np.ndarray:
    base = pipe.scheduler
    if p.sampler is None:
        cls, overrides = type(base), {}
    else:
        cls, overrides = SCHEDULERS.get(p.sampler) or (getattr(diffusers, p.sampler), {})
    pipe.scheduler = cls.from_config(base.config, **overrides)
    # dvllm's guidance_scale is Qwen-Image's true_cfg_scale
    guidance = ({"true_cfg_scale": p.guidance_scale} if type(pipe).__name__ == "QwenImagePipeline"
                else {"guidance_scale": p.guidance_scale})
    if p.eta is not None:  # left out, the pipeline's own default
        guidance["eta"] = p.eta
    if p.max_sequence_length is not None:
        guidance["max_sequence_length"] = p.max_sequence_length
    try:
        return pipe(prompt, negative_prompt=p.negative_prompt, num_inference_steps=p.num_inference_steps,
                    height=p.height, width=p.width, num_images_per_prompt=p.n,
                    generator=torch.Generator("cpu").manual_seed(p.seed), output_type="np", **guidance).images
    finally:
        pipe.scheduler = base


def assert_matches_pipeline(pipe, prompt, params, out):
    assert out.error is None, out.error
    expected = reference(pipe, prompt, params)
    assert len(out.images) == params.n == len(expected)
    for got, want in zip(out.images, expected):
        assert got.shape == want.shape
        diff = float(np.abs(got - want).max())
        assert diff <= TOL, f"{prompt!r} {params}: max abs diff {diff}"


def assert_alone_and_batched_match_pipeline(engine, pipe, prompt: str, params: SamplingParams,
                                            others: list[tuple[str, SamplingParams]]) -> None:
    """The request alone equals the pipeline's image, and the same request inside a batch of others
    equals it alone."""
    alone = engine.generate(prompt, params, use_tqdm=False)[0]
    assert_matches_pipeline(pipe, prompt, params, alone)
    outs = engine.generate([prompt] + [q for q, _ in others], [params] + [dataclass_np(p) for _, p in others],
                           use_tqdm=False)
    np.testing.assert_allclose(outs[0].images[0], alone.images[0], atol=TOL, rtol=0)


def mixed_batch() -> list[tuple[str, SamplingParams]]:
    """Eight requests that differ in everything that may differ inside one batch."""
    P = SamplingParams
    return [
        ("a red circle", P(num_inference_steps=6, guidance_scale=5.0, seed=1, sampler="ddim", height=16, width=16)),
        ("a blue square", P(num_inference_steps=9, guidance_scale=3.0, seed=2, sampler="euler", height=16, width=16,
                            negative_prompt="blurry")),
        ("a green star", P(num_inference_steps=7, guidance_scale=7.5, seed=3, sampler="euler_a", n=2,
                           height=16, width=16)),
        ("two triangles", P(num_inference_steps=8, guidance_scale=1.0, seed=4, sampler="dpmpp_2m",
                            height=16, width=16)),
        ("a yellow moon", P(num_inference_steps=5, guidance_scale=4.0, seed=5, sampler="dpmpp_2m_karras",
                            height=24, width=32)),
        ("an orange sky", P(num_inference_steps=4, guidance_scale=2.0, seed=6, sampler="lcm", height=16, width=16)),
        ("a purple cube", P(num_inference_steps=6, guidance_scale=6.0, seed=7, sampler="PNDMScheduler",
                            height=24, width=32)),
        ("a red circle", P(num_inference_steps=10, guidance_scale=0.0, seed=8, height=16, width=16)),
    ]


def engine_for(path: str, **kwargs) -> DiffusionEngine:
    return DiffusionEngine(model=path, device="cpu", dtype="float32", **kwargs)


@pytest.fixture(scope="module")
def eps(sd_eps_path):
    pipe = StableDiffusionPipeline.from_pretrained(sd_eps_path)
    pipe.set_progress_bar_config(disable=True)
    return engine_for(sd_eps_path), pipe


@pytest.fixture(scope="module")
def vpred(sd_v_path):
    pipe = StableDiffusionPipeline.from_pretrained(sd_v_path)
    pipe.set_progress_bar_config(disable=True)
    return engine_for(sd_v_path), pipe


@pytest.fixture(scope="module")
def sdxl(sdxl_path):
    pipe = StableDiffusionXLPipeline.from_pretrained(sdxl_path)
    pipe.set_progress_bar_config(disable=True)
    return engine_for(sdxl_path), pipe


@pytest.mark.parametrize("family", ["eps", "vpred", "sdxl"])
@pytest.mark.slow
def test_mixed_batch_matches_pipeline_per_request(family, request):
    engine, pipe = request.getfixturevalue(family)
    batch = mixed_batch()
    params = [dataclass_np(p) for _, p in batch]
    outs = engine.generate([prompt for prompt, _ in batch], params, use_tqdm=False)
    assert [o.request_id for o in outs] == sorted((o.request_id for o in outs), key=lambda s: int(s.split("-")[1]))
    for (prompt, _), p, out in zip(batch, params, outs):
        assert out.prompt == prompt and out.seed == p.seed
        assert out.num_steps_done == out.num_inference_steps
        assert_matches_pipeline(pipe, prompt, p, out)


@pytest.mark.parametrize("sampler", list(SCHEDULERS))
def test_request_alone_equals_pipeline_and_batch(eps, sampler):
    engine, pipe = eps
    prompt, params = "a lone request", SamplingParams(num_inference_steps=6, guidance_scale=4.5, seed=11,
                                                      sampler=sampler, height=16, width=16, output_type="np")
    assert_alone_and_batched_match_pipeline(engine, pipe, prompt, params, mixed_batch()[:7])


@pytest.mark.parametrize("sampler, eta", [("TCDScheduler", None), ("TCDScheduler", 0.3), ("ddim", 0.7),
                                         ("DDIMParallelScheduler", 0.5)])
@pytest.mark.slow
def test_eta_reaches_the_scheduler_as_the_pipeline_passes_it(eps, sampler, eta):
    """The pipeline passes eta (its default 0.0) to every scheduler whose step() takes it: TCD's own
    default is 0.3, and DDIM with eta > 0 draws noise, so each is stepped as diffusers would."""
    engine, pipe = eps
    prompt = "a red circle"
    params = SamplingParams(num_inference_steps=3, guidance_scale=1.0, seed=0, sampler=sampler, eta=eta,
                            height=32, width=32, output_type="np")
    assert_alone_and_batched_match_pipeline(engine, pipe, prompt, params, mixed_batch()[:3])


def test_eta_is_refused_where_the_pipeline_takes_none(flux_path):
    engine = engine_for(flux_path)
    with pytest.raises(ValueError, match="eta: the flux pipeline takes no eta"):
        engine.add_request("r", "x", SamplingParams(eta=0.5))


def test_seed_changes_the_image(eps):
    """The comparisons above can fail: another seed gives a clearly different image."""
    engine, pipe = eps
    params = SamplingParams(num_inference_steps=5, guidance_scale=7.5, seed=21, height=16, width=16, output_type="np")
    out = engine.generate("a red circle", params, use_tqdm=False)[0]
    other = reference(pipe, "a red circle", SamplingParams(**{**params.__dict__, "seed": 22}))
    assert np.abs(out.images[0] - other[0]).max() > 0.05


def test_n_images_match_num_images_per_prompt(eps):
    engine, pipe = eps
    params = SamplingParams(num_inference_steps=5, guidance_scale=3.0, seed=5, n=3, sampler="euler_a",
                            height=16, width=16, output_type="np")
    out = engine.generate("three of them", params, use_tqdm=False)[0]
    assert_matches_pipeline(pipe, "three of them", params, out)
    assert np.abs(out.images[0] - out.images[1]).max() > 0.05


def test_output_types_agree(eps):
    engine, _ = eps
    base = dict(num_inference_steps=4, seed=9, height=16, width=16)
    outs = engine.generate(["same"] * 4, [SamplingParams(**base, output_type=t) for t in ("np", "pil", "pt", "latent")],
                           use_tqdm=False)
    arr, pil, pt, latent = (o.images[0] for o in outs)
    assert arr.dtype == np.float32 and arr.shape == (16, 16, 3) and 0 <= arr.min() and arr.max() <= 1
    np.testing.assert_array_equal(np.asarray(pil), (arr * 255).round().astype("uint8"))
    torch.testing.assert_close(pt.permute(1, 2, 0).numpy(), arr)
    assert tuple(latent.shape) == (4, 8, 8)


def dataclass_np(p: SamplingParams) -> SamplingParams:
    return SamplingParams(**{**p.__dict__, "output_type": "np"})


@pytest.mark.slow
def test_guidance_embedding_unet_matches_pipeline(sd_guidance_embed_path):
    """LCM-distilled UNets take the guidance scale as an embedding per row instead of CFG rows."""
    engine = engine_for(sd_guidance_embed_path)
    assert not engine.model_info.guidance.supported
    pipe = StableDiffusionPipeline.from_pretrained(sd_guidance_embed_path)
    pipe.set_progress_bar_config(disable=True)
    batch = [("fast one", SamplingParams(num_inference_steps=4, guidance_scale=8.0, seed=1, sampler="lcm",
                                         height=16, width=16, output_type="np")),
             ("fast two", SamplingParams(num_inference_steps=2, guidance_scale=2.0, seed=2, sampler="lcm", n=2,
                                         height=16, width=16, output_type="np"))]
    outs = engine.generate([b[0] for b in batch], [b[1] for b in batch], use_tqdm=False)
    for (prompt, params), out in zip(batch, outs):
        assert_matches_pipeline(pipe, prompt, params, out)


def flow_batch(heun: bool) -> list[tuple[str, SamplingParams]]:
    """Flow-matching requests differing in steps, guidance, sizes (so the shift mu), n and negatives."""
    P = SamplingParams
    batch = [
        ("a red circle", P(num_inference_steps=5, guidance_scale=4.0, seed=1, height=16, width=16)),
        ("a blue square", P(num_inference_steps=7, guidance_scale=1.0, seed=2, height=16, width=16)),
        ("a green star", P(num_inference_steps=4, guidance_scale=6.0, seed=3, n=2, height=32, width=16,
                           negative_prompt="blurry")),
        ("a red circle", P(num_inference_steps=6, guidance_scale=3.5, seed=4, height=32, width=32)),
        ("a much longer prompt, so text lengths differ within one forward", P(
            num_inference_steps=5, guidance_scale=5.0, seed=6, height=16, width=16, negative_prompt="dull")),
    ]
    if heun:  # a scheduler without a vectorized update: the per-request fallback
        batch.append(("heun", P(num_inference_steps=3, guidance_scale=3.0, seed=5, height=16, width=16,
                                sampler="FlowMatchHeunDiscreteScheduler")))
    return batch


FLOW_PIPELINES = {"sd3": ("sd3_path", "StableDiffusion3Pipeline"), "flux": ("flux_path", "FluxPipeline"),
                  "qwen-image": ("qwen_image_path", "QwenImagePipeline"), "z-image": ("z_image_path", "ZImagePipeline")}


@pytest.mark.parametrize("family", sorted(FLOW_PIPELINES))
def test_flow_matching_families_match_pipeline_per_request(family, request):
    import diffusers

    fixture, pipeline_class = FLOW_PIPELINES[family]
    path = request.getfixturevalue(fixture)
    engine = engine_for(path)
    pipe = getattr(diffusers, pipeline_class).from_pretrained(path)
    pipe.set_progress_bar_config(disable=True)
    batch = flow_batch(heun=family == "sd3")
    params = [dataclass_np(p) for _, p in batch]
    outs = engine.generate([prompt for prompt, _ in batch], params, use_tqdm=False)
    for (prompt, _), p, out in zip(batch, params, outs):
        assert_matches_pipeline(pipe, prompt, p, out)
    if family != "sd3":  # a shift `mu` cannot go to FlowMatchHeun (diffusers fails too): refused up front
        with pytest.raises(ValueError, match="FlowMatchHeunDiscreteScheduler"):
            engine.add_request("heun", "x", SamplingParams(sampler="FlowMatchHeunDiscreteScheduler", height=32,
                                                           width=32))


@pytest.mark.parametrize("family, length", [("qwen-image", None), ("qwen-image", 700), ("z-image", 100)])
def test_long_prompts_are_cut_where_the_pipeline_cuts_them(family, length, request):
    """A ~840-token prompt: Qwen-Image's __call__ keeps 512 tokens by default (its encode_prompt 1024); a
    request may ask for another length, and requests of different lengths share a forward."""
    import diffusers

    fixture, pipeline_class = FLOW_PIPELINES[family]
    path = request.getfixturevalue(fixture)
    engine = engine_for(path)
    pipe = getattr(diffusers, pipeline_class).from_pretrained(path)
    pipe.set_progress_bar_config(disable=True)
    long_prompt = "a red circle on a blue square, " * 28
    P = SamplingParams
    batch = [(long_prompt, P(num_inference_steps=4, guidance_scale=4.0, seed=3, height=16, width=16,
                             negative_prompt="dull " * 40, max_sequence_length=length, output_type="np")),
             (long_prompt, P(num_inference_steps=4, guidance_scale=4.0, seed=3, height=16, width=16,
                             negative_prompt="dull " * 40, max_sequence_length=64, output_type="np"))]
    outs = engine.generate([prompt for prompt, _ in batch], [p for _, p in batch], use_tqdm=False)
    for (prompt, p), out in zip(batch, outs):
        assert_matches_pipeline(pipe, prompt, p, out)
    assert float(np.abs(outs[0].images[0] - outs[1].images[0]).max()) > TOL  # the cut is visible to the check


def test_unmasked_text_families_serve_their_default_length_only(flux_path):
    engine = engine_for(flux_path)
    with pytest.raises(ValueError, match="max_sequence_length: the flux family serves its pipeline's default, 512"):
        engine.add_request("r", "x", SamplingParams(max_sequence_length=256))
    engine.add_request("ok", "x", SamplingParams(max_sequence_length=512, num_inference_steps=1, height=16, width=16))
