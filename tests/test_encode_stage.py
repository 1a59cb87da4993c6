"""The encode stage: texts of requests that arrive while a batch runs are encoded on a thread of the worker's and
never in the denoise loop; the loop keeps stepping meanwhile; the images are the in-loop path's; a failed encode
fails its requests only, a dead thread loses nothing, an abort while encoding ends the request once, and text
adapters (encoded in the loop) run beside the stage's encodes without leaking into them."""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from dvllm import DiffusionEngine, SamplingParams
from dvllm.core.block_manager import BlockManager
from dvllm.core.encode_ahead import EncodeAhead
from dvllm.core.request import Request
from dvllm.worker.encode_stage import EncodeStage
from dvllm.worker.forward_context import DENOISER, TEXT_ENCODERS

STAGE = "dvllm-encode"
# How long a test thread waits on an event before the test fails (never reached when things work)
WAIT = 60


def P(**kwargs) -> SamplingParams:
    base = dict(num_inference_steps=3, guidance_scale=5.0, height=16, width=16, output_type="np")
    return SamplingParams(**{**base, **kwargs})


FIRST = ("a red circle", P(seed=1, num_inference_steps=6))
LATER = [("a blue square", P(seed=2, n=2)), ("a green star", P(seed=3, negative_prompt="blurry")),
         ("a yellow moon", P(seed=4, num_inference_steps=4, output_kind="progress", num_previews=2))]


def _engine(path: str, **kwargs) -> DiffusionEngine:
    kwargs.setdefault("encode_stage", True)
    return DiffusionEngine(model=path, device="cpu", dtype="float32", decode_stage=False, **kwargs)


def _run(engine: DiffusionEngine, first=FIRST, later=LATER, hook=None) -> dict[str, list]:
    """Every output of each request: `first` alone, the `later` ones added once it took a step; `hook(step)` runs
    before each step."""
    engine.add_request("first", *first)
    outputs: dict[str, list] = {}
    step = 0
    while engine.has_unfinished_requests():
        if step == 1:
            for i, (prompt, params) in enumerate(later):
                engine.add_request(str(i), prompt, params)
        if hook is not None:
            hook(step)
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
        step += 1
    return outputs


def _spy(engine: DiffusionEngine, monkeypatch, before=None) -> list[tuple[str, list]]:
    """Records (thread, texts) of every text-encoder call; `before(texts)` runs first (to fail or block one)."""
    adapter, calls = engine.executor.worker.runner.adapter, []
    real = adapter.encode_prompt

    def encode(texts, **kwargs):
        calls.append((threading.current_thread().name, [text for text, _ in texts]))
        if before is not None:
            before(texts)
        return real(texts, **kwargs)

    monkeypatch.setattr(adapter, "encode_prompt", encode)
    return calls


def _stage_done_at(step: int, engine: DiffusionEngine):
    """A hook that, at `step`, waits until the stage has encoded what it was given (the first request still runs,
    so the stage's texts are ready before it ends, however loaded the machine)."""
    def hook(now: int) -> None:
        if now == step:
            _wait_for(lambda: engine.executor.worker.runner.encode_stage.pending == 0)
    return hook


def _wait_for(condition) -> None:
    deadline = time.monotonic() + WAIT
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def _assert_same_images(got: dict[str, list], want: dict[str, list], ids) -> None:
    # Requests the stage admits a step later share forwards with other neighbours: equal up to float rounding
    for request_id in ids:
        final, expected = got[request_id][-1], want[request_id][-1]
        assert final.finished and final.error is None, final.error
        assert len(final.images) == len(expected.images)
        for a, b in zip(final.images, expected.images):
            np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)


@pytest.fixture(scope="module")
def in_loop(sd_eps_path) -> dict[str, list]:
    return _run(_engine(sd_eps_path, encode_stage=False))


@pytest.mark.slow
def test_texts_that_arrive_during_a_batch_are_encoded_off_the_loop_with_the_same_images(sd_eps_path, in_loop,
                                                                                        monkeypatch):
    engine = _engine(sd_eps_path)
    calls = _spy(engine, monkeypatch)
    staged = _run(engine, hook=_stage_done_at(2, engine))
    _assert_same_images(staged, in_loop, ["first", "0", "1", "2"])
    # the first request met an idle engine: admission encoded it at once; nothing later ran a text encoder in the loop
    loop = threading.current_thread().name
    assert [texts for thread, texts in calls if thread == loop] == [["a red circle", None]]
    staged_texts = [text for thread, texts in calls if thread == STAGE for text in texts]
    assert sorted(staged_texts, key=str) == sorted(["a blue square", "a green star", "blurry", "a yellow moon"], key=str)
    # previews still come, and the stage's work is counted where it ran
    assert sum(len(o.previews) for o in staged["2"]) == sum(len(o.previews) for o in in_loop["2"]) == 2
    stats = engine.stats()
    assert stats["num_encoding"] == 0 and stats["num_waiting"] == 0
    assert stats["stage_items"]["encode_stage"] == len(staged_texts)
    assert stats["stage_seconds"]["encode_stage"] > 0


@pytest.mark.slow
def test_the_loop_keeps_stepping_while_the_stage_encodes(sd_eps_path, in_loop, monkeypatch):
    engine = _engine(sd_eps_path)
    entered, release = threading.Event(), threading.Event()

    def block(texts):
        if threading.current_thread().name == STAGE:
            entered.set()
            assert release.wait(WAIT)

    _spy(engine, monkeypatch, block)
    seen = []

    def hook(step):
        if step == 2:
            assert entered.wait(WAIT)  # the stage took the later texts and is stuck on them
        if step == 6:  # the first request took its 6 steps meanwhile; the others wait for their texts
            stats = engine.stats()
            seen.append((stats["num_running"], stats["num_waiting"], stats["num_encoding"]))
            release.set()

    outputs = _run(engine, hook=hook)
    assert seen == [(0, 3, 4)]  # the first is done, all of it while the stage held the others' texts
    _assert_same_images(outputs, in_loop, ["first", "0", "1", "2"])


def test_a_failing_encode_fails_its_request_only(sd_eps_path, in_loop, monkeypatch):
    engine = _engine(sd_eps_path)

    def fail_star(texts):
        if "a green star" in [text for text, _ in texts]:
            raise RuntimeError("text encoder out of memory")

    _spy(engine, monkeypatch, fail_star)
    outputs = _run(engine)
    final = outputs["1"][-1]
    assert final.finished and final.images == []
    assert final.error == "prompt encoding failed: RuntimeError: text encoder out of memory"
    _assert_same_images(outputs, in_loop, ["first", "0", "2"])
    assert engine.stats()["num_encoding"] == 0  # its negative prompt, encoded fine, is dropped


class _ThreadKilled(BaseException):
    """Ends the encode thread as an uncaught error in it would."""


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the thread's death, on purpose
def test_an_encode_thread_that_dies_loses_no_request(sd_eps_path, in_loop, monkeypatch):
    engine = _engine(sd_eps_path)
    killed = threading.Event()

    def die_once(texts):
        if threading.current_thread().name == STAGE and not killed.is_set():
            killed.set()
            raise _ThreadKilled

    def hook(step):
        if step == 2:
            assert killed.wait(WAIT)  # the next step's collect finds the thread dead and starts another
        _stage_done_at(4, engine)(step)

    _spy(engine, monkeypatch, die_once)
    outputs = _run(engine, hook=hook)
    assert killed.is_set() and engine.executor.worker.runner.encode_stage.restarts == 1
    _assert_same_images(outputs, in_loop, ["first", "0", "1", "2"])
    from dvllm.entrypoints.metrics import ServerMetrics

    assert engine.stats()["stage_restarts"] == {"encode_stage.thread": 1, "encode_stage.process": 0,
                                                "decode_stage.thread": 0, "decode_stage.process": 0,
                                                "worker_group.members": 0}
    scrape = ServerMetrics(engine.stats, lambda: 0).render().decode()
    assert 'dvllm_stage_restarts_total{part="thread",stage="encode_stage"} 1.0' in scrape


def test_an_abort_while_its_texts_are_encoded_ends_the_request_once(sd_eps_path, in_loop, monkeypatch):
    engine = _engine(sd_eps_path)
    entered, release = threading.Event(), threading.Event()

    def block(texts):
        if threading.current_thread().name == STAGE and not release.is_set():
            entered.set()
            assert release.wait(WAIT)

    _spy(engine, monkeypatch, block)

    def hook(step):
        if step == 2:
            assert entered.wait(WAIT)
            assert engine.abort_request("1")
            release.set()

    outputs = _run(engine, hook=hook)
    assert [(o.error, o.images) for o in outputs["1"] if o.finished] == [("request aborted", [])]
    _assert_same_images(outputs, in_loop, ["first", "0", "2"])
    assert engine.stats()["num_encoding"] == 0


@pytest.mark.slow
def test_text_adapters_encode_in_the_loop_and_do_not_reach_the_stages_encodes(sd_eps_path, tmp_path, monkeypatch):
    """A request with a text LoRA is encoded at admission (with its adapter); the stage's encodes run while the
    loop's forward applies that adapter's plan, and take none of it: the images equal the stage-off engine's."""
    from conftest import tiny_sd_pipeline
    from lora_utils import make_lora

    folder = make_lora(tiny_sd_pipeline(), str(tmp_path / "style"), seed=5, components=("unet", "text_encoder"))
    first = ("a red circle", P(seed=1, num_inference_steps=6, loras={"style": 0.8}))
    engines = {}
    for stage in (False, True):
        engines[stage] = _engine(sd_eps_path, encode_stage=stage, enable_lora=True)
        engines[stage].load_lora("style", folder)
    want = _run(engines[False], first=first)

    # The stage's first encode waits until the loop is inside a forward running the adapter, and the forward
    # waits for that encode to finish: they overlap for sure.
    in_forward, encoded = threading.Event(), threading.Event()
    engine = engines[True]
    runner = engine.executor.worker.runner
    real_denoise = runner.adapter.denoise

    hooks = runner.hooks

    def denoise(*args, **kwargs):
        context = kwargs.get("context")
        if context is not None and context.lora is not None and runner.encode_stage.pending \
                and not encoded.is_set():
            in_forward.set()
            assert encoded.wait(WAIT)
        return real_denoise(*args, **kwargs)

    def after_stage_encode(texts):
        if threading.current_thread().name == STAGE and not encoded.is_set():
            assert in_forward.wait(WAIT)

    calls = _spy(engine, monkeypatch, after_stage_encode)
    real_encode = runner.adapter.encode_prompt

    def encode_then_signal(texts, **kwargs):
        if threading.current_thread().name == STAGE and not encoded.is_set():  # each part has its own context:
            assert in_forward.wait(WAIT)  # the loop's forward runs its adapters now, waiting for this encode
            assert hooks.context_of(DENOISER).lora is not None
            assert hooks.context_of(TEXT_ENCODERS) is None  # and the stage's texts take none
        try:
            return real_encode(texts, **kwargs)
        finally:
            if threading.current_thread().name == STAGE:
                encoded.set()

    monkeypatch.setattr(runner.adapter, "encode_prompt", encode_then_signal)
    monkeypatch.setattr(runner.adapter, "denoise", denoise)
    got = _run(engine, first=first)
    assert in_forward.is_set() and encoded.is_set()
    assert [texts for thread, texts in calls if thread != STAGE] == [["a red circle", None]]
    _assert_same_images(got, want, ["first", "0", "1", "2"])


# -- the parts alone ---------------------------------------------------------------------------------------------
def test_encode_ahead_sends_uncached_texts_once_within_capacity_and_drops_what_no_one_needs():
    from dvllm.config import EngineConfig

    ahead, blocks = EncodeAhead(capacity=3), BlockManager(64)
    config = EngineConfig(model="tiny-shapes")

    def request(request_id: str, prompt: str, negative: str | None = None) -> Request:
        params = SamplingParams(guidance_scale=5.0, negative_prompt=negative)
        return Request(request_id, prompt, params, num_steps=3, cfg=True, plan=None, arrival_time=0.0, arrival_seq=0)

    a, b, c = request("a", "cat"), request("b", "cat", negative="ugly"), request("c", "dog")
    send, drop, images, starts, _ = ahead.plan([a, b, c], blocks)
    assert images == {} and starts == [] and send == [("cat", False, None, None), (None, True, None, None), ("ugly", True, None, None)] and drop == []
    assert ahead.must_wait(c, blocks)  # over capacity: "dog" waits its turn, and so does c
    ahead.mark_ready([("cat", False, None, None), (None, True, None, None)])
    assert not ahead.must_wait(a, blocks) and ahead.must_wait(b, blocks)
    assert ahead.ready_cache_keys(a) == set(a.cond_keys)
    assert ahead.used(a, (True, False)) == [(None, True, None, None)]  # a's negative was a cache hit after all
    send, drop, _, _, _ = ahead.plan([c], blocks)  # a admitted, b aborted: their texts go, c's comes in
    assert send == [("dog", False, None, None), (None, True, None, None)] and drop == [("ugly", True, None, None)]
    swapped = request("d", "bird")
    swapped.swapped = True  # its conditions come back with its state
    assert ahead.plan([swapped], blocks) == ([], [("dog", False, None, None), (None, True, None, None)], {}, [], {})
    assert config.max_encode_ahead > 0


def test_the_stage_retries_a_failed_batch_text_by_text_and_keeps_results_until_taken():
    def encode(texts, length, images):
        if ("bad", False) in texts:
            raise ValueError("no")
        return torch.stack([torch.full((3,), float(len(text or ""))) for text, _ in texts])

    stage = EncodeStage(encode, torch.device("cpu"), max_batch=4, lock=threading.Lock())
    stage.submit([("good", False, None, None), ("bad", False, None, None), ("long text", False, 7, None)])
    stage._join()  # (the thread ends when it has nothing left)
    done = stage.collect()
    assert sorted(done.ready, key=str) == [("good", False, None, None), ("long text", False, 7, None)]
    assert done.errors == {("bad", False, None, None): "prompt encoding failed: ValueError: no"}
    assert done.num_texts == 3
    assert stage.take(("good", False, None, None)).tolist() == [4.0] * 3
    assert stage.take(("good", False, None, None)) is None  # taken once
    stage.drop([("long text", False, 7, None)])
    assert stage.take(("long text", False, 7, None)) is None


def test_closing_the_stage_waits_for_the_batch_it_is_on_and_forgets_the_rest():
    entered, release = threading.Event(), threading.Event()

    def encode(texts, length, images):
        entered.set()
        assert release.wait(WAIT)
        return torch.zeros(len(texts), 2)

    stage = EncodeStage(encode, torch.device("cpu"), max_batch=1, lock=threading.Lock())
    stage.submit([("a", False, None, None), ("b", False, None, None)])
    assert entered.wait(WAIT)
    closer = threading.Thread(target=stage.close)
    closer.start()
    release.set()
    closer.join(WAIT)
    assert not closer.is_alive() and stage.pending == 0
    assert stage.collect().ready == [("a", False, None, None)]


def test_max_encode_ahead_must_be_positive():
    from dvllm.config import EngineConfig
    from dvllm.core.scheduler_config import SchedulerConfig

    with pytest.raises(ValueError, match="max_encode_ahead"):
        SchedulerConfig.of(EngineConfig(model="tiny-shapes", max_encode_ahead=0))


FAMILIES = ["sdxl_path", "sd3_path", "flux_path", "qwen_image_path", "z_image_path"]


@pytest.mark.parametrize("path_fixture", FAMILIES)
@pytest.mark.slow
def test_every_familys_texts_encoded_by_the_stage_give_the_in_loop_images(path_fixture, request, monkeypatch):
    """Two text encoders and a length (Flux), a chat-template encoder with masks and true CFG (Qwen-Image), ...:
    the stage runs each family's own encode_prompt, and the images are the stage-off engine's."""
    path = request.getfixturevalue(path_fixture)
    size = {"height": 32, "width": 32}
    first = ("a red circle", P(seed=1, num_inference_steps=5, **size))
    later = [("a blue square", P(seed=2, negative_prompt="blurry", **size)), ("a green star", P(seed=3, n=2, **size))]
    want = _run(_engine(path, encode_stage=False), first=first, later=later)
    engine = _engine(path)
    calls = _spy(engine, monkeypatch)
    got = _run(engine, first=first, later=later, hook=_stage_done_at(2, engine))
    assert {text for thread, texts in calls if thread == STAGE for text in texts} >= {"a blue square", "a green star"}
    _assert_same_images(got, want, ["first", "0", "1"])


@pytest.mark.slow
def test_an_edit_models_prompts_are_encoded_with_their_images_by_the_stage(qwen_image_edit_path, monkeypatch):
    """Qwen-Image-Edit's encoder reads each prompt with the request's images (its VL encoder): those texts go to the
    stage with their images, once per digest, and the edits are the stage-off engine's."""
    from PIL import Image

    def picture(seed: int) -> Image.Image:
        return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (48, 40, 3), dtype=np.uint8))

    size = {"height": 32, "width": 32}
    first = ("make it red", P(seed=1, num_inference_steps=5, image=picture(1), **size))
    later = [("make it blue", P(seed=2, image=picture(2), negative_prompt="blurry", **size)),
             ("make it green", P(seed=3, image=picture(3), **size)),
             ("make it blue", P(seed=4, image=picture(3), **size))]  # the same text, other images: its own encode
    want = _run(_engine(qwen_image_edit_path, encode_stage=False), first=first, later=later)
    engine = _engine(qwen_image_edit_path)
    adapter, seen = engine.executor.worker.runner.adapter, []
    real = adapter.encode_prompt

    def encode(texts, **kwargs):
        seen.append((threading.current_thread().name, [text for text, _ in texts], len(kwargs.get("images") or [])))
        return real(texts, **kwargs)

    monkeypatch.setattr(adapter, "encode_prompt", encode)
    got = _run(engine, first=first, later=later, hook=_stage_done_at(2, engine))
    staged = [(texts, images) for thread, texts, images in seen if thread == STAGE]
    assert sorted(t for texts, _ in staged for t in texts if t) == ["blurry", "make it blue", "make it blue",
                                                                   "make it green"]
    assert all(images == 1 for _, images in staged)  # every stage call read its request's image
    assert not any(text in ("make it blue", "make it green") for thread, texts, _ in seen if thread != STAGE
                   for text in texts)
    _assert_same_images(got, want, ["first", "0", "1", "2"])
    assert engine.executor.worker.runner.encode_stage._images == {}  # nothing held once encoded
