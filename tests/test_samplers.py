"""Vectorized sampler updates against the diffusers schedulers they stand for.

A fake denoiser (a fixed function of the input) drives both the diffusers scheduler,
stepped as the pipeline steps it, and dvllm's plan + `sampler_update`; the
trajectories must agree at every step.
"""
import copy

import pytest
import torch
from diffusers import DDIMScheduler

from dvllm.ops import sampler_update
from dvllm.samplers import SHORT_NAMES, build_plan, make_scheduler
from dvllm.samplers.multistep import slot_order

VECTORIZED = ["ddim", "euler", "euler_a", "dpmpp_2m", "dpmpp_2m_karras", "lcm"]


def base_config(prediction_type: str, **extra) -> dict:
    cfg = dict(DDIMScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
                             clip_sample=False, set_alpha_to_one=False, prediction_type=prediction_type,
                             steps_offset=1, **extra).config)
    cfg["_class_name"] = "DDIMScheduler"
    return cfg


def fake_denoiser(x_in: torch.Tensor, t: float, table: torch.Tensor) -> torch.Tensor:
    return 0.3 * torch.tanh(x_in) + table * (1.0 + t / 1000.0)


def diffusers_trajectory(scheduler, x, table, generator):
    out = []
    for t in scheduler.timesteps:
        x_in = scheduler.scale_model_input(x, t) if hasattr(scheduler, "scale_model_input") else x
        mo = fake_denoiser(x_in, float(t), table)
        kwargs = {"generator": generator} if generator is not None else {}  # UniPC's step takes none
        x = scheduler.step(mo, t, x, return_dict=False, **kwargs)[0]
        out.append(x)
    return out


def dvllm_trajectory(plan, x, table, generator):
    """The plan's steps as the worker runs them: its history slots start at zero and rotate (slot_order)."""
    out, runs = [], [torch.zeros_like(x) for _ in range(plan.history_slots)]
    for step, row in enumerate(plan.steps):
        mo = fake_denoiser(x * row.c_in, row.timestep, table)
        coeffs = torch.tensor([row.coeffs] * x.shape[0], dtype=torch.float32)
        noise = torch.randn(x.shape, generator=generator) if row.draws_noise else None
        clip = row.coeffs[2] != float("inf")
        order = slot_order(step, plan.history_slots)
        x, x0 = sampler_update(x, mo, coeffs, [runs[k] for k in order], noise, clip=clip)
        if runs:
            runs[order[0]] = x0
        out.append(x)
    return out


@pytest.mark.parametrize("prediction_type", ["epsilon", "v_prediction"])
@pytest.mark.parametrize("sampler", VECTORIZED)
@pytest.mark.parametrize("num_steps", [1, 4, 25])
def test_vectorized_matches_diffusers(sampler, prediction_type, num_steps):
    cfg = base_config(prediction_type)
    plan = build_plan(cfg, sampler, num_steps)
    assert plan.vectorized and plan.num_steps == num_steps
    reference = make_scheduler(cfg, sampler)
    reference.set_timesteps(num_steps)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 4, 8, 8, generator=gen) * plan.init_noise_sigma
    table = torch.randn(2, 4, 8, 8, generator=gen)
    ours = dvllm_trajectory(plan, x.clone(), table, torch.Generator().manual_seed(7))
    theirs = diffusers_trajectory(reference, x.clone(), table, torch.Generator().manual_seed(7))
    assert plan.init_noise_sigma == pytest.approx(float(reference.init_noise_sigma))
    for step, (a, b) in enumerate(zip(ours, theirs)):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=2e-5, msg=f"{sampler} diverges at step {step}")


@pytest.mark.parametrize("prediction_type", ["epsilon", "v_prediction", "sample"])
def test_ddim_clip_sample_matches_diffusers(prediction_type):
    cfg = base_config(prediction_type, clip_sample_range=0.5)
    cfg["clip_sample"] = True
    plan = build_plan(cfg, "ddim", 10)
    reference = make_scheduler(cfg, "ddim")
    reference.set_timesteps(10)
    gen = torch.Generator().manual_seed(3)
    x, table = torch.randn(1, 4, 8, 8, generator=gen), torch.randn(1, 4, 8, 8, generator=gen)
    ours = dvllm_trajectory(plan, x.clone(), table, None)
    theirs = diffusers_trajectory(reference, x.clone(), table, None)
    torch.testing.assert_close(ours[-1], theirs[-1], atol=2e-5, rtol=2e-5)


def test_dpm_heun_and_first_order_are_vectorized():
    cfg = base_config("epsilon")
    for overrides in ({"solver_type": "heun"}, {"solver_order": 1}):
        scheduler = make_scheduler(cfg, "dpmpp_2m")
        scheduler = type(scheduler).from_config(scheduler.config, **overrides)
        scheduler.set_timesteps(12)
        from dvllm.samplers import plan_for

        plan = plan_for("dpm", copy.deepcopy(scheduler))
        assert plan.vectorized
        gen = torch.Generator().manual_seed(5)
        x, table = torch.randn(1, 4, 8, 8, generator=gen), torch.randn(1, 4, 8, 8, generator=gen)
        ours = dvllm_trajectory(plan, x.clone(), table, None)
        theirs = diffusers_trajectory(scheduler, x.clone(), table, None)
        torch.testing.assert_close(ours[-1], theirs[-1], atol=2e-5, rtol=2e-5)


def test_unsupported_configs_fall_back_to_diffusers():
    cfg = base_config("epsilon")
    assert not build_plan(cfg, "PNDMScheduler", 10).vectorized
    assert not build_plan(cfg, "FlowMatchHeunDiscreteScheduler", 10).vectorized
    assert not build_plan(cfg, "HeunDiscreteScheduler", 10).vectorized
    sde = dict(cfg, algorithm_type="sde-dpmsolver++", _class_name="DPMSolverMultistepScheduler")
    assert not build_plan(sde, None, 10).vectorized
    unipc = dict(cfg, _class_name="UniPCMultistepScheduler", _use_default_values=[])  # else diffusers drops them
    assert not build_plan(dict(unipc, predict_x0=False), None, 10).vectorized
    assert not build_plan(dict(unipc, thresholding=True), None, 10).vectorized


def test_short_names_are_the_documented_diffusers_configs():
    cfg = base_config("epsilon")
    karras = make_scheduler(cfg, "dpmpp_2m_karras")
    assert type(karras).__name__ == "DPMSolverMultistepScheduler"
    assert karras.config.use_karras_sigmas and karras.config.algorithm_type == "dpmsolver++"
    assert karras.config.solver_order == 2
    assert set(SHORT_NAMES) == {"ddim", "euler", "euler_a", "dpmpp_2m", "dpmpp_2m_karras", "lcm", "flow_euler"}


def test_bad_sampler_and_step_count_raise_value_error():
    cfg = base_config("epsilon")
    with pytest.raises(ValueError, match="sampler must be one of"):
        build_plan(cfg, "not_a_sampler", 10)
    with pytest.raises(ValueError, match="sampler must be one of"):
        build_plan(cfg, "UNet2DConditionModel", 10)
    with pytest.raises(ValueError, match="num_inference_steps=80"):
        build_plan(cfg, "lcm", 80)
    with pytest.raises(ValueError, match="num_inference_steps=1000"):  # steps_offset pushes past t=999
        build_plan(cfg, "ddim", 1000)


@pytest.mark.parametrize("overrides", [{"shift": 3.0}, {"shift": 1.0, "stochastic_sampling": True},
                                       {"use_dynamic_shifting": True}])
def test_flow_euler_matches_diffusers(overrides):
    from diffusers import FlowMatchEulerDiscreteScheduler

    cfg = dict(FlowMatchEulerDiscreteScheduler(**overrides).config)
    cfg["_class_name"] = "FlowMatchEulerDiscreteScheduler"
    # dynamic shifting needs the pipeline's resolution-dependent mu, and Flux passes its own sigmas
    extra = {"mu": 0.8, "sigmas": [1.0 - i / 7 for i in range(7)]} if overrides.get("use_dynamic_shifting") else {}
    plan = build_plan(cfg, "flow_euler", 7, **extra)
    assert plan.vectorized and plan.num_steps == 7
    reference = make_scheduler(cfg, "flow_euler")
    reference.set_timesteps(**({"num_inference_steps": 7} if not extra else {}), **extra)
    gen = torch.Generator().manual_seed(2)
    x, table = torch.randn(2, 4, 8, 8, generator=gen), torch.randn(2, 4, 8, 8, generator=gen)
    ours = dvllm_trajectory(plan, x.clone(), table, torch.Generator().manual_seed(9))
    theirs = diffusers_trajectory(reference, x.clone(), table, torch.Generator().manual_seed(9))
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=2e-5)
