"""UniPC and DPM-Solver++ in the fused update's form against diffusers' own step, over their options.

Wan's default sampler is UniPC over flow sigmas; SANA's and Wan's alternative is DPM-Solver++ over flow
sigmas. Each configuration here is stepped both ways from the same noise by the same fake denoiser
(tests/test_samplers.py's), and every step must agree: predictor and corrector at every order, the order's
warm-up and lower-order end, a disabled corrector, bh1 and bh2, and a run that starts mid-schedule.
"""
import pytest
import torch
from diffusers import DPMSolverMultistepScheduler, UniPCMultistepScheduler

from dvllm.samplers import build_plan
from test_samplers import dvllm_trajectory, fake_denoiser


def _config(cls, **options) -> dict:
    cfg = dict(cls(**options).config)
    cfg["_class_name"] = cls.__name__
    return cfg


def _wan_like(cls, **options) -> dict:  # Wan's scheduler config (flow sigmas, flow_shift 3)
    return _config(cls, prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0, **options)


def _reference(cfg: dict, num_steps: int, start: int, dtype: torch.dtype = torch.float32):
    """The diffusers scheduler of this config, ready to step from `start` as the img2img pipelines do."""
    cls = UniPCMultistepScheduler if cfg["_class_name"].startswith("UniPC") else DPMSolverMultistepScheduler
    scheduler = cls.from_config(cfg)
    scheduler.set_timesteps(num_steps)
    scheduler.set_begin_index(start)
    if dtype == torch.float64:  # its own arithmetic in float64: the truth both float32 runs are measured from
        scheduler.sigmas = scheduler.sigmas.double()
    return scheduler


def _diffusers_run(scheduler, start: int, x: torch.Tensor, table: torch.Tensor) -> list[torch.Tensor]:
    out = []
    for t in scheduler.timesteps[start:]:
        x = scheduler.step(fake_denoiser(x, float(t), table), t, x, return_dict=False)[0]
        out.append(x)
    return out


def _runs(cfg: dict, num_steps: int, strength: float | None = None, slots: int | None = None):
    plan = build_plan(cfg, None, num_steps, strength)
    assert plan.vectorized, cfg
    if slots is not None:
        assert plan.history_slots == slots
    gen = torch.Generator().manual_seed(num_steps)
    x, table = torch.randn(2, 4, 6, 6, generator=gen), torch.randn(2, 4, 6, 6, generator=gen)
    ours = dvllm_trajectory(plan, x.clone(), table, None)
    theirs = _diffusers_run(_reference(cfg, num_steps, plan.start_index), plan.start_index, x.clone(), table)
    assert len(ours) == len(theirs) == plan.num_steps
    return plan, x, table, ours, theirs


def _compare(cfg: dict, num_steps: int, strength: float | None = None, slots: int | None = None) -> None:
    _, _, _, ours, theirs = _runs(cfg, num_steps, strength, slots)
    for step, (a, b) in enumerate(zip(ours, theirs)):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=2e-5, msg=f"{cfg} diverges at step {step}")


@pytest.mark.parametrize("order", [1, 2, 3])
@pytest.mark.parametrize("solver_type", ["bh1", "bh2"])
@pytest.mark.parametrize("num_steps", [1, 2, 5, 20])
def test_unipc_flow_matches_diffusers(order, solver_type, num_steps):
    # bh1 ends at the last training sigma: at a zero final sigma diffusers' bh1 step is NaN (next test)
    final = "sigma_min" if solver_type == "bh1" else "zero"
    _compare(_wan_like(UniPCMultistepScheduler, solver_order=order, solver_type=solver_type, final_sigmas_type=final),
             num_steps, slots=order)


def test_unipc_bh1_to_zero_sigma_is_finite_where_diffusers_gives_nan():
    """bh1's B(h) = -h is infinite on a last step to sigma 0; diffusers multiplies it by its empty (zero) correction
    and gets NaN. dvllm leaves the empty term out, so its last step is that step's x0, as bh2's is."""
    _, x, table, ours, theirs = _runs(_wan_like(UniPCMultistepScheduler, solver_type="bh1"), 5)
    for a, b in zip(ours[:-1], theirs[:-1]):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=2e-5)
    assert theirs[-1].isnan().all() and torch.isfinite(ours[-1]).all()


@pytest.mark.parametrize("prediction_type", ["epsilon", "v_prediction", "sample"])
@pytest.mark.parametrize("order", [2, 3])
def test_unipc_karras_sigmas_match_diffusers(prediction_type, order):
    _compare(_config(UniPCMultistepScheduler, prediction_type=prediction_type, solver_order=order,
                     final_sigmas_type="sigma_min"), 12)


@pytest.mark.parametrize("options", [
    {"lower_order_final": False, "final_sigmas_type": "sigma_min"},  # a last step at full order
    {"disable_corrector": [0, 3]},
    {"use_karras_sigmas": True, "use_flow_sigmas": False, "prediction_type": "epsilon"},
])
def test_unipc_options_match_diffusers(options):
    _compare(_wan_like(UniPCMultistepScheduler, solver_order=3) | options if "use_flow_sigmas" not in options
             else _config(UniPCMultistepScheduler, solver_order=3, **options), 9)


@pytest.mark.parametrize("order", [2, 3])
def test_unipc_from_mid_schedule_matches_diffusers(order):
    """Image-to-image starts the order's warm-up at its first step, not the schedule's."""
    _compare(_wan_like(UniPCMultistepScheduler, solver_order=order), 10, strength=0.6)


@pytest.mark.parametrize("order", [1, 2, 3])
@pytest.mark.parametrize("solver_type", ["midpoint", "heun"])
@pytest.mark.parametrize("num_steps", [3, 8, 20])
def test_dpmpp_flow_matches_diffusers(order, solver_type, num_steps):
    _compare(_wan_like(DPMSolverMultistepScheduler, solver_order=order, solver_type=solver_type), num_steps,
             slots=order - 1)


@pytest.mark.parametrize("prediction_type", ["epsilon", "v_prediction"])
@pytest.mark.parametrize("strength", [None, 0.5])
def test_dpmpp_third_order_matches_diffusers(prediction_type, strength):
    """Over Karras sigmas the fake denoiser's trajectory grows to hundreds, where float32 rounds at 1e-4: both
    float32 runs are measured from diffusers' own arithmetic in float64, and dvllm's may err no more than 2x
    diffusers' own float32 run does."""
    cfg = _config(DPMSolverMultistepScheduler, prediction_type=prediction_type, solver_order=3)
    plan, x, table, ours, theirs = _runs(cfg, 25, strength, slots=2)
    truth = _diffusers_run(_reference(cfg, 25, plan.start_index, torch.float64), plan.start_index, x.double(),
                           table.double())
    for step, (a, b, exact) in enumerate(zip(ours, theirs, truth)):
        ours_error, theirs_error = (a - exact).abs().max(), (b - exact).abs().max()
        assert ours_error <= 2 * theirs_error + 1e-6, (step, float(ours_error), float(theirs_error))
