"""How dvllm's custom ops are built and loaded (dvllm/_extension.py): the layout each kernel library was
compiled with, a build that fails, and the log line that says which path runs. (The CUDA build itself, without a
GPU: test_cuda_build.py; the kernels: test_state_ops.py.)"""
from __future__ import annotations

import pytest
import torch
from test_state_ops import DEVICES, custom_ops_on  # noqa: F401 (the device fixture's parameters)

from dvllm import _extension, ops


@pytest.fixture(params=DEVICES)
def device(request: pytest.FixtureRequest) -> str:
    return request.param


def test_the_built_library_reports_the_layout_of_sampler_coeffs(device: str) -> None:
    """What the compiler made of the generated header, read back from the library itself (the CUDA build is
    checked without a GPU too: tests/test_cuda_build.py)."""
    from dvllm.sampler_coeffs import layout

    custom_ops_on(device)
    op = torch.ops.dvllm.coeff_layout if device == "cpu" else torch.ops.dvllm.cuda_coeff_layout
    assert list(op()) == layout()


def test_a_failed_build_is_an_error_that_says_why(monkeypatch, tmp_path) -> None:
    """With DVLLM_USE_CUSTOM_OPS=1, not a fall back to the slower reference ops: the engine refuses to start, naming
    the cause and the switch. (Unset, dvllm falls back and says so: test_packaged_ops.py.)"""
    from torch.utils import cpp_extension

    def broken(**kwargs):
        raise RuntimeError("Error building extension 'dvllm_C': g++: fatal error: no input files")

    monkeypatch.setattr(cpp_extension, "load", broken)
    monkeypatch.setattr(_extension, "packaged_library", lambda want_cuda=False: (None, "no library in the package"))
    monkeypatch.setattr(_extension, "build_directory", lambda *args: tmp_path)
    monkeypatch.setenv(_extension.ENV_VAR, "1")
    failure = _extension._load.__wrapped__()
    assert isinstance(failure, _extension.CustomOpsBuildError)
    assert "no input files" in str(failure) and f"unset {_extension.ENV_VAR}" in str(failure)
    monkeypatch.setattr(_extension, "_load", lambda: failure)
    with pytest.raises(_extension.CustomOpsBuildError, match="could not be loaded or built"):
        _extension.custom_ops_available("cpu")
    with pytest.raises(_extension.CustomOpsBuildError):  # every call, without building again
        ops.gather_blocks(torch.zeros(4, 16), torch.zeros(1, 1, dtype=torch.int32), 16)


def test_the_log_says_which_path_runs(monkeypatch, caplog) -> None:
    monkeypatch.setenv(_extension.ENV_VAR, "0")
    with caplog.at_level("INFO", logger="dvllm._extension"):
        assert _extension._load.__wrapped__().kernels == ()
    assert "pure-torch reference ops" in caplog.text
    monkeypatch.delenv(_extension.ENV_VAR)
    caplog.clear()
    with caplog.at_level("INFO", logger="dvllm._extension"):
        assert "cpu" in _extension._load.__wrapped__().kernels  # loads the library already built (fakes once more)
    assert "dvllm custom ops: cpu kernels" in caplog.text
