"""max_running_pixels: where one request fills the GPU, requests run in turn instead of sharing every step.

On an H200 (2026-12-04) six Wan 1.3B clips of five shapes, all sent at once, ran at the pipeline's own throughput
whether dvllm stepped them together or not, and sharing the steps doubled their median latency: each finished
near the end. The bound keeps admission in order while the running requests fill it.
"""
from __future__ import annotations

import numpy as np
import pytest
from scheduler_utils import Clock, iterate, make

from dvllm import DiffusionEngine, SamplingParams
from dvllm.config import EngineConfig
from dvllm.core.request import Request
from dvllm.core.scheduler import Scheduler
from dvllm.core.scheduler_config import SchedulerConfig

ONE_16PX_CFG = 2 * 16 * 16  # rows x height x width of one CFG request at 16x16


def run_to_the_end(s: Scheduler, limit: int = 1000) -> tuple[list[str], int]:
    """Finish order and the most requests that ran at once (a scheduler that stalls fails, not hangs)."""
    order, most = [], 0
    for _ in range(limit):
        if not s.has_unfinished_requests():
            return order, most
        _, outputs = iterate(s)
        most = max(most, len(s.running))
        order += [o.request_id for o in outputs if o.finished]
    raise AssertionError(f"requests did not finish in {limit} iterations")


def test_requests_run_in_turn_when_each_fills_the_bound():
    s, c = make(max_running_pixels=ONE_16PX_CFG), Clock()
    for rid, steps, size in (("a", 5, 16), ("b", 3, 24), ("c", 2, 16), ("d", 4, 32)):
        s.add_request(c.request(rid, steps=steps, size=size))
    out, _ = iterate(s)
    assert out.scheduled_ids == ["a"] and [r.request_id for r in s.waiting] == ["b", "c", "d"]
    order, most = run_to_the_end(s)
    # in arrival order, one at a time: b is larger than the bound and runs alone; c, small, does not overtake it
    assert order == ["a", "b", "c", "d"] and most == 1


def test_without_the_bound_every_shape_runs_at_once():
    s, c = make(), Clock()
    for rid, steps, size in (("a", 5, 16), ("b", 3, 24), ("c", 2, 16), ("d", 4, 32)):
        s.add_request(c.request(rid, steps=steps, size=size))
    iterate(s)
    assert len(s.running) == 4 and not s.waiting


def test_requests_under_the_bound_still_share_a_forward():
    s, c = make(max_running_pixels=2 * ONE_16PX_CFG), Clock()
    for rid, steps in (("a", 3), ("b", 5), ("c", 2)):
        s.add_request(c.request(rid, steps=steps))
    out, _ = iterate(s)
    assert out.scheduled_ids == ["a", "b"] and [r.request_id for r in s.waiting] == ["c"]
    iterate(s)
    out, _ = iterate(s)  # a's last step
    assert sorted(out.scheduled_ids) == ["a", "b"]
    out, _ = iterate(s)  # a left: c takes its place beside b
    assert sorted(out.scheduled_ids) == ["b", "c"]


def test_a_request_over_the_bound_runs_alone_rather_than_never():
    s, c = make(max_running_pixels=1), Clock()
    for rid in ("a", "b"):
        s.add_request(c.request(rid, steps=2, n=2))
    order, most = run_to_the_end(s)
    assert order == ["a", "b"] and most == 1


def test_an_urgent_request_preempts_less_urgent_ones_past_the_bound():
    """With scheduling_policy=priority the bound orders requests by urgency, as rows and blocks do: an urgent
    arrival preempts the less urgent running requests whose pixels keep it out (it used to wait behind them),
    and never a more urgent one; the victims resume after it."""
    s, c = make(max_running_pixels=2 * ONE_16PX_CFG, scheduling_policy="priority"), Clock()
    for rid in ("low", "mid"):
        s.add_request(c.request(rid, steps=6, priority={"low": 5, "mid": 1}[rid]))
    out, _ = iterate(s)
    assert sorted(out.scheduled_ids) == ["low", "mid"]
    s.add_request(c.request("urgent", steps=2, priority=0))
    out, _ = iterate(s)
    assert out.preempted_ids == ["low"] and sorted(out.scheduled_ids) == ["mid", "urgent"]
    s.add_request(c.request("later", steps=2, priority=3))  # less urgent than mid: it waits, preempting no one
    out, outputs = iterate(s)
    assert not out.preempted_ids and "later" not in out.scheduled_ids
    assert [o.request_id for o in outputs if o.finished] == ["urgent"]
    order, most = run_to_the_end(s)
    assert order == ["later", "mid", "low"] or order == ["mid", "later", "low"]
    assert most <= 2 and s.num_preemptions == 1


def test_a_videos_pixels_count_its_frames_and_rows():
    params = SamplingParams(num_inference_steps=4, guidance_scale=5.0, height=32, width=48, num_frames=9, n=2,
                            seed=0)
    request = Request(request_id="v", prompt="v", params=params, num_steps=4, cfg=True, plan=None,
                      arrival_time=0.0, arrival_seq=1)
    assert request.pixels == 4 * 9 * 32 * 48


def test_a_worker_that_is_full_takes_no_request_from_another():
    s, c = make(max_running_pixels=ONE_16PX_CFG), Clock()
    s.add_request(c.request("a", steps=4))
    iterate(s)
    other = c.request("b", steps=4)
    assert not s.can_admit(other)
    empty = make(max_running_pixels=ONE_16PX_CFG)
    assert empty.can_admit(other) and not empty.can_admit(other, extra_pixels=ONE_16PX_CFG)


@pytest.mark.parametrize("value", [0, -5, 1.5])
def test_a_bad_bound_is_refused(value):
    with pytest.raises(ValueError, match="max_running_pixels"):
        SchedulerConfig.of(EngineConfig(max_running_pixels=value))


def test_the_bound_changes_no_image(sd_eps_path):
    prompts = ["a red cat", "a blue dog", "green hills"]
    params = [SamplingParams(num_inference_steps=steps, guidance_scale=g, height=32, width=size, seed=i,
                             output_type="np")
              for i, (steps, g, size) in enumerate(((3, 5.0, 32), (4, 1.0, 32), (2, 7.5, 16)))]
    images = {}
    for bound in (None, 1):
        engine = DiffusionEngine(model=sd_eps_path, device="cpu", dtype="float32", max_running_pixels=bound)
        images[bound] = [o.images[0] for o in engine.generate(prompts, params, use_tqdm=False)]
    for alone, shared in zip(images[1], images[None]):
        # a forward of other rows rounds float32 sums in another order (BLAS blocking): not bit-for-bit
        np.testing.assert_allclose(alone, shared, atol=1e-5, rtol=0)
