"""What a LoRA path may be, checked before diffusers reads it (dvllm/lora/files.py), and what an adapter's
weights must be (finite, placed on modules the model has, whatever the log level), found by an adversarial
run against `dvllm serve`: each of these once read a file whole, reached the Hub, or served a broken adapter."""
from __future__ import annotations

import argparse
import os
import shutil
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from fastapi.testclient import TestClient
from lora_utils import make_lora
from safetensors.torch import load_file, save_file
from utils_cli import restore_logging  # noqa: F401 (fixture)
from utils_server import assert_error

from dvllm import DiffusionEngine, SamplingParams
from dvllm.engine.async_engine import AsyncDiffusionEngine
from dvllm.entrypoints.api_server import build_app
from dvllm.logging_setup import setup_logging
from dvllm.lora.files import LoraFilePolicy, LoraPathError, locate_lora

POLICY = LoraFilePolicy(max_mb=64.0)
WEIGHTS = "pytorch_lora_weights.safetensors"
REQUEST = dict(num_inference_steps=2, height=16, width=16, output_type="np", seed=1)


@pytest.fixture(scope="module")
def adapters(tmp_path_factory) -> dict[str, str]:
    from conftest import tiny_sd_pipeline

    folder, pipe = tmp_path_factory.mktemp("lora-files"), tiny_sd_pipeline()
    made = {name: make_lora(pipe, str(folder / name), seed=seed) for name, seed in (("a", 1), ("b", 2))}
    # no alpha in a metadata header, which a .bin file could not carry: alpha = rank in either format
    return {**made, "plain": make_lora(pipe, str(folder / "plain"), seed=3, metadata=False)}


@pytest.fixture
def engine(sd_eps_path, adapters):
    engine = DiffusionEngine(model=sd_eps_path, device="cpu", dtype="float32", enable_lora=True, max_cpu_loras=1)
    yield engine
    engine.shutdown()


def tensors_of(adapter: str) -> dict[str, torch.Tensor]:
    return load_file(os.path.join(adapter, WEIGHTS))


def saved(folder, tensors: dict[str, torch.Tensor]) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / WEIGHTS))
    return str(folder)


def sparse_file(path, size: int, head: bytes = b"") -> str:
    """A file of `size` bytes that takes no disk (and no memory unless something reads it)."""
    with open(path, "wb") as f:
        f.write(head)
        f.truncate(size)
    return str(path)


# -- item 1: a path is checked before anything reads it ---------------------------------------------------

def test_a_large_file_that_is_no_lora_is_refused_from_its_header(tmp_path, engine, monkeypatch):
    """A 1-3 GB sparse file went through diffusers' fallback, which reads a file as text (+2x its size in RSS).
    Now its first 8 bytes refuse it, or its size does, and diffusers never sees it."""
    monkeypatch.setattr("dvllm.lora.reader.read_lora", lambda *a: pytest.fail("diffusers read the file"))
    junk = sparse_file(tmp_path / "junk.safetensors", 1 << 30, b"\xff" * 8)
    with pytest.raises(LoraPathError, match="not a safetensors file: its header length"):
        engine.load_lora("junk", junk)
    huge = sparse_file(tmp_path / "huge.safetensors", 3 << 30)
    with pytest.raises(LoraPathError, match=r"the file is 3072.0 MB, over max_lora_file_mb=2048"):
        engine.load_lora("huge", huge)
    pickle = sparse_file(tmp_path / "weights.bin", 1 << 30)
    with pytest.raises(LoraPathError, match="not a .safetensors file .* --allow-lora-bin"):
        engine.load_lora("pickle", pickle)
    assert engine.list_loras() == []


@pytest.mark.parametrize("header, why", [
    (b'{"x": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}', "tensors take 16 bytes, but the file"),
    (b'{"x": {"dtype": "F32", "shape": [2], "data_offsets": [0, 16]}}', "not its shape's"),
    (b'{"x": {"dtype": "F32", "shape": [2]}}', "not described by a dtype, a shape and data offsets"),
    (b'{"__metadata__": {}}', "it holds no tensors"),
    (b"[1, 2]", "not a JSON object"),
    (b"{not json", "not JSON"),
], ids=["short-data", "wrong-size", "no-offsets", "no-tensors", "not-an-object", "not-json"])
def test_safetensors_headers_are_checked(tmp_path, header, why):
    path = tmp_path / "a.safetensors"
    path.write_bytes(len(header).to_bytes(8, "little") + header + b"\0" * 8)
    with pytest.raises(LoraPathError, match=why):
        locate_lora(str(path), POLICY)


def test_folders_hold_one_weights_file_or_diffusers_standard_name(tmp_path, adapters):
    one = tmp_path / "one"
    one.mkdir()
    shutil.copy(os.path.join(adapters["a"], WEIGHTS), one / "style_v2.safetensors")
    assert locate_lora(str(one), POLICY).path == str(one / "style_v2.safetensors")
    shutil.copy(os.path.join(adapters["a"], WEIGHTS), one / "style_v3.safetensors")
    with pytest.raises(LoraPathError, match="holds 2 .safetensors files .*: name the file"):
        locate_lora(str(one), POLICY)
    shutil.copy(os.path.join(adapters["a"], WEIGHTS), one / WEIGHTS)
    assert locate_lora(str(one), POLICY).path == str(one / WEIGHTS)
    with pytest.raises(LoraPathError, match="holds no .safetensors file"):
        locate_lora(str(tmp_path / "one" / ".."), LoraFilePolicy(max_mb=64.0))


def test_bin_files_only_where_the_operator_allows_them(tmp_path, sd_eps_path, adapters):
    tensors = tensors_of(adapters["plain"])
    folder = tmp_path / "bin"
    folder.mkdir()
    torch.save(tensors, folder / "pytorch_lora_weights.bin")
    with pytest.raises(LoraPathError, match="holds no .safetensors file"):
        locate_lora(str(folder), POLICY)
    engine = DiffusionEngine(model=sd_eps_path, device="cpu", dtype="float32", allow_lora_bin=True,
                             lora_modules={"bin": str(folder), "safe": adapters["plain"]})
    try:
        as_bin, as_safe = (engine.generate("a red circle", SamplingParams(**REQUEST, loras={n: 1.0}),
                                           use_tqdm=False)[0].images[0] for n in ("bin", "safe"))
        assert (as_bin == as_safe).all()  # the same weights, read by either reader
    finally:
        engine.shutdown()


# -- item 5: adapter paths are local unless the operator allows Hub ids ------------------------------------

def test_a_hub_shaped_path_that_is_no_file_or_folder_never_reaches_the_hub(tmp_path, engine, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("huggingface_hub.HfApi.list_repo_files", lambda *a, **k: pytest.fail("Hub lookup"))
    (tmp_path / "owner").mkdir()
    os.mkfifo(tmp_path / "owner" / "name")  # exists, but is neither a file nor a folder
    with pytest.raises(LoraPathError, match="neither a regular file nor a folder"):
        engine.load_lora("fifo", "owner/name")
    with pytest.raises(LoraPathError, match="does not exist .*--allow-lora-hub-ids"):
        engine.load_lora("hub", "someone/some-lora")


def test_hub_ids_when_allowed_are_fetched_once_then_local(tmp_path, adapters, monkeypatch):
    """With --allow-lora-hub-ids the repo's one weights file is fetched (its size checked first), and then served
    from the local copy like any file."""
    import huggingface_hub

    fetched = []
    local = os.path.join(adapters["a"], WEIGHTS)
    monkeypatch.setattr(huggingface_hub.HfApi, "list_repo_files",
                        lambda self, repo: ["README.md", WEIGHTS, "older/other.safetensors"])
    monkeypatch.setattr(huggingface_hub, "get_hf_file_metadata",
                        lambda url: argparse.Namespace(size=os.path.getsize(local)))
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", lambda repo, name: fetched.append((repo, name)) or local)
    hub = LoraFilePolicy(max_mb=64.0, allow_hub_ids=True)
    assert locate_lora("someone/some-lora", hub).path == local
    assert fetched == [("someone/some-lora", WEIGHTS)]
    with pytest.raises(LoraPathError, match="over max_lora_file_mb"):
        locate_lora("someone/some-lora", LoraFilePolicy(max_mb=0.01, allow_hub_ids=True))
    assert len(fetched) == 1  # refused by its size, before the download


@pytest.mark.slow
def test_a_reread_checks_the_file_is_the_one_loaded(tmp_path, engine, adapters):
    """Admission checks that an adapter's file is the one loaded: a file modified or deleted since the load fails
    the requests that name it, naming why (it is never looked up on the Hub)."""
    copy = shutil.copytree(adapters["a"], tmp_path / "a")
    engine.load_lora("a", str(copy))
    engine.load_lora("b", adapters["b"])
    assert engine.generate("x", SamplingParams(**REQUEST, loras={"a": 1.0}), use_tqdm=False)[0].error is None
    engine.load_lora("b2", adapters["b"])
    tensors = tensors_of(str(copy))
    save_file({k: v * 2 for k, v in tensors.items()}, str(copy / WEIGHTS))
    with pytest.raises(ValueError, match="loras: LoRA adapter 'a': its file changed since it was loaded"):
        engine.generate("x", SamplingParams(**REQUEST, loras={"a": 1.0}), use_tqdm=False)
    shutil.rmtree(copy)
    with pytest.raises(ValueError, match="its file changed .*can no longer be read"):
        engine.generate("x", SamplingParams(**REQUEST, loras={"b": 1.0, "a": 1.0}), use_tqdm=False)
    assert engine.generate("x", SamplingParams(**REQUEST, loras={"b": 1.0}), use_tqdm=False)[0].error is None


# -- reads do not wait on each other ---------------------------------------------------------------------

def test_a_slow_read_does_not_hold_up_another_load(engine, adapters, monkeypatch):
    import dvllm.lora.reader as reader

    real_read, reading, release = reader.read_lora, threading.Event(), threading.Event()

    def read(skeleton, name, *args):
        if name == "slow":
            reading.set()
            assert release.wait(120), "the test never released the slow read"
        return real_read(skeleton, name, *args)

    monkeypatch.setattr(reader, "read_lora", read)
    with ThreadPoolExecutor(1) as pool:
        slow = pool.submit(engine.load_lora, "slow", adapters["a"])
        try:
            assert reading.wait(120)
            engine.load_lora("quick", adapters["b"])  # with one lock over reads this would wait for "slow"
            assert [a["name"] for a in engine.list_loras()] == ["quick"]
        finally:
            release.set()
        slow.result(120)
    assert sorted(a["name"] for a in engine.list_loras()) == ["quick", "slow"]


# -- items 2 and 6: what an adapter holds ----------------------------------------------------------------

def test_weights_for_missing_modules_are_refused_at_the_servers_log_level(tmp_path, engine, adapters):
    """`dvllm serve` turns diffusers' logger down to errors; the check once listened for a diffusers warning,
    so at the server's default level such an adapter was accepted and partly applied."""
    setup_logging("info")  # as the server sets it (restore_logging puts it back)
    tensors = tensors_of(adapters["a"])
    a_key = next(k for k in tensors if "lora_A" in k)
    extra = {**tensors, "unet.no_such_block.to_q.lora_A.weight": tensors[a_key].clone(),
             "unet.no_such_block.to_q.lora_B.weight": tensors[a_key.replace("lora_A", "lora_B")].clone()}
    with pytest.raises(ValueError, match="weights for modules this model does not have: unet.no_such_block.to_q"):
        engine.load_lora("extra", saved(tmp_path / "extra", extra))
    assert engine.list_loras() == []


@pytest.mark.parametrize("value, where, why", [
    (float("nan"), "lora_A", "non-finite values"),
    (float("inf"), "lora_B", "non-finite values"),
    (1e30, "lora_A", "magnitude 1e\\+30, over 10000"),
], ids=["nan", "inf", "huge"])
def test_non_finite_or_huge_weights_are_refused_naming_the_tensor(tmp_path, engine, adapters, value, where, why):
    tensors = tensors_of(adapters["a"])
    key = sorted(k for k in tensors if where in k)[0]
    tensors[key] = tensors[key].clone()
    tensors[key][0, 0] = value
    module = key.removesuffix(f".{where}.weight")
    with pytest.raises(ValueError, match=f"{module}.{where}.* {why}"):
        engine.load_lora("broken", saved(tmp_path / "broken", tensors))
    assert engine.list_loras() == []


# -- item 8: what clients are told ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def async_engine(sd_eps_path):
    return AsyncDiffusionEngine(model=sd_eps_path, device="cpu", dtype="float32", state_pool_mb=16,
                                enable_lora=True)


def _load(client: TestClient, path: str):
    return client.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": path})


def test_clients_cannot_tell_missing_folders_and_unreadable_paths_apart(tmp_path, async_engine, sd_eps_path,
                                                                        adapters):
    junk = tmp_path / "secret.safetensors"
    junk.write_bytes(b"\0" * 64)
    os.mkfifo(tmp_path / "pipe")
    paths = [str(tmp_path / "missing"), str(tmp_path), sd_eps_path, str(junk), str(tmp_path / "pipe")]
    args = argparse.Namespace(allow_runtime_lora_updating=True)
    client = TestClient(build_app(async_engine, args))  # no lifespan: loads need no engine loop
    messages = {assert_error(_load(client, path), 400, "lora_path")["message"].replace(path, "PATH")
                for path in paths}
    assert messages == {"LoRA path 'PATH' is not a loadable adapter"}
    client = TestClient(build_app(async_engine, argparse.Namespace(log_level="debug", **vars(args))))
    detailed = assert_error(_load(client, str(tmp_path / "missing")), 400, "lora_path")["message"]
    assert "does not exist" in detailed


def test_models_show_adapter_paths_only_when_the_operator_opts_in(async_engine, adapters):
    async_engine.engine.load_lora("shown", adapters["a"])
    try:
        for show in (False, True):
            client = TestClient(build_app(async_engine, argparse.Namespace(show_lora_paths=show)))
            card = client.get("/v1/models").json()["data"][1]
            one = client.get("/v1/models/shown").json()
            assert card["id"] == "shown" and one["id"] == "shown"
            assert card.get("root") == one.get("root") == (adapters["a"] if show else None)
    finally:
        async_engine.engine.unload_lora("shown")
