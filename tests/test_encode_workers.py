"""Encode workers: processes of their own that hold the text encoders and encode the encode stage's texts. The
copy they rebuild encodes every family's texts as the adapter, bit for bit; the worker's own encoders are freed
and never run; the images are the stage-off engine's; a process killed mid-batch loses no request, a text that
kills its process twice fails its requests only; shutdown stops the processes; what cannot work is refused."""
from __future__ import annotations

import os
import pickle
import signal
import threading

import numpy as np
import pytest
import torch
from test_decode_workers import _wait_until
from test_encode_stage import LATER, _assert_same_images, _run

from dvllm import DiffusionEngine, EngineConfig
from dvllm.models.load_config import LoadConfig
from dvllm.models.loader import load_adapter
from dvllm.worker.conditions import encode_flat
from dvllm.worker.encode_stage import EncodeStage
from dvllm.worker.encode_worker import EncoderCopy, ModuleCopy, start_encode_workers
from dvllm.worker.stage_config import StageConfig
from dvllm.worker.stage_process import WorkerProcessLost

def _engine(path: str, **kwargs) -> DiffusionEngine:
    return DiffusionEngine(model=path, device="cpu", dtype="float32", decode_stage=False, **kwargs)


def _stage(engine: DiffusionEngine) -> EncodeStage:
    return engine.executor.worker.runner.encode_stage


def _encoders(adapter) -> dict[str, torch.nn.Module]:
    return {name: c for name, c in adapter.pipeline.components.items()
            if name.startswith("text_encoder") and isinstance(c, torch.nn.Module)}


@pytest.fixture(scope="module")
def stage_off(sd_eps_path) -> dict[str, list]:
    return _run(_engine(sd_eps_path, encode_stage=False))


@pytest.mark.slow
def test_images_equal_the_stage_off_engines_and_the_worker_holds_and_runs_no_text_encoder(sd_eps_path, stage_off,
                                                                                          monkeypatch):
    engine = _engine(sd_eps_path, encode_workers=2)
    stage = _stage(engine)
    assert len(stage.workers) == 2 and all(w.pid not in (None, os.getpid()) for w in stage.workers)
    adapter = engine.executor.worker.runner.adapter
    assert all(p.is_meta for encoder in _encoders(adapter).values() for p in encoder.parameters())
    calls = []
    monkeypatch.setattr(adapter, "encode_prompt", lambda *a, **k: calls.append(a))
    got = _run(engine)  # every text waits for the stage, the first request's too (with nothing running yet)
    assert calls == []
    _assert_same_images(got, stage_off, ["first", "0", "1", "2"])
    assert engine.executor.worker.loaded_model().encoder_device == "cpu"
    engine.shutdown()


FAMILIES = ["sd_eps_path", "sdxl_path", "sd3_path", "flux_path", "qwen_image_path", "z_image_path", "wan_path"]
TEXTS = [("a red circle", False), (None, True), ("two blue squares on a long wooden table", False)]


@pytest.mark.parametrize("family", FAMILIES)
def test_the_encoder_copy_encodes_as_the_adapter_does(family, request):
    """What an encode process rebuilds (EncoderCopy.build: the text encoders from class, config and host tensors,
    the pipeline without denoiser or VAE, the adapter without its __init__) encodes as the adapter, bit for
    bit, once sent through a pipe (pickled)."""
    adapter = load_adapter(request.getfixturevalue(family), "auto", torch.device("cpu"), torch.float32)
    copy = pickle.loads(pickle.dumps(EncoderCopy.of(adapter)))
    assert copy.encoders.keys() == _encoders(adapter).keys() and copy.absent
    with torch.inference_mode():
        want = encode_flat(adapter, TEXTS, None)
        got = encode_flat(copy.build(torch.device("cpu")), TEXTS, None)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_an_sd3_without_t5_encodes_in_the_copy_as_in_the_adapter():
    """The built-in tiny-shapes-dit is SD3 without a T5: its pipeline sizes the zero T5 embeddings by the
    transformer's config, which the copy keeps without the transformer (it failed every request before)."""
    adapter = load_adapter("tiny-shapes-dit", "auto", torch.device("cpu"), torch.float32)
    assert adapter.pipeline.text_encoder_3 is None
    copy = pickle.loads(pickle.dumps(EncoderCopy.of(adapter)))
    built = copy.build(torch.device("cpu"))
    assert not isinstance(built.pipeline.transformer, torch.nn.Module)  # no weights in the encode process
    with torch.inference_mode():
        want = encode_flat(adapter, TEXTS, None)
        got = encode_flat(built, TEXTS, None)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_the_copy_leaves_the_denoiser_and_what_a_group_wraps(wan_path):
    """Wan keeps its experts (its transformers) on the adapter, and a worker group wraps the adapter's denoise and
    decode on the instance: neither goes to the process (the quantized experts could not be pickled, the wrapped
    methods not at all: every Wan request failed with encode workers and a group or quantization)."""
    pytest.importorskip("torchao")  # `.[test]` (the quantization backends), not the fast tier's `.[dev]`
    adapter = load_adapter(wan_path, "auto", torch.device("cpu"), torch.float32,
                           load=LoadConfig.of(EngineConfig(quantization="torchao:int8wo")))
    adapter.denoise = lambda *args: adapter.denoise(*args)  # as WorkerGroup.guard does
    copy = pickle.loads(pickle.dumps(EncoderCopy.of(adapter)))
    assert not {"experts", "denoise", "decode"} & set(copy.attributes) and "info" in copy.attributes
    shell = copy.build(torch.device("cpu"))
    with torch.inference_mode():
        torch.testing.assert_close(encode_flat(shell, TEXTS, None), encode_flat(adapter, TEXTS, None), rtol=0, atol=0)


def test_an_edit_models_copy_reads_its_prompts_with_the_images(qwen_image_edit_path):
    from PIL import Image

    adapter = load_adapter(qwen_image_edit_path, "auto", torch.device("cpu"), torch.float32)
    images = Image.fromarray(np.random.default_rng(0).integers(0, 256, (48, 40, 3), dtype=np.uint8))  # as sent
    shell = pickle.loads(pickle.dumps(EncoderCopy.of(adapter))).build(torch.device("cpu"))
    with torch.inference_mode():
        torch.testing.assert_close(encode_flat(shell, TEXTS[:2], None, images),
                                   encode_flat(adapter, TEXTS[:2], None, images), rtol=0, atol=0)


@pytest.mark.slow
def test_an_edit_engines_prompts_go_to_the_process_with_their_images(qwen_image_edit_path):
    """Qwen-Image-Edit's VL encoder reads each prompt with its request's image: with an encode process the images
    travel with the texts, and the edits are the stage-off engine's."""
    from test_encode_stage import P

    def picture(seed: int):
        from PIL import Image

        return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (48, 40, 3), dtype=np.uint8))

    size = {"height": 32, "width": 32}
    first = ("make it red", P(seed=1, num_inference_steps=4, image=picture(1), **size))
    later = [("make it blue", P(seed=2, image=picture(2), negative_prompt="blurry", **size)),
             ("make it blue", P(seed=3, image=picture(3), **size))]  # the same text, another image
    want = _run(_engine(qwen_image_edit_path, encode_stage=False), first=first, later=later)
    engine = _engine(qwen_image_edit_path, encode_workers=1)
    got = _run(engine, first=first, later=later)
    assert engine.stats()["stage_items"]["encode_stage"] >= 4  # every prompt (the negatives too), by the process
    _assert_same_images(got, want, ["first", "0", "1"])
    engine.shutdown()


def test_a_tied_weight_stays_one_tensor_and_buffers_come_along(flux_path):
    """T5's shared embedding is tied to its encoder's: the copy carries it once and the built module ties it
    again; non-persistent buffers (which no state dict holds) are copied too."""
    adapter = load_adapter(flux_path, "auto", torch.device("cpu"), torch.float32)
    t5 = adapter.pipeline.text_encoder_2
    copy = ModuleCopy.of("text_encoder_2", t5)
    assert copy.tensors["shared.weight"] is copy.tensors["encoder.embed_tokens.weight"]
    assert all(t.data_ptr() != p.data_ptr() for t, p in zip(copy.tensors.values(), t5.parameters()))
    built = pickle.loads(pickle.dumps(copy)).build(torch.device("cpu"))
    assert built.shared.weight is built.encoder.embed_tokens.weight
    assert not built.training and not any(p.requires_grad for p in built.parameters())
    clip = adapter.pipeline.text_encoder
    buffers = dict(ModuleCopy.of("text_encoder", clip).build(torch.device("cpu")).named_buffers())
    assert buffers.keys() == dict(clip.named_buffers()).keys() and buffers  # CLIP's position ids
    for name, buffer in clip.named_buffers():
        assert torch.equal(buffers[name], buffer)


def test_a_worker_killed_mid_batch_loses_no_request(sd_eps_path, stage_off):
    engine = _engine(sd_eps_path, encode_workers=1)
    stage = _stage(engine)
    (worker,) = stage.workers
    first = worker.pid
    os.kill(first, signal.SIGSTOP)  # it answers nothing: the texts it is sent stay in flight

    killed = []

    def kill_once_in_flight(step: int) -> None:
        if step >= 1 and not killed:  # (the first texts went to the stage with step 0)
            _wait_until(lambda: stage._taken, "texts to reach the encode process")
            os.kill(first, signal.SIGKILL)  # (once: a fork server's child is reaped at once, its pid gone)
            killed.append(first)

    got = _run(engine, hook=kill_once_in_flight)
    assert worker.restarts == 1 and worker.pid != first
    assert engine.stats()["stage_restarts"]["encode_stage.process"] == 1  # (the metrics' dvllm_stage_restarts)
    _assert_same_images(got, stage_off, ["first", "0", "1", "2"])
    engine.shutdown()


class _FakeWorker:
    """Encodes in the test's process (a text's conditions: its length); dies (raises WorkerProcessLost) as told."""

    def __init__(self, dies) -> None:
        self.dies, self.batches = dies, []

    def encode(self, batch):
        texts, _, _ = batch
        self.batches.append([text for text, _ in texts])
        if self.dies(texts):
            raise WorkerProcessLost("encode worker 0 (pid 1) died: EOFError")
        return torch.stack([torch.full((2,), float(len(text))) for text, _ in texts])

    def close(self) -> None:
        pass


def _stage_with(worker: _FakeWorker) -> EncodeStage:
    def no_local_encode(*args):
        raise AssertionError("the lane's process encodes, not its thread")

    return EncodeStage(no_local_encode, torch.device("cpu"), max_batch=4, lock=threading.Lock(), workers=[worker])


KEYS = [(text, False, None, None) for text in ("one", "three", "seven")]


def test_a_batch_whose_process_died_is_encoded_again_then_text_by_text():
    deaths = iter([True, True])  # the batch kills two processes: then each text goes alone, and lives
    worker = _FakeWorker(lambda texts: next(deaths, False))
    stage = _stage_with(worker)
    stage.submit(KEYS)
    stage._join()
    done = stage.collect()
    assert worker.batches == [["one", "three", "seven"]] * 2 + [["one"], ["three"], ["seven"]]
    assert not done.errors and sorted(done.ready) == sorted(KEYS)
    assert stage.take(KEYS[1]).tolist() == [5.0, 5.0]


def test_a_text_whose_process_dies_twice_fails_alone():
    worker = _FakeWorker(lambda texts: ("three", False) in texts)  # it kills every process it reaches
    stage = _stage_with(worker)
    stage.submit(KEYS)
    stage._join()
    done = stage.collect()
    assert sorted(done.ready) == sorted([KEYS[0], KEYS[2]])
    assert list(done.errors) == [KEYS[1]] and "WorkerProcessLost" in done.errors[KEYS[1]]


@pytest.mark.slow
def test_shutdown_stops_the_processes(sd_eps_path):
    engine = _engine(sd_eps_path, encode_workers=2)
    processes = [w.process for w in _stage(engine).workers]
    engine.add_request("0", *LATER[0])
    while engine.has_unfinished_requests():
        engine.step()
    engine.shutdown()
    _wait_until(lambda: all(p.poll() is not None for p in processes), "the encode processes to exit")


@pytest.mark.parametrize("kwargs, message", [
    (dict(encode_workers=-1), "encode_workers must be an integer"),
    (dict(encode_workers=True), "encode_workers must be an integer"),
    (dict(encode_workers=1, encode_stage=False), "encode_stage=False"),
    (dict(encode_device="cpu"), "encode_workers is 0"),
    (dict(encode_workers=1, encode_device="tpu"), "encode_device must be"),
    (dict(encode_workers=1, enable_lora=True), "LoRA serving"),
    (dict(encode_workers=1, encoder_device="cpu"), "use encode_device"),
    (dict(encode_workers=1, max_encode_ahead=2), "max_encode_ahead >= 3"),
])
def test_what_cannot_work_is_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        StageConfig.of(EngineConfig(model="tiny-shapes", **kwargs))


def test_encode_workers_turn_the_stage_on():
    assert EngineConfig(model="tiny-shapes", encode_workers=1).encode_stage is True
    assert EngineConfig(model="tiny-shapes").encode_stage is False


def test_a_gpu_not_seen_and_a_quantized_encoder_are_refused_at_start(sd_eps_path, monkeypatch):
    adapter = load_adapter(sd_eps_path, "auto", torch.device("cpu"), torch.float32)
    with pytest.raises(ValueError, match="sees 0 GPU"):
        start_encode_workers(adapter, 1, ["cpu", "cuda:1"], torch.device("cpu"))
    encoder = adapter.pipeline.text_encoder
    weight = encoder.final_layer_norm.weight
    monkeypatch.setattr(encoder, "named_parameters",
                        lambda **kwargs: iter([("w", torch.nn.Parameter(weight.detach())),
                                                            ("q", torch.zeros(2, dtype=torch.int8).as_subclass(
                                                                _QuantizedTensor))]))
    with pytest.raises(ValueError, match="not a plain tensor"):
        start_encode_workers(adapter, 1, ["cpu"], torch.device("cpu"))
    monkeypatch.undo()
    assert not any(p.is_meta for p in adapter.pipeline.text_encoder.parameters())  # nothing freed on a refusal


class _QuantizedTensor(torch.Tensor):
    """Stands in for a quantized weight's tensor subclass."""
