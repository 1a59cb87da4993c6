"""Wan text-to-video: every video equals the diffusers pipeline's for the same seed, frame by frame, alone, in a
batch of other sizes and frame counts, and preempted; the frames' rules and the output types.

The tiny VAE squashes its frames to a narrow range (std ~0.05), where a change of prompt or guidance moves
pixels by less than the frames' tolerance: the videos are compared as latents too (std ~1), where it moves
them by 1e-2, a hundred times the latents' tolerance."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import _saved, tiny_wan_pipeline
from diffusers import WanPipeline

from dvllm import DiffusionEngine, SamplingParams

TOL, LATENT_TOL = 1e-3, 1e-4
P = SamplingParams


def reference(pipe, prompt: str, p: SamplingParams, output_type: str = "np") -> np.ndarray:
    """[n, frames, H, W, 3]: WanPipeline's videos (output_type "latent": [n, C, latent frames, h, w])."""
    extra = {} if p.guidance_scale_2 is None else {"guidance_scale_2": p.guidance_scale_2}
    videos = pipe(prompt, negative_prompt=p.negative_prompt, num_inference_steps=p.num_inference_steps,
                  height=p.height, width=p.width, num_frames=p.num_frames, guidance_scale=p.guidance_scale,
                  num_videos_per_prompt=p.n, generator=torch.Generator("cpu").manual_seed(p.seed),
                  output_type=output_type, **extra).frames
    return videos.numpy() if output_type == "latent" else videos


def assert_batch_equals_pipeline(engine, pipe, batch: list[tuple[str, SamplingParams]],
                                 reference_of=reference) -> list:
    """Each request's videos, batched together, equal the pipeline's (`reference_of(pipe, prompt, params,
    output_type)`; default: WanPipeline's): as frames and as latents."""
    outs = []
    for output_type, tol in (("np", TOL), ("latent", LATENT_TOL)):
        params = [P(**{**vars(p), "output_type": output_type}) for _, p in batch]
        outs = engine.generate([q for q, _ in batch], params, use_tqdm=False)
        for (prompt, p), out in zip(batch, outs):
            assert out.error is None, out.error
            want = reference_of(pipe, prompt, p, output_type)
            assert len(out.images) == p.n
            for i, video in enumerate(out.images):
                assert_video_equals(np.asarray(video), want[i], f"{prompt!r} {output_type} video {i}", tol)
    return outs


def mixed() -> list[tuple[str, SamplingParams]]:
    """Videos of two sizes and three frame counts, with and without CFG, n=2, other step counts."""
    return [
        ("a red circle moving to the right", P(num_inference_steps=4, guidance_scale=5.0, seed=1, height=16,
                                                width=16, num_frames=9, output_type="np")),
        ("a blue square", P(num_inference_steps=6, guidance_scale=1.0, seed=2, height=32, width=16, num_frames=5,
                            output_type="np")),
        ("a green star", P(num_inference_steps=5, guidance_scale=4.0, seed=3, height=16, width=16, num_frames=9,
                           negative_prompt="blurry", n=2, output_type="np")),
        ("a yellow moon", P(num_inference_steps=3, guidance_scale=3.0, seed=4, height=16, width=16, num_frames=1,
                            output_type="np")),
    ]


@pytest.fixture(scope="module")
def wan(wan_path):
    pipe = WanPipeline.from_pretrained(wan_path)
    pipe.set_progress_bar_config(disable=True)
    return DiffusionEngine(model=wan_path, device="cpu", dtype="float32"), pipe


def assert_video_equals(got: np.ndarray, want: np.ndarray, what: str, tol: float = TOL) -> None:
    assert got.shape == want.shape, what
    diff = float(np.abs(got - want).max())
    assert diff <= tol, f"{what}: max abs diff {diff}"


def test_mixed_videos_equal_the_pipeline_and_each_alone(wan):
    engine, pipe = wan
    batch = mixed()
    outs = assert_batch_equals_pipeline(engine, pipe, batch)
    first = P(**{**vars(batch[0][1]), "output_type": "latent"})
    alone = engine.generate(batch[0][0], first, use_tqdm=False)[0]
    np.testing.assert_allclose(alone.images[0].numpy(), outs[0].images[0].numpy(), atol=LATENT_TOL, rtol=0)
    # the check can fail: a prompt and guidance each move the latents by far more than their tolerance
    for change in ({"guidance_scale": 2.0}, {"seed": 99}):
        other = engine.generate(batch[0][0], P(**{**vars(first), **change}), use_tqdm=False)[0]
        assert float((other.images[0] - outs[0].images[0]).abs().max()) > 20 * LATENT_TOL, change
    other = engine.generate("a blue square", first, use_tqdm=False)[0]
    assert float((other.images[0] - outs[0].images[0]).abs().max()) > 20 * LATENT_TOL


def test_timesteps_per_token_match_the_pipeline(tmp_path_factory):
    """Wan 2.2 TI2V's expand_timesteps: the transformer takes one timestep per latent token."""
    path = _saved(tmp_path_factory, "tiny-wan-ti2v", tiny_wan_pipeline(expand_timesteps=True))
    pipe = WanPipeline.from_pretrained(path)
    pipe.set_progress_bar_config(disable=True)
    engine = DiffusionEngine(model=path, device="cpu", dtype="float32")
    assert engine.model_info.video.fps == 24.0
    assert_batch_equals_pipeline(engine, pipe, mixed()[:2])


def test_a_preempted_video_comes_back_the_same(wan_path):
    engine = DiffusionEngine(model=wan_path, device="cpu", dtype="float32", max_batch_size=2,
                             scheduling_policy="priority")
    low = P(num_inference_steps=6, seed=1, height=16, width=16, num_frames=9, output_type="np", priority=5)
    alone = engine.generate(["x"], [low], use_tqdm=False)[0].images[0]
    engine.add_request("low", "x", low)
    for _ in range(3):
        engine.step()
    engine.add_request("urgent", "y", P(num_inference_steps=3, seed=2, height=16, width=16, num_frames=9,
                                         output_type="np", priority=0))
    outs = {}
    while len(outs) < 2:
        for out in engine.step():
            if out.finished:
                assert out.error is None, out.error
                outs[out.request_id] = out
    assert engine.stats()["num_preemptions"] >= 1
    assert float(np.abs(outs["low"].images[0] - alone).max()) <= 1e-6


def test_output_types_and_defaults(wan):
    engine, _ = wan
    common = dict(num_inference_steps=2, seed=5, height=16, width=32, num_frames=5)
    np_video = engine.generate("x", P(output_type="np", **common), use_tqdm=False)[0].images[0]
    assert np_video.shape == (5, 16, 32, 3)
    pt_video = engine.generate("x", P(output_type="pt", **common), use_tqdm=False)[0].images[0]
    assert tuple(pt_video.shape) == (5, 3, 16, 32)
    np.testing.assert_allclose(pt_video.permute(0, 2, 3, 1).numpy(), np_video, atol=1e-6)
    frames = engine.generate("x", P(output_type="pil", **common), use_tqdm=False)[0].images[0]
    assert len(frames) == 5 and frames[0].size == (32, 16)
    latents = engine.generate("x", P(output_type="latent", **common), use_tqdm=False)[0].images[0]
    assert tuple(latents.shape) == (16, 2, 2, 4)  # the first frame, then one latent frame for 4
    resolved = P().resolve(engine.model_info, engine.config)
    assert (resolved.num_frames, resolved.fps, resolved.height, resolved.width) == (81, 16.0, 480, 832)


@pytest.mark.parametrize("params, message", [
    (P(num_frames=10), r"num_frames - 1 must be a multiple of 4.*9 or 13 would do"),
    (P(num_frames=133), r"at most 129 \(max_num_frames\)"),
    (P(height=1040, width=16), r"at most 1024 for this model \(its position tables\)"),
    (P(num_frames=0), "num_frames"),
    (P(fps=0), "fps"),
    (P(fps=float("nan")), "fps"),
    (P(height=24, width=16), "multiple of 16"),
])
def test_bad_video_parameters_are_refused(wan, params, message):
    engine, _ = wan
    with pytest.raises(ValueError, match=message):
        engine.add_request("bad", "x", params)
    assert not engine.has_unfinished_requests()


def test_image_models_refuse_frames(flux_path):
    engine = DiffusionEngine(model=flux_path, device="cpu", dtype="float32")
    for params in (P(num_frames=9), P(fps=24)):
        with pytest.raises(ValueError, match="makes images, not videos"):
            engine.add_request("v", "x", params)


def test_two_experts_each_run_their_rows_with_their_own_guidance(tmp_path_factory):
    """Wan 2.2 A14B: rows above the boundary timestep run the first expert with guidance_scale, rows below it the
    second with guidance_scale_2; a step whose rows straddle the boundary runs one call per expert."""
    path = _saved(tmp_path_factory, "tiny-wan-a14b", tiny_wan_pipeline(two_experts=True))
    pipe = WanPipeline.from_pretrained(path)
    pipe.set_progress_bar_config(disable=True)
    engine = DiffusionEngine(model=path, device="cpu", dtype="float32")
    assert engine.model_info.expert_boundary == 875.0
    calls = {0: [], 1: []}
    for i, expert in enumerate((pipe_of(engine).transformer, pipe_of(engine).transformer_2)):
        expert.register_forward_hook(lambda m, args, kwargs, out, i=i: calls[i].append(len(kwargs["hidden_states"])),
                                     with_kwargs=True)
    batch = [("a red circle moving to the right", P(num_inference_steps=8, guidance_scale=5.0, guidance_scale_2=2.0,
                                                     seed=1, height=16, width=16, num_frames=5, output_type="np")),
             ("a blue square", P(num_inference_steps=3, guidance_scale=4.0, seed=2, height=16, width=16,
                                 num_frames=5, output_type="np"))]
    outs = assert_batch_equals_pipeline(engine, pipe, batch)
    assert calls[0] and calls[1]
    # 11 steps of CFG rows in all, run twice (frames, then latents): fewer calls than steps means rows shared
    assert sum(len(c) for c in calls.values()) < 2 * 11 and sum(map(sum, calls.values())) == 2 * 2 * 11
    # the second scale counts: the first request with guidance_scale_2 left at its default is another video
    same = P(**{**vars(batch[0][1]), "guidance_scale_2": None, "output_type": "latent"})
    other = engine.generate(batch[0][0], same, use_tqdm=False)[0]
    assert float((other.images[0] - outs[0].images[0]).abs().max()) > 20 * LATENT_TOL


def test_guidance_scale_2_is_refused_with_one_expert(wan):
    engine, _ = wan
    with pytest.raises(ValueError, match="guidance_scale_2: this model"):
        engine.add_request("g2", "x", P(guidance_scale_2=3.0))


def test_the_result_cache_serves_a_repeated_video(wan_path):
    engine = DiffusionEngine(model=wan_path, device="cpu", dtype="float32", result_cache_mb=16)
    params = P(num_inference_steps=2, seed=7, height=16, width=16, num_frames=5)
    first = engine.generate("x", params, use_tqdm=False)[0]
    again = engine.generate("x", params, use_tqdm=False)[0]
    assert again.metrics.result_cache_hit and len(again.images[0]) == 5
    assert all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(again.images[0], first.images[0]))
    other = engine.generate("x", P(**{**vars(params), "num_frames": 9}), use_tqdm=False)[0]
    assert not other.metrics.result_cache_hit and len(other.images[0]) == 9


def pipe_of(engine: DiffusionEngine):
    return engine.executor.worker.runner.adapter.pipeline


@pytest.mark.parametrize("decode_stage", [False, True])
def test_previews_are_the_pipelines_x0_estimates_decoded(wan_path, decode_stage):
    """UniPC reports no x0: a preview is the solver's converted model output (its x0 estimate) of that step,
    decoded, whether the loop or the decode stage decodes it."""
    pipe = WanPipeline.from_pretrained(wan_path)
    pipe.set_progress_bar_config(disable=True)
    estimates = {}

    def keep_x0(pipeline, i, t, kwargs):
        estimates[i + 1] = pipeline.scheduler.model_outputs[-1].clone()
        return {}

    params = P(num_inference_steps=6, seed=1, height=16, width=16, num_frames=5, num_previews=2, output_type="np")
    pipe("x", num_inference_steps=6, height=16, width=16, num_frames=5, guidance_scale=5.0,
         generator=torch.Generator("cpu").manual_seed(1), callback_on_step_end=keep_x0)
    engine = DiffusionEngine(model=wan_path, device="cpu", dtype="float32", decode_stage=decode_stage)
    engine.add_request("v", "x", params)
    previews = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.error is None, out.error
            if out.previews:
                previews[out.preview_step] = out.previews[0]
    assert sorted(previews) == [2, 4]
    assert float(np.abs(previews[2] - previews[4]).max()) > 10 * TOL  # each step's own estimate
    adapter = engine.executor.worker.runner.adapter
    for step, video in previews.items():
        with torch.no_grad():
            want = adapter.decode(estimates[step], (16, 16, 5))[0].permute(0, 2, 3, 1).numpy()
        assert_video_equals(video, want, f"preview after step {step}")
    engine.shutdown()


@pytest.mark.parametrize("sampler", [None, "FlowMatchEulerDiscreteScheduler"])
def test_bfloat16_keeps_the_pipelines_float32_latents(wan_path, sampler):
    """WanPipeline draws and steps its latents in float32 beside a bfloat16 transformer; so does the pool (with
    bfloat16 latents the frames moved by 0.05-0.08). Alone, with and without CFG, through diffusers' UniPC and
    through the fused update."""
    import diffusers

    pipe = WanPipeline.from_pretrained(wan_path, torch_dtype=torch.bfloat16)
    pipe.set_progress_bar_config(disable=True)
    if sampler is not None:
        pipe.scheduler = getattr(diffusers, sampler).from_config(pipe.scheduler.config)
    engine = DiffusionEngine(model=wan_path, device="cpu", dtype="bfloat16")
    for guidance in (1.0, 5.0):
        params = P(num_inference_steps=5, seed=1, height=32, width=32, num_frames=9, guidance_scale=guidance,
                   sampler=sampler, output_type="np")
        engine.add_request("r", "a red circle", params)
        engine.step()
        # UniPC rounds its x0 term as diffusers does and runs fused; flow Euler rounds its result through
        # bfloat16, which the update does not repeat, and is stepped by diffusers (docs/samplers.md)
        (state,) = engine.executor.worker.runner.states.values()
        assert (state.fallback is None) == (sampler is None)
        engine.abort_request("r")
        got = engine.generate("a red circle", params, use_tqdm=False)[0].images[0]
        assert_video_equals(got, reference(pipe, "a red circle", params)[0], f"bfloat16, guidance {guidance}")
    engine.shutdown()


@pytest.mark.slow
def test_decode_workers_give_the_pipelines_videos(wan_path):
    """A decode process (decode_workers) decodes videos as the loop does: each video, of two sizes and frame
    counts, and its previews, equal the pipeline's (the copy once lacked the video processor: every video
    failed at its last step)."""
    pipe = WanPipeline.from_pretrained(wan_path)
    pipe.set_progress_bar_config(disable=True)
    engine = DiffusionEngine(model=wan_path, device="cpu", dtype="float32", decode_workers=1)
    batch = [(prompt, P(**{**vars(p), "num_previews": 1})) for prompt, p in mixed()[:3]]
    outs = assert_batch_equals_pipeline(engine, pipe, batch)
    assert all(out.finished for out in outs)
    engine.add_request("p", *batch[0])
    previews = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.error is None, out.error
            previews += out.previews
    assert len(previews) == 1 and previews[0].shape == (9, 16, 16, 3)
    engine.shutdown()


def test_wans_own_sampler_runs_in_the_fused_update(wan):
    """UniPC (Wan's scheduler: 2 history slots), DPM-Solver++ over flow sigmas (1 slot) and flow Euler (none) in
    one batch, each stepped by the fused update (no diffusers scheduler steps any request), each video equal to
    WanPipeline's with that scheduler."""
    import diffusers

    engine, pipe = wan
    samplers = [None, "DPMSolverMultistepScheduler", "FlowMatchEulerDiscreteScheduler", None]
    batch = [(prompt, P(**{**vars(p), "sampler": sampler})) for (prompt, p), sampler in zip(mixed(), samplers)]
    own = pipe.scheduler

    def reference_of(pipe, prompt, p, output_type):
        pipe.scheduler = own if p.sampler is None else getattr(diffusers, p.sampler).from_config(own.config)
        return reference(pipe, prompt, p, output_type)

    try:
        for prompt, params in batch:
            engine.add_request(prompt, prompt, params)
        engine.step()
        states = engine.executor.worker.runner.states.values()
        assert len(states) == len(batch) and all(s.fallback is None for s in states)
        assert sorted(s.plan.history_slots for s in states) == [0, 1, 2, 2]
        while engine.has_unfinished_requests():
            engine.step()
        assert_batch_equals_pipeline(engine, pipe, batch, reference_of)
    finally:
        pipe.scheduler = own
