"""The scheduler alone: pure bookkeeping, no model, no tensors."""
from __future__ import annotations

import pytest
from scheduler_utils import Clock, iterate, make

from dvllm.config import EngineConfig
from dvllm.core.request import RequestStatus, check_fits, prompt_cache_key
from dvllm.core.scheduler import Scheduler
from dvllm.core.scheduler_config import SchedulerConfig
from dvllm.core.scheduler_output import RunnerOutput


def test_requests_join_at_the_next_step_and_leave_when_done():
    s, c = make(), Clock()
    s.add_request(c.request("a", steps=6))
    iterate(s)
    iterate(s)
    s.add_request(c.request("b", steps=3))
    out, _ = iterate(s)
    assert out.scheduled_ids == ["a", "b"]  # one forward: a at step 3, b at step 1
    assert [r.request_id for r in out.new_requests] == ["b"]
    assert (s.requests["a"].num_steps_done, s.requests["b"].num_steps_done) == (3, 1)
    iterate(s)
    _, outputs = iterate(s)
    finished = {o.request_id: o for o in outputs if o.finished}
    assert set(finished) == {"b"} and finished["b"].images == ["img"] and finished["b"].error is None
    out, outputs = iterate(s)
    assert out.scheduled_ids == ["a"]  # b left at once
    assert [o.request_id for o in outputs if o.finished] == ["a"]
    assert not s.has_unfinished_requests()


def test_admission_respects_rows_per_forward():
    s, c = make(max_batch_size=4), Clock()
    for rid, steps in (("a", 2), ("b", 5), ("c", 2)):
        s.add_request(c.request(rid, steps=steps))  # CFG: 2 rows each
    out, _ = iterate(s)
    assert out.scheduled_ids == ["a", "b"] and [r.request_id for r in s.waiting] == ["c"]
    iterate(s)  # a finishes: its rows free up
    out, _ = iterate(s)
    assert sorted(out.scheduled_ids) == ["b", "c"]


def test_shape_groups_take_turns_within_a_bound():
    s, c = make(shape_order="turns"), Clock()
    sizes = [16, 24, 32]
    for i in range(9):
        s.add_request(c.request(f"r{i}", steps=5 + i, size=sizes[i % 3]))
    last_step: dict[str, int] = {}
    while s.has_unfinished_requests():
        out, _ = iterate(s)
        shapes = {s.requests[rid].shape_key for rid in out.scheduled_ids if rid in s.requests} | {
            None for rid in out.scheduled_ids if rid not in s.requests}
        assert len(shapes - {None}) <= 1, "one latent shape per forward"
        for rid in out.scheduled_ids:
            if rid in last_step:
                assert out.iteration - last_step[rid] <= len(sizes), f"{rid} starved"
            last_step[rid] = out.iteration
        for rid, req in s.requests.items():
            if req.status == RequestStatus.RUNNING and rid in last_step:
                assert out.iteration - last_step[rid] < len(sizes)
    assert len(last_step) == 9


def test_shapes_run_oldest_first_and_later_requests_of_the_running_shape_join_it():
    s, c = make(), Clock()  # shape_order="auto": oldest
    s.add_request(c.request("a16", steps=3, size=16))
    s.add_request(c.request("b32", steps=2, size=32))
    iterate(s)
    s.add_request(c.request("c16", steps=3, size=16))  # a16's shape, after b32: joins a16's group
    forwards = []
    while s.has_unfinished_requests():
        out, _ = iterate(s)
        forwards.append(sorted(out.scheduled_ids))
    # a16's group steps until a16 is done (c16 with it), then b32 (older than c16), then c16's last step
    assert forwards == [["a16", "c16"], ["a16", "c16"], ["b32"], ["b32"], ["c16"]]


def test_auto_is_oldest_first_but_in_turn_under_the_elastic_group_policy():
    assert make().oldest_first and make(shape_order="oldest").oldest_first
    assert not make(shape_order="auto", group_policy="elastic", sequence_parallel_size=2).oldest_first
    assert not make(shape_order="turns").oldest_first


def test_the_oldest_shape_goes_first_by_urgency_under_the_priority_policy():
    s, c = make(scheduling_policy="priority"), Clock()
    s.add_request(c.request("low", steps=2, size=16, priority=5))
    s.add_request(c.request("urgent", steps=2, size=32, priority=-1))
    forwards = [iterate(s)[0].scheduled_ids for _ in range(4)]
    assert forwards == [["urgent"], ["urgent"], ["low"], ["low"]]


@pytest.mark.parametrize("order", ["turns", "oldest"])
def test_a_stream_of_new_arrivals_does_not_starve_another_shape(order):
    s, c = make(max_batch_size=64, shape_order=order), Clock()
    s.add_request(c.request("lonely", steps=6, size=32))
    ran = []
    for i in range(12):
        s.add_request(c.request(f"new{i}", steps=20, size=16))  # a new 16px request every iteration
        out, _ = iterate(s)
        ran.append("lonely" in out.scheduled_ids)
        if s.requests.get("lonely") is None:
            break
    assert "lonely" not in s.requests, "the 32px request must finish while 16px requests keep arriving"
    if order == "turns":
        assert all(a or b for a, b in zip(ran, ran[1:])), f"the 32px group waited two iterations in a row: {ran}"
    else:  # the oldest: it runs first, alone, to the end
        assert ran == [True] * 6


def test_a_blocked_request_is_not_overtaken_by_its_own_shape():
    s, c = make(max_batch_size=4), Clock()
    s.add_request(c.request("running", steps=4))            # 2 rows of 16px
    s.add_request(c.request("wide", steps=2, n=2))          # 4 rows of 16px: must wait
    s.add_request(c.request("small", steps=2))              # 2 rows of 16px: fits, but must not jump "wide"
    s.add_request(c.request("other", steps=2, size=32))     # another shape: admitted
    out, _ = iterate(s)
    assert sorted(r.request_id for r in out.new_requests) == ["other", "running"]
    assert [r.request_id for r in s.waiting] == ["wide", "small"]


def test_priority_policy_orders_admission():
    for policy, expected in (("priority", ["urgent", "first"]), ("fcfs", ["first", "second"])):
        s, c = make(max_batch_size=4, scheduling_policy=policy), Clock()
        s.add_request(c.request("first", steps=2, priority=5))
        s.add_request(c.request("second", steps=2, priority=5))
        s.add_request(c.request("urgent", steps=2, priority=-1))
        out, _ = iterate(s)
        assert [r.request_id for r in out.new_requests] == expected


def test_the_scheduler_leaves_checks_to_admission():
    """The input processor checks fits and the engine's coordinator bounds the queue (each fact one owner):
    the scheduler queues what it is given."""
    s, c = make(max_num_waiting=1), Clock()
    s.add_request(c.request("a", steps=1))
    s.add_request(c.request("b", steps=1))
    assert [r.request_id for r in s.waiting] == ["a", "b"]
    with pytest.raises(ValueError, match="already in use"):
        s.add_request(c.request("a", steps=1))


def test_duplicate_request_id_is_refused():
    s, c = make(), Clock()
    s.add_request(c.request("a", steps=1))
    with pytest.raises(ValueError, match="already in use"):
        s.add_request(c.request("a", steps=1))


def test_abort_waiting_and_running():
    s, c = make(max_batch_size=2), Clock()
    s.add_request(c.request("run", steps=5))
    s.add_request(c.request("wait", steps=5))
    iterate(s)
    aborted = [s.abort_request("run"), s.abort_request("wait")]  # their final outputs, at once
    assert s.abort_request("nobody") is None
    assert {o.request_id: o.error for o in aborted} == {"run": "request aborted", "wait": "request aborted"}
    assert all(o.finished for o in aborted)
    assert s.has_unfinished_requests()  # the worker must still free the running one's state
    out, outputs = iterate(s)
    assert out.freed_ids == ["run"] and out.scheduled_ids == [] and outputs == []
    assert not s.has_unfinished_requests()


def test_worker_errors_finish_only_that_request():
    s, c = make(), Clock()
    s.add_request(c.request("good", steps=3))
    s.add_request(c.request("bad", steps=3))
    out = s.schedule()
    outputs = s.update_from_output(out, RunnerOutput(errors={"bad": "denoise failed: boom"}))
    by_id = {o.request_id: o for o in outputs}
    assert by_id["bad"].finished and by_id["bad"].error == "denoise failed: boom"
    assert not by_id["good"].finished and by_id["good"].num_steps_done == 1
    assert list(s.requests) == ["good"]


# -- the state pool: admission by blocks, the prompt cache, preemption ----------------------------

def run_all(s: Scheduler, limit: int = 1000) -> list:
    outs = []
    for _ in range(limit):
        if not s.has_unfinished_requests():
            return outs
        out, outputs = iterate(s)
        outs.append((out, outputs))
    raise AssertionError("requests did not finish")


def test_admission_waits_for_blocks_and_frees_them():
    s, c = make(num_blocks=12), Clock()
    # each: 2 images x 2 latent blocks x (latents + history) = 8 private, + 2 cond blocks (CFG, distinct prompts)
    for rid in ("a", "b"):
        s.add_request(c.request(rid, steps=3, n=2, latent_blocks=2, cond_blocks=1, history=True))
    out, _ = iterate(s)
    assert [r.request_id for r in out.new_requests] == ["a"]
    assert s.stats()["pool_used_blocks"] == 10
    tables = out.new_requests[0].blocks
    assert len(tables.latents) == 2 and all(len(b) == 2 for b in tables.latents) and len(tables.history) == 2
    used = [b for rows in tables.latents + tables.history for b in rows] + tables.cond + tables.uncond
    assert len(set(used)) == 10  # no block is handed out twice
    run_all(s)
    stats = s.stats()
    # both prompts' conditions stay cached, and the empty negative prompt they shared
    assert stats["pool_used_blocks"] == 0 and stats["pool_cached_blocks"] == 3


def test_request_larger_than_the_pool_is_refused():
    c = Clock()
    with pytest.raises(ValueError, match="needs 12 state-pool blocks but the pool has 10"):
        check_fits(c.request("huge", steps=2, n=2, latent_blocks=5), max_batch_size=16, num_blocks=10)
    with pytest.raises(ValueError, match=r"n=3 needs 6 denoiser rows \(doubled by CFG\) but max_batch_size is 4"):
        check_fits(c.request("wide", steps=2, n=3), max_batch_size=4, num_blocks=1000)
    check_fits(c.request("narrow", steps=2, n=3, cfg=False), max_batch_size=4, num_blocks=1000)  # 3 rows fit


def test_identical_prompts_share_one_cached_entry():
    s, c = make(num_blocks=100), Clock()
    for rid in ("a", "b", "c"):
        s.add_request(c.request(rid, steps=2, prompt="the same prompt", cond_blocks=3))
    out, _ = iterate(s)
    a, b, c_ = (d.blocks for d in out.new_requests)
    assert a.cond == b.cond == c_.cond and a.uncond == b.uncond == c_.uncond
    assert (a.write_cond, b.write_cond, c_.write_cond) == (True, False, False)  # encoded once
    assert s.stats()["prompt_cache_queries"] == 6 and s.stats()["prompt_cache_hits"] == 4
    run_all(s)
    s.add_request(c.request("later", steps=1, prompt="the same prompt", cond_blocks=3))
    out, _ = iterate(s)
    assert out.new_requests[0].blocks.write_cond is False and out.new_requests[0].blocks.cond == a.cond
    assert s.stats()["prompt_cache_hits"] == 6


def test_cached_conditions_are_evicted_least_recently_used_first():
    s, c = make(num_blocks=8), Clock()
    for i, prompt in enumerate(["old", "newer"]):
        s.add_request(c.request(f"r{i}", steps=1, cfg=False, prompt=prompt, cond_blocks=3))
        run_all(s)
    assert s.stats()["pool_cached_blocks"] == 6
    s.add_request(c.request("big", steps=1, cfg=False, prompt="third", n=1, latent_blocks=2, cond_blocks=3))
    run_all(s)  # needs 5 blocks: 2 free + the 3 of "old"
    assert not s.blocks.is_cached(prompt_cache_key("prompt", "old"))
    assert s.blocks.is_cached(prompt_cache_key("prompt", "newer"))


def test_without_the_cache_nothing_is_shared_or_kept():
    s, c = make(num_blocks=100, cache=False), Clock()
    for rid in ("a", "b"):
        s.add_request(c.request(rid, steps=1, prompt="same"))
    out, _ = iterate(s)
    assert out.new_requests[0].blocks.cond != out.new_requests[1].blocks.cond
    run_all(s)
    assert s.stats()["pool_used_blocks"] == 0 and s.stats()["pool_cached_blocks"] == 0


def test_a_failed_write_is_never_served_from_the_cache():
    s, c = make(num_blocks=100), Clock()
    s.add_request(c.request("writer", steps=2, prompt="p"))
    out = s.schedule()
    s.update_from_output(out, RunnerOutput(errors={"writer": "prompt encoding failed: boom"}))
    assert s.stats()["pool_used_blocks"] == 0 and s.stats()["pool_cached_blocks"] == 0
    s.add_request(c.request("again", steps=1, prompt="p"))
    out, _ = iterate(s)
    assert out.new_requests[0].blocks.write_cond  # a miss: encoded afresh


def test_urgent_request_preempts_the_least_urgent_and_it_resumes():
    s, c = make(num_blocks=100, max_batch_size=4, scheduling_policy="priority"), Clock()
    s.add_request(c.request("low", steps=5, priority=5))
    s.add_request(c.request("mid", steps=5, priority=3))
    iterate(s)
    iterate(s)
    s.add_request(c.request("urgent", steps=2, priority=0))
    out, _ = iterate(s)
    assert out.preempted_ids == ["low"] and [r.request_id for r in out.new_requests] == ["urgent"]
    assert sorted(out.scheduled_ids) == ["mid", "urgent"]
    low = s.requests["low"]
    assert low.swapped and low.num_steps_done == 2 and low.blocks is None
    while "low" not in [r.request_id for r in out.resumed_requests]:
        out, _ = iterate(s)
    assert out.resumed_requests[0].blocks.write_cond is False  # its prompt stayed cached
    outs = run_all(s)
    done = {o.request_id: o for _, outputs in outs for o in outputs if o.finished}
    assert done["low"].num_steps_done == 5 and done["low"].error is None
    assert s.stats()["num_preemptions"] == 1 and s.stats()["pool_used_blocks"] == 0


def test_preemption_frees_blocks_across_shapes_but_only_for_more_urgent_requests():
    s, c = make(num_blocks=6, scheduling_policy="priority"), Clock()
    s.add_request(c.request("big", steps=4, size=32, latent_blocks=4, priority=1))  # 4 + 2 cond = all 6
    iterate(s)
    s.add_request(c.request("same", steps=2, size=16, latent_blocks=2, priority=1))  # equal priority: waits
    out, _ = iterate(s)
    assert out.preempted_ids == [] and s.requests["same"].status == RequestStatus.WAITING
    s.add_request(c.request("urgent", steps=2, size=16, latent_blocks=2, priority=0))
    out, _ = iterate(s)
    assert out.preempted_ids == ["big"] and [r.request_id for r in out.new_requests] == ["urgent"]
    run_all(s)
    assert not s.requests


def test_fcfs_never_preempts():
    s, c = make(num_blocks=100, max_batch_size=2), Clock()
    s.add_request(c.request("first", steps=3, priority=9))
    iterate(s)
    s.add_request(c.request("second", steps=1, priority=0))
    out, _ = iterate(s)
    assert out.preempted_ids == [] and out.scheduled_ids == ["first"]


def low_priority_finish(aging: int) -> int | None:
    s, c = make(num_blocks=1000, max_batch_size=2, scheduling_policy="priority", priority_aging_iterations=aging), Clock()
    s.add_request(c.request("low", steps=2, priority=4))
    for i in range(60):  # a new urgent request every iteration: twice what the one slot serves
        s.add_request(c.request(f"hi{i}", steps=2, priority=0))
        out, outputs = iterate(s)
        if any(o.request_id == "low" and o.finished for o in outputs):
            return out.iteration
    return None


def test_aging_keeps_low_priorities_from_starving():
    assert low_priority_finish(aging=10**6) is None  # without aging it starves
    finished_at = low_priority_finish(aging=3)
    assert finished_at is not None, "the low-priority request starved"
    # Only urgent requests that arrived within priority x aging = 12 iterations after it can
    # overtake it: at most 12 of them, 2 iterations each, then its own 2 steps.
    assert finished_at <= 12 * 2 + 2 + 1


def test_iterations_that_only_wait_age_no_one():
    """Aging counts steps run, not iterations: with encode workers the loop waits for the stage 50 times a second,
    and a low-priority request that waited out an encode process's start used to age past every later urgent one
    (no preemption ever happened behind it)."""
    s, c = make(max_batch_size=2, scheduling_policy="priority", priority_aging_iterations=10, encode_workers=1), \
        Clock()
    s.add_request(c.request("low", steps=6, priority=1))
    for _ in range(30):  # its texts are with the encode stage: nothing runs
        assert not s.schedule().scheduled_ids
    s.ahead.mark_ready(list(s.ahead.keys))
    out, _ = iterate(s)
    assert out.scheduled_ids == ["low"]
    s.add_request(c.request("urgent", steps=2, priority=0))
    out, _ = iterate(s)  # low steps on; the urgent request's texts go to the stage
    assert out.scheduled_ids == ["low"] and out.encode_jobs
    s.ahead.mark_ready(list(s.ahead.keys))
    out, _ = iterate(s)
    assert out.preempted_ids == ["low"] and out.scheduled_ids == ["urgent"]


def test_prompt_cache_keys_are_small_digests_of_role_and_text():
    c = Clock()
    long_text = "x" * 100_000
    a = c.request("a", steps=1, prompt=long_text)
    b = c.request("b", steps=1, prompt=long_text)
    positive, negative = a.cond_keys
    assert positive == b.cond_keys[0] and len(positive) == 16  # the cache keeps 16 bytes, not the text
    assert negative != positive  # the negative role never shares the positive text's entry
    assert prompt_cache_key("prompt", "x") != prompt_cache_key("prompt", "y")


def test_one_iteration_admits_a_bounded_number_of_prompt_characters():
    s, c = make(max_prompt_chars=100, max_prompt_chars_per_step=150), Clock()
    for i in range(2):
        s.add_request(c.request(f"long{i}", steps=4, cfg=False, prompt=str(i) * 100))
    s.add_request(c.request("cached", steps=4, cfg=False, prompt="1" * 100))  # long1's text: no new encode
    s.add_request(c.request("long2", steps=4, cfg=False, prompt="2" * 100))
    out, _ = iterate(s)
    assert [r.request_id for r in out.new_requests] == ["long0"]  # 100 chars; a second would make 200
    out, _ = iterate(s)
    assert [r.request_id for r in out.new_requests] == ["long1", "cached"]  # cached costs nothing
    out, _ = iterate(s)
    assert [r.request_id for r in out.new_requests] == ["long2"]


def test_a_prompt_over_the_step_budget_is_still_admitted_alone():
    s, c = make(max_prompt_chars=100, max_prompt_chars_per_step=10), Clock()
    s.add_request(c.request("a", steps=1, cfg=False, prompt="a" * 100))
    s.add_request(c.request("b", steps=1, cfg=False, prompt="b" * 100))
    assert [r.request_id for r in iterate(s)[0].new_requests] == ["a"]
    assert [r.request_id for r in iterate(s)[0].new_requests] == ["b"]


def test_the_scheduler_says_which_step_each_request_takes_and_which_finish():
    s, c = make(), Clock()
    s.add_request(c.request("a", steps=2))
    s.add_request(c.request("b", steps=1))
    out = s.schedule()
    assert (out.scheduled_ids, out.step_indices, out.finishing_ids) == (["a", "b"], [0, 0], ["b"])
    # a worker that returns no image for a finishing request fails it instead of leaving it running
    outputs = s.update_from_output(out, RunnerOutput())
    by_id = {o.request_id: o for o in outputs}
    assert by_id["b"].finished and by_id["b"].error == "the worker returned no images for the request's last step"
    out = s.schedule()
    assert (out.scheduled_ids, out.step_indices, out.finishing_ids) == (["a"], [1], ["a"])


def test_one_iteration_encodes_a_bounded_number_of_input_images():
    """Input images are encoded on the step loop at admission: at most max_input_images_per_step a step (one
    request always), in arrival order; requests without images are not held back by the budget."""
    from PIL import Image

    s, c = make(max_input_images_per_step=2), Clock()
    image = Image.new("RGB", (8, 8))
    for rid, images in (("one", image), ("two", (image, image)), ("three", (image,) * 3)):
        request = c.request(rid, steps=4, cfg=False, prompt="x")
        request.params.image = images
        s.add_request(request)
    out, _ = iterate(s)
    assert [r.request_id for r in out.new_requests] == ["one"]  # a second would make 3 images
    out, _ = iterate(s)
    assert [r.request_id for r in out.new_requests] == ["two"]
    out, _ = iterate(s)
    assert [r.request_id for r in out.new_requests] == ["three"]  # over the budget alone: still admitted
    with pytest.raises(ValueError, match="max_input_images_per_step"):
        SchedulerConfig.of(EngineConfig(max_input_images_per_step=0))


def test_scheduling_ahead_counts_steps_in_flight_and_frees_the_rows_of_a_last_step():
    """Async scheduling: the scheduler plans while earlier steps are in flight (their updates not yet applied). A
    step in flight counts as taken; a request whose last step is in flight is not scheduled again, and its rows go
    to a waiting request at once (its blocks stay until the update)."""
    s, c = make(max_batch_size=1), Clock()
    s.add_request(c.request("a", steps=2, cfg=False))
    s.add_request(c.request("b", steps=2, cfg=False))
    first = s.schedule()
    second = s.schedule()  # first in flight
    assert (first.scheduled_ids, first.step_indices) == (["a"], [0])
    assert (second.scheduled_ids, second.step_indices, second.finishing_ids) == (["a"], [1], ["a"])
    third = s.schedule()  # a's last step in flight: b takes its row
    assert [d.request_id for d in third.new_requests] == ["b"] and third.scheduled_ids == ["b"]
    assert s.requests["a"].blocks is not None  # a's state is kept until its last step is done
    s.update_from_output(first, RunnerOutput())
    _, = [o for o in s.update_from_output(second, RunnerOutput(images={"a": ["img"]})) if o.finished]
    assert "a" not in s.requests and s.requests["b"].steps_scheduled == 1
    s.update_from_output(third, RunnerOutput())
    assert s.requests["b"].num_steps_done == 1 and s.requests["b"].steps_in_flight == 0


def test_the_scheduler_imports_no_torch():
    """dvllm.core is bookkeeping: importing all of it (a core process's scheduler, a test of it) must not pull
    torch or diffusers in (core/lora_slots.py once did, through LoRA weights: 4 s an import under load)."""
    import subprocess
    import sys

    code = ("import pkgutil, importlib, sys, dvllm.core\n"
            "for m in pkgutil.iter_modules(dvllm.core.__path__): importlib.import_module('dvllm.core.' + m.name)\n"
            "print(sorted(n for n in ('torch', 'diffusers', 'transformers', 'peft') if n in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]"
