"""DiffusionEngine end to end on a tiny model: the low-level loop, bad input, faults."""
from __future__ import annotations

import numpy as np
import pytest

from dvllm import DiffusionEngine, QueueFullError, SamplingParams


def P(**kwargs) -> SamplingParams:
    base = dict(num_inference_steps=4, guidance_scale=5.0, height=16, width=16, output_type="np")
    return SamplingParams(**{**base, **kwargs})


@pytest.fixture
def engine(sd_eps_path) -> DiffusionEngine:
    return DiffusionEngine(model=sd_eps_path, device="cpu", dtype="float32", max_inference_steps=50,
                           max_image_pixels=64 * 64, max_images_per_prompt=4)


def worker_states(engine: DiffusionEngine) -> dict:
    return engine.executor.worker.runner.states


@pytest.mark.parametrize("params, field", [
    (P(num_inference_steps=0), "num_inference_steps"),
    (P(num_inference_steps=51), "num_inference_steps"),
    (P(height=20), "height"),
    (P(width=0), "width"),
    (P(height=128, width=128), "height\\*width"),
    (P(guidance_scale=-1.0), "guidance_scale"),
    (P(guidance_scale=float("nan")), "guidance_scale"),
    (P(n=0), "n must"),
    (P(n=5), "n must"),
    (P(sampler="nope"), "sampler"),
    (P(seed=-1), "seed"),
    (P(seed=2**63), "seed"),
    (P(output_type="jpeg"), "output_type"),
    (P(priority="high"), "priority"),
])
def test_bad_sampling_params_name_the_field(engine, params, field):
    with pytest.raises(ValueError, match=field):
        engine.add_request("r", "a prompt", params)
    assert not engine.has_unfinished_requests()


def test_bad_generate_input_queues_nothing(engine):
    with pytest.raises(ValueError, match="2 SamplingParams for 3 prompts"):
        engine.generate(["a", "b", "c"], [P(), P()], use_tqdm=False)
    with pytest.raises(ValueError, match="prompt must be a string"):
        engine.generate(["fine", 42], P(), use_tqdm=False)
    with pytest.raises(ValueError, match="num_inference_steps"):
        engine.generate(["fine", "bad"], [P(), P(num_inference_steps=0)], use_tqdm=False)
    assert not engine.has_unfinished_requests()


def test_request_that_cannot_fit_a_forward_is_refused_up_front(sd_eps_path):
    engine = DiffusionEngine(model=sd_eps_path, device="cpu", dtype="float32", max_batch_size=4)
    with pytest.raises(ValueError, match="n=3 needs 6 denoiser rows .doubled by CFG. but max_batch_size is 4"):
        engine.generate(["fits", "too wide"], [P(), P(n=3)], use_tqdm=False)
    assert not engine.has_unfinished_requests()
    out = engine.generate("without CFG it fits", P(n=3, guidance_scale=1.0), use_tqdm=False)[0]
    assert out.error is None and len(out.images) == 3


def test_low_level_loop_reports_progress(engine):
    engine.add_request("a", "a red circle", P(num_inference_steps=3, seed=1))
    engine.add_request("b", "a blue square", P(num_inference_steps=2, seed=2))
    engine.add_request("c", "a green star", P(num_inference_steps=4, seed=3, output_kind="final"))
    seen: dict[str, list[int]] = {"a": [], "b": [], "c": []}
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen[out.request_id].append(out.num_steps_done)
            if out.finished:
                finals[out.request_id] = out
    assert seen == {"a": [1, 2, 3], "b": [1, 2], "c": [4]}  # "final": no output before the end
    for out in finals.values():
        assert out.error is None and len(out.images) == 1 and out.images[0].shape == (16, 16, 3)
        m = out.metrics
        assert m.queue_time >= 0 and m.latency >= m.queue_time
    assert worker_states(engine) == {}


def test_unset_seed_is_reported_and_reproduces(engine):
    first = engine.generate("seedless", P(), use_tqdm=False)[0]
    again = engine.generate("seedless", P(seed=first.seed), use_tqdm=False)[0]
    np.testing.assert_allclose(first.images[0], again.images[0], atol=1e-6)


def test_abort_frees_state_and_others_finish(engine):
    engine.add_request("keep", "keep me", P(num_inference_steps=5, seed=1))
    engine.add_request("drop", "drop me", P(num_inference_steps=5, seed=2))
    engine.step()
    engine.step()
    assert set(worker_states(engine)) == {"keep", "drop"}
    assert engine.abort_request("drop")
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
        assert "drop" not in worker_states(engine)
    final = {o.request_id: o for o in outs if o.finished}
    assert final["drop"].error == "request aborted" and final["drop"].images == []
    assert final["keep"].error is None and len(final["keep"].images) == 1


def _expected(sd_eps_path, prompts, params):
    clean = DiffusionEngine(model=sd_eps_path, device="cpu", dtype="float32")
    return clean.generate(prompts, params, use_tqdm=False)


@pytest.mark.slow
def test_failure_in_prompt_encoding_fails_only_that_request(engine, sd_eps_path):
    adapter = engine.executor.worker.runner.adapter
    real = adapter.encode_prompt

    def encode(texts):
        if any(text == "boom" for text, _ in texts):
            raise RuntimeError("tokenizer exploded")
        return real(texts)

    adapter.encode_prompt = encode
    prompts, params = ["fine one", "boom", "fine two"], [P(seed=1), P(seed=2), P(seed=3)]
    outs = engine.generate(prompts, params, use_tqdm=False)
    assert outs[1].error == "prompt encoding failed: RuntimeError: tokenizer exploded" and outs[1].images == []
    expected = _expected(sd_eps_path, prompts, params)
    for i in (0, 2):
        assert outs[i].error is None
        np.testing.assert_allclose(outs[i].images[0], expected[i].images[0], atol=1e-3)
    assert worker_states(engine) == {}


@pytest.mark.slow
def test_failure_in_the_forward_fails_only_that_request(engine, sd_eps_path):
    adapter = engine.executor.worker.runner.adapter
    real = adapter.denoise

    def denoise(latents, timesteps, conditions, guidance, layout):
        if bool((guidance == 13.0).any()):
            raise RuntimeError("CUDA error: an illegal memory access")
        return real(latents, timesteps, conditions, guidance, layout)

    adapter.denoise = denoise
    prompts = ["one", "poison", "two"]
    params = [P(seed=1, num_inference_steps=3), P(seed=2, guidance_scale=13.0), P(seed=3, num_inference_steps=5)]
    outs = engine.generate(prompts, params, use_tqdm=False)
    assert outs[1].error.startswith("denoise failed: RuntimeError: CUDA error")
    expected = _expected(sd_eps_path, prompts, params)
    for i in (0, 2):
        assert outs[i].error is None
        np.testing.assert_allclose(outs[i].images[0], expected[i].images[0], atol=1e-3)
    assert worker_states(engine) == {}


def test_failure_in_decode_fails_only_that_request(engine):
    adapter = engine.executor.worker.runner.adapter
    real = adapter.decode
    calls = []

    def decode(latents, image_size):
        calls.append(len(latents))
        if len(latents) == 2:  # the n=2 request's call fails, failing the batch; each is then decoded alone
            raise RuntimeError("out of memory")
        return real(latents, image_size)

    adapter.decode = decode
    outs = engine.generate(["a", "b"], [P(seed=1, num_inference_steps=3), P(seed=2, num_inference_steps=3, n=2)],
                           use_tqdm=False)
    assert calls == [1, 2, 1, 2]
    assert outs[0].error is None and len(outs[0].images) == 1
    assert outs[1].error == "decode failed: RuntimeError: out of memory"


@pytest.mark.slow
def test_generate_feeds_a_bounded_queue_and_keeps_others_outputs(sd_eps_path):
    engine = DiffusionEngine(model=sd_eps_path, device="cpu", dtype="float32", max_num_waiting=2, max_batch_size=4)
    engine.add_request("mine", "added by hand", P(num_inference_steps=2, seed=1))
    engine.add_request("mine-too", "added by hand", P(num_inference_steps=2, seed=2))
    with pytest.raises(QueueFullError):
        engine.add_request("third", "no room", P())
    outs = engine.generate([f"prompt {i}" for i in range(7)], P(num_inference_steps=2), use_tqdm=False)
    assert [o.prompt for o in outs] == [f"prompt {i}" for i in range(7)] and all(o.error is None for o in outs)
    later = {o.request_id for o in engine.step() if o.finished}
    assert later == {"mine", "mine-too"}  # finished during generate(), handed over afterwards
    assert not engine.has_unfinished_requests()


def test_new_prompts_encode_in_one_call_and_each_finisher_decodes_apart(engine):
    adapter = engine.executor.worker.runner.adapter
    encode_calls, decode_calls, forward_rows = [], [], []
    real_encode, real_decode, real_denoise = adapter.encode_prompt, adapter.decode, adapter.denoise
    adapter.encode_prompt = lambda texts: encode_calls.append(list(texts)) or real_encode(texts)
    adapter.decode = lambda latents, size: decode_calls.append(len(latents)) or real_decode(latents, size)
    adapter.denoise = lambda x, *a: forward_rows.append(len(x)) or real_denoise(x, *a)
    params = [P(seed=1, num_inference_steps=3), P(seed=2, num_inference_steps=3, guidance_scale=1.0),
              P(seed=3, num_inference_steps=3, negative_prompt="ugly"), P(seed=4, num_inference_steps=3)]
    outs = engine.generate(["red", "blue", "red", "green"], params, use_tqdm=False)
    assert all(o.error is None for o in outs)
    # one text-encoder call; identical texts ("red", and the shared empty negative) encoded once
    assert len(encode_calls) == 1
    assert set(encode_calls[0]) == {("red", False), ("blue", False), ("green", False), (None, True), ("ugly", True)}
    assert len(encode_calls[0]) == 5
    assert decode_calls == [1, 1, 1, 1]  # an image must not depend on what was decoded beside it
    assert forward_rows == [7, 7, 7]  # 4 conditional rows + 3 unconditional (guidance 1.0 has none)


@pytest.mark.slow
def test_a_batched_step_that_fails_after_drawing_noise_is_retried_from_the_same_noise(engine, sd_eps_path,
                                                                                     monkeypatch):
    """euler_a draws each request's noise from its generator before the fused update; the update then
    fails once for the whole batch. The per-request retry must draw that noise again, not the next."""
    from dvllm.worker import denoise_batch

    real, calls = denoise_batch.ops.scatter_update, []

    def fails_once(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:  # the second step of the batch, after its noise was drawn
            raise RuntimeError("transient device error")
        return real(*args, **kwargs)

    monkeypatch.setattr(denoise_batch.ops, "scatter_update", fails_once)
    prompts = ["one", "two", "three"]
    params = [P(seed=s, sampler="euler_a", num_inference_steps=4) for s in (1, 2, 3)]
    outs = engine.generate(prompts, params, use_tqdm=False)
    assert len(calls) > 4  # the failed batch was retried request by request
    monkeypatch.undo()
    expected = _expected(sd_eps_path, prompts, params)
    for out, want in zip(outs, expected):
        assert out.error is None, out.error
        np.testing.assert_allclose(out.images[0], want.images[0], atol=1e-3)


@pytest.mark.slow
def test_a_request_sharing_an_entry_whose_refill_failed_fails_instead_of_reading_garbage(sd_eps_path, monkeypatch):
    """A is preempted and its prompt's cache entry evicted; when A resumes it is to refill a new entry,
    and B, admitted in the same step with the same prompt, shares it. A's swap-in fails: B must not
    denoise from the unwritten blocks (it fails, or its image is exact)."""
    engine = DiffusionEngine(model=sd_eps_path, device="cpu", dtype="float32", scheduling_policy="priority",
                             max_batch_size=2)
    scheduler, runner = engine.scheduler, engine.executor.worker.runner
    shared = P(seed=4, guidance_scale=1.0, num_inference_steps=30, priority=5)
    engine.add_request("A", "a shared prompt", shared)
    engine.step()
    engine.add_request("U", "urgent", P(seed=5, guidance_scale=1.0, num_inference_steps=1, n=2, priority=-5))
    while "U" in scheduler.requests and "U" not in scheduler.decoding:  # U preempts A (both rows), runs its step
        engine.step()
    a = scheduler.requests["A"]
    assert a.swapped
    scheduler.blocks.invalidate(scheduler.blocks.index[a.cond_keys[0]])  # evicted while A was out
    engine.add_request("B", "a shared prompt", P(seed=6, guidance_scale=1.0, num_inference_steps=3, priority=5))
    real_swap_in = runner._swap_in

    def swap_in(work, group):
        if group[0].request_id == "A":
            raise RuntimeError("host copy lost")
        return real_swap_in(work, group)

    monkeypatch.setattr(runner, "_swap_in", swap_in)
    outs = {}
    while engine.has_unfinished_requests():
        outs.update({o.request_id: o for o in engine.step() if o.finished})
    assert outs["A"].error == "swap-in failed: RuntimeError: host copy lost"
    b = outs["B"]
    if b.error is None:  # re-encoded: then exactly the image B gets alone
        expected = _expected(sd_eps_path, ["a shared prompt"], [P(seed=6, guidance_scale=1.0, num_inference_steps=3)])
        np.testing.assert_allclose(b.images[0], expected[0].images[0], atol=1e-3)
    else:
        assert b.error.startswith("its prompt embedding could not be written: swap-in failed")
    assert worker_states(engine) == {}
    # the entry was invalidated with A: a later request with the prompt encodes it afresh, and is exact
    after = engine.generate("a shared prompt", P(seed=6, guidance_scale=1.0, num_inference_steps=3), use_tqdm=False)
    expected = _expected(sd_eps_path, ["a shared prompt"], [P(seed=6, guidance_scale=1.0, num_inference_steps=3)])
    np.testing.assert_allclose(after[0].images[0], expected[0].images[0], atol=1e-3)


def test_engines_of_one_model_in_a_process_probe_its_samplers_once(sd_eps_path, sd_v_path, monkeypatch):
    """The start-up probe (0.4-1.4 s) is remembered per process for the schedule it probed: a second engine of
    the model asks no scheduler again and gets the same answer; another schedule is probed, and the memo is
    bounded (with room for one, the first model is probed again after the second)."""
    from dvllm.engine import input_processor

    monkeypatch.setattr(input_processor, "_PROBED", input_processor._ProbeMemo(size=1))
    tried = []
    real_runs = input_processor.InputProcessor._runs
    monkeypatch.setattr(input_processor.InputProcessor, "_runs",
                        lambda self, *args: tried.append(args[0]) or real_runs(self, *args))

    def probes_at_start(path: str) -> tuple[int, list[str]]:
        before = len(tried)
        engine = DiffusionEngine(model=path, device="cpu", dtype="float32")
        return len(tried) - before, engine.valid_samplers()

    first, valid = probes_at_start(sd_eps_path)
    assert first > 40 and "ddim" in valid
    assert probes_at_start(sd_eps_path) == (0, valid)
    other, _ = probes_at_start(sd_v_path)  # v-prediction: another scheduler config
    assert other == first
    assert probes_at_start(sd_eps_path) == (first, valid)


def test_valid_samplers_are_probed_from_start_up_not_on_the_first_refusal(engine, monkeypatch):
    """Probing every diffusers scheduler took the first request with a bad sampler 1.4 s (2.2 s loaded)."""
    processor = engine.processor
    tried = []
    real_runs = processor._runs
    monkeypatch.setattr(processor, "_runs", lambda *args: tried.append(args[0]) or real_runs(*args))
    with pytest.raises(ValueError, match="valid samplers: .*'ddim'"):
        engine.add_request("bad", "x", SamplingParams(sampler="no-such-sampler"))
    assert tried == []  # nothing probed while this request waited
