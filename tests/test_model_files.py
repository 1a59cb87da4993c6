"""A model's files checked with the other flags, before anything loads (models/model_files.py): a malformed
GGUF, an unreadable dvllm_defaults.json or --default-params, a default size past max_image_pixels, and a path
that is no file nor folder (a FIFO, /dev/zero) each end in `dvllm serve: error: <file>: <what is wrong>`, exit 2,
no traceback, with no engine started (no_model_load); the Python API raises the same ValueError."""
from __future__ import annotations

import json
import os
import struct

import pytest
import torch
from utils_cli import expect_usage_error, no_model_load  # noqa: F401 (fixture)

from dvllm import EngineConfig
from dvllm.engine.start_checks import check_at_start
from dvllm.models.single_file import header_shapes, load_vae

MAX_DEFAULT_PIXELS = 16384 * 16384  # param_defaults.MAX_DEFAULT_PIXELS: with no max_image_pixels, the bound


@pytest.fixture(scope="module")
def gguf_bytes(tmp_path_factory) -> bytes:
    """A whole GGUF file of two tensors (a Q8_0 weight and an F32 bias), as the gguf package writes it."""
    pytest.importorskip("gguf")
    from gguf_utils import write_gguf

    path = tmp_path_factory.mktemp("gguf") / "good.gguf"
    torch.manual_seed(0)
    assert write_gguf(torch.nn.Linear(32, 32), str(path)) == 1
    return path.read_bytes()


def _broken(data: bytes) -> dict[str, tuple[bytes, str]]:
    """name -> (the file's bytes, the cause its error must give)."""
    return {
        "empty": (b"", "the file is empty"),
        "not gguf": (b"PK\x03\x04" + bytes(60), "does not start with GGUF's magic bytes"),
        "cut in its header": (data[:6], "the file ends inside its header"),
        "cut in its metadata": (data[:30], "the file ends inside metadata entry"),
        "cut in its tensor table": (data[:100], "the file ends inside the info of tensor 'weight'"),
        "cut in its data": (data[:-10], "tensor 'bias' ends at byte"),
        "huge count": (data[:8] + struct.pack("<Q", 1 << 62) + data[16:], "claims 4611686018427387904 entries"),
    }


CASES = list(_broken(b"GGUF" + bytes(200)))  # the names only (the bytes come from the fixture)


def test_a_whole_gguf_files_tensors_are_read_from_its_header(gguf_bytes, tmp_path):
    from dvllm.models.gguf_header import read_gguf_names

    path = tmp_path / "good.gguf"
    path.write_bytes(gguf_bytes)
    assert read_gguf_names(str(path)) == ["weight", "bias"]
    assert set(header_shapes(str(path))) == {"weight", "bias"}


@pytest.mark.parametrize("case", CASES)
def test_a_malformed_gguf_model_is_named_with_its_cause_before_anything_loads(gguf_bytes, tmp_path, capsys,
                                                                              no_model_load, case):  # noqa: F811
    """It ended in an IndexError from inside the core process, naming neither the file nor the cause."""
    data, cause = _broken(gguf_bytes)[case]
    path = tmp_path / "model.gguf"
    path.write_bytes(data)
    err = expect_usage_error(capsys, "serve", str(path), "--base-model", str(tmp_path))
    assert f"dvllm serve: error: {path}: not a valid GGUF file (" in err and cause in err
    err = expect_usage_error(capsys, "serve", str(tmp_path), "--vae", str(path))  # a GGUF VAE: the same check
    assert f"{path}: not a valid GGUF file (" in err and cause in err
    with pytest.raises(ValueError, match=f"not a valid GGUF file .*{cause[:20]}"):
        header_shapes(str(path))  # what the core process reads it with, for the Python API's callers


@pytest.mark.parametrize("text, message", [
    ("[" * 200_000 + "]" * 200_000, "nests too deeply"),
    ('{"height": 1' + "0" * 4999 + "}", "holds a number of more than 4300 digits"),
    ('{"num_inference_steps": 8', "not valid JSON"),
], ids=["nested 200000 deep", "a 5000-digit number", "cut short"])
def test_a_defaults_file_that_cannot_be_read_is_named(tmp_path, capsys, no_model_load, text, message):  # noqa: F811
    """A RecursionError traceback, and an error naming no file, before."""
    (tmp_path / "dvllm_defaults.json").write_text(text)
    err = expect_usage_error(capsys, "serve", str(tmp_path))
    assert f"dvllm serve: error: {tmp_path / 'dvllm_defaults.json'}: " in err and message in err
    err = expect_usage_error(capsys, "serve", "--default-params", text)  # the flag's text: the same answers
    assert "dvllm serve: error: default_params: " in err and message in err


def test_a_defaults_file_of_bytes_that_are_no_text_is_named(tmp_path, capsys, no_model_load):  # noqa: F811
    (tmp_path / "dvllm_defaults.json").write_bytes(b'{"height": "\xff"}')
    err = expect_usage_error(capsys, "serve", str(tmp_path))
    assert f"{tmp_path / 'dvllm_defaults.json'}: not UTF-8 text" in err


HUGE = {"height": 1_000_000_000, "width": 1_000_000_000}


def test_default_size_is_checked_against_max_image_pixels_before_the_model_loads(tmp_path, capsys,
                                                                                 no_model_load):  # noqa: F811
    """It loaded the whole model before failing on the state pool."""
    err = expect_usage_error(capsys, "serve", "--default-params", json.dumps(HUGE))
    assert "default_params: the default size (height 1000000000 x width 1000000000)" in err
    assert f"over {MAX_DEFAULT_PIXELS}" in err and "max_image_pixels" in err
    (tmp_path / "dvllm_defaults.json").write_text(json.dumps(HUGE))
    err = expect_usage_error(capsys, "serve", str(tmp_path))
    assert f"{tmp_path / 'dvllm_defaults.json'}: the default size" in err
    # with max_image_pixels given, the defaults are held to it: the folder's height, the flag's width
    (tmp_path / "dvllm_defaults.json").write_text(json.dumps({"height": 128}))
    err = expect_usage_error(capsys, "serve", str(tmp_path), "--default-params", '{"width": 64}',
                             "--max-image-pixels", "4096")
    assert (f"{tmp_path / 'dvllm_defaults.json'} and default_params: the default size (height 128 x width 64) is "
            "8192 pixels, over max_image_pixels=4096") in err


def test_default_size_within_the_limits_is_taken():
    check_at_start(EngineConfig(default_params={"height": 64, "width": 64}, max_image_pixels=64 * 64))
    check_at_start(EngineConfig(default_params={"height": 16384, "width": 16384}))  # MAX_DEFAULT_PIXELS, no more
    # the operator's limit, over dvllm's bound
    check_at_start(EngineConfig(default_params=HUGE, max_image_pixels=10**18))
    with pytest.raises(ValueError, match="over max_image_pixels=4095"):
        check_at_start(EngineConfig(default_params={"height": 64, "width": 64}, max_image_pixels=4095))


@pytest.fixture
def fifo(tmp_path) -> str:
    if not hasattr(os, "mkfifo"):
        pytest.skip("no FIFOs on this system")
    path = str(tmp_path / "fifo")
    os.mkfifo(path)
    return path


@pytest.mark.parametrize("flag", ["--model", "--vae", "--base-model"])
def test_a_path_that_is_no_file_nor_folder_is_refused(fifo, capsys, no_model_load, flag):  # noqa: F811
    """A FIFO or a device is refused as a LoRA path is; --vae /dev/zero was looked up as a Hub id."""
    err = expect_usage_error(capsys, "serve", flag, fifo)
    field = flag.removeprefix("--").replace("-", "_")
    assert f"dvllm serve: error: {field} path {fifo!r}: is neither a regular file nor a folder" in err
    if os.path.exists("/dev/zero"):
        err = expect_usage_error(capsys, "serve", flag, "/dev/zero")
        assert f"{field} path '/dev/zero': is neither a regular file nor a folder" in err


def test_load_vae_refuses_a_device_without_reaching_the_hub(monkeypatch, fifo):
    def no_hub(*args, **kwargs):
        raise AssertionError("looked up as a Hub id")
    monkeypatch.setattr("huggingface_hub.hf_hub_download", no_hub)
    monkeypatch.setattr("diffusers.AutoencoderKL.from_pretrained", no_hub)
    with pytest.raises(ValueError, match="vae path .*: is neither a regular file nor a folder"):
        load_vae(fifo, {"vae": ["diffusers", "AutoencoderKL"]}, None, torch.float32, {})
