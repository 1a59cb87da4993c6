"""Where dvllm's kernels come from (dvllm/_extension.py, dvllm/kernel_sources.py): the package's library only when
its build fits this environment, a build just in time per environment and sources, and the pure-torch reference
ops, announced, when neither can be had; the engine serves the same images either way. (The wheel itself, built
and installed in a fresh venv: scripts/check_wheel.sh; its CUDA build: test_cuda_build.py.)"""
from __future__ import annotations

import importlib.machinery
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from dvllm import DiffusionEngine, SamplingParams, _extension, kernel_sources, ops
from dvllm.sampler_coeffs import c_header, layout

SUFFIX = importlib.machinery.EXTENSION_SUFFIXES[0]


def fake_library(folder: Path, **changes) -> Path:
    """A file laid out as a library whose build info fits this environment, but for `changes`."""
    info = kernel_sources.build_info(kernel_sources.source_digest(_extension.CSRC, c_header()), torch.__version__,
                                     layout(), None, None)
    path = folder / f"_C{SUFFIX}"
    marker = b"DVLLM_BUILD_INFO:" + json.dumps({**info, **changes}).encode()
    path.write_bytes(b"\x7fELF..." + marker + b"\0more bytes")
    return path


@pytest.fixture
def package(tmp_path, monkeypatch) -> Path:
    """The package folder the loader looks in, empty; and the loader's status restored after the test."""
    monkeypatch.setattr(_extension, "PACKAGE", tmp_path)
    return tmp_path


def test_the_build_directory_is_one_per_environment_and_sources(monkeypatch, tmp_path) -> None:
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    one = _extension.build_directory("aaaa", with_cuda=False, prefix="/venvs/one")
    assert one == _extension.build_directory("aaaa", with_cuda=False, prefix="/venvs/one")
    assert one.parent == tmp_path / "dvllm" / "ops"
    assert one.name.startswith("aaaa-") and torch.__version__ in one.name and "-cpu-" in one.name
    assert one != _extension.build_directory("aaaa", with_cuda=False, prefix="/venvs/two")  # another venv
    assert one != _extension.build_directory("bbbb", with_cuda=False, prefix="/venvs/one")  # other sources
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    assert _extension.build_directory("aaaa", False, "/venvs/one") == tmp_path / "ext" / "dvllm" / one.name


def test_the_digest_covers_every_source_and_the_coefficient_header(tmp_path) -> None:
    csrc = tmp_path / "csrc"
    csrc.mkdir()
    for source in _extension.CSRC.iterdir():
        (csrc / source.name).write_bytes(source.read_bytes())
    digest = kernel_sources.source_digest(csrc, c_header())
    assert digest == kernel_sources.source_digest(_extension.CSRC, c_header())
    assert digest != kernel_sources.source_digest(csrc, c_header() + "// another layout\n")
    (csrc / "state_ops_cuda.cu").write_text((csrc / "state_ops_cuda.cu").read_text() + "\n// edited\n")
    assert digest != kernel_sources.source_digest(csrc, c_header())


def test_the_loaded_library_carries_its_build_info() -> None:
    """Read from the file, as the loader reads a library before loading it."""
    status = _extension.custom_ops_status()
    if not status.kernels:
        pytest.skip(f"no kernels loaded: {status.reason}")
    info = kernel_sources.read_build_info(Path(status.library))
    assert info["layout"] == layout() and "cpu" in info["kernels"]
    assert info["torch"].split("+")[0] == torch.__version__.split("+")[0]
    assert info["digest"] == kernel_sources.source_digest(_extension.CSRC, c_header())  # a source checkout


def test_the_package_library_is_taken_only_when_its_build_fits(package, monkeypatch) -> None:
    monkeypatch.setattr(_extension, "source_checkout", lambda: True)  # as in this tree: csrc/ is compared
    library, why = _extension.packaged_library()
    assert library is None and "no kernel library" in why
    assert _extension.packaged_library()[0] is None
    fake_library(package)
    assert _extension.packaged_library() == (package / f"_C{SUFFIX}", None)
    cases = {"torch": ("1.0.0+cpu", "built for torch 1.0.0+cpu"), "layout": ([1, 0, 2], "coefficient layout"),
             "digest": ("0" * 16, "csrc/ changed")}
    for key, (value, reason) in cases.items():
        fake_library(package, **{key: value})
        library, why = _extension.packaged_library()
        assert library is None and reason in why, (key, why)
    if torch.version.cuda is None:  # CUDA kernels need torch's CUDA
        fake_library(package, kernels=["cpu", "cuda"], cuda="13.0")
        assert "CUDA 13.0 kernels" in _extension.packaged_library()[1]
    fake_library(package, torch=torch.__version__.split("+")[0] + "+other")  # another local build of the release
    assert _extension.packaged_library()[0] is not None
    monkeypatch.setattr(_extension, "source_checkout", lambda: False)  # installed: csrc/ is not there to compare
    fake_library(package, digest="0" * 16)
    assert _extension.packaged_library()[0] is not None
    (package / f"_C{SUFFIX}").write_bytes(b"\x7fELF no info")
    assert "no build info" in _extension.packaged_library()[1]


def test_without_kernels_dvllm_runs_the_reference_ops_and_says_why_once(package, monkeypatch, caplog) -> None:
    """An installed package without its library: the reference ops, a warning naming why and how to get the
    kernels; DVLLM_USE_CUSTOM_OPS=1 makes it an error."""
    monkeypatch.setattr(_extension, "source_checkout", lambda: False)
    monkeypatch.delenv(_extension.ENV_VAR, raising=False)
    with caplog.at_level("INFO", logger="dvllm._extension"):
        status = _extension._load.__wrapped__()
    assert status.kernels == ()
    warnings = [r for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "pure-torch reference ops" in warnings[0].getMessage()
    assert "no kernel library" in warnings[0].getMessage() and "pip install" in warnings[0].getMessage()
    assert status.as_dict() == {"kernels": [], "source": "none", "reason": status.reason}
    monkeypatch.setenv(_extension.ENV_VAR, "1")
    failure = _extension._load.__wrapped__()
    assert isinstance(failure, _extension.CustomOpsBuildError) and "no kernel library" in str(failure)
    monkeypatch.setenv(_extension.ENV_VAR, "yes")
    assert "must be 0, 1 or unset" in str(_extension._load.__wrapped__())


def test_a_failed_build_just_in_time_falls_back_with_its_error(package, monkeypatch, caplog) -> None:
    """A source checkout without a fitting library builds; when that fails too, the reference ops run and the
    warning carries the compiler's error (DVLLM_USE_CUSTOM_OPS=1: the error)."""
    from torch.utils import cpp_extension

    def broken(**kwargs):
        raise RuntimeError("Error building extension 'dvllm_C': g++: fatal error: no input files")

    monkeypatch.setattr(cpp_extension, "load", broken)
    monkeypatch.setattr(_extension, "source_checkout", lambda: True)
    monkeypatch.setattr(_extension, "build_directory", lambda *args: package / "build")
    monkeypatch.delenv(_extension.ENV_VAR, raising=False)
    with caplog.at_level("WARNING", logger="dvllm._extension"):
        status = _extension._load.__wrapped__()
    assert status.kernels == ()
    assert "building dvllm's kernels" in caplog.text and "(first run in this environment only" in caplog.text
    assert "no input files" in status.reason and "no input files" in caplog.text
    monkeypatch.setenv(_extension.ENV_VAR, "1")
    failure = _extension._load.__wrapped__()
    assert isinstance(failure, _extension.CustomOpsBuildError) and "no input files" in str(failure)


def P(sampler: str) -> SamplingParams:
    return SamplingParams(num_inference_steps=4, guidance_scale=5.0, height=16, width=16, seed=7, sampler=sampler,
                          output_type="np")


def served_custom_ops(engine: DiffusionEngine) -> tuple[dict, str]:
    """What /v1/models (the model card's `dvllm` facts) and /metrics say of the engine's kernels."""
    from dvllm.entrypoints.api_server import _served_model_facts
    from dvllm.entrypoints.metrics import ServerMetrics

    metrics = ServerMetrics(engine.stats, lambda: 0, None, engine.loaded_model.custom_ops)
    metric = [line for line in metrics.render().decode().splitlines() if line.startswith("dvllm_custom_ops_info{")]
    return _served_model_facts(engine)["custom_ops"], "\n".join(metric)


@pytest.mark.slow
def test_the_engine_serves_the_same_images_with_the_reference_ops(sd_eps_path, monkeypatch) -> None:
    """An engine that finds no kernels starts, says so (/v1/models, /metrics) and makes the images the kernels
    make; samplers with history (dpmpp_2m) and noise (euler_a) cover every term of the fused update."""
    if not _extension.custom_ops_available("cpu"):
        pytest.skip("no CPU kernels to compare with")
    prompts, params = ["a red circle", "a blue square"], [P("dpmpp_2m"), P("euler_a")]
    engine = DiffusionEngine(model=sd_eps_path, device="cpu", dtype="float32")
    assert engine.loaded_model.custom_ops["kernels"] == ["cpu"]
    facts, metric = served_custom_ops(engine)
    assert facts["source"] in ("package", "jit") and f'{{kernels="cpu",source="{facts["source"]}"}} 1.0' in metric
    with_kernels = [o.images[0] for o in engine.generate(prompts, params, use_tqdm=False)]
    engine.shutdown()
    calls = []
    real = ops.scatter_update_ref
    monkeypatch.setattr(ops, "scatter_update_ref", lambda *a, **k: calls.append(1) or real(*a, **k))
    monkeypatch.setattr(_extension, "_load", lambda: _extension.CustomOps((), "none", "the package has none"))
    engine = DiffusionEngine(model=sd_eps_path, device="cpu", dtype="float32")
    assert engine.loaded_model.custom_ops == {"kernels": [], "source": "none", "reason": "the package has none"}
    facts, metric = served_custom_ops(engine)
    assert facts == engine.loaded_model.custom_ops and '{kernels="none",source="none"} 1.0' in metric
    reference = [o.images[0] for o in engine.generate(prompts, params, use_tqdm=False)]
    engine.shutdown()
    assert calls, "the reference ops did not run"
    for a, b in zip(with_kernels, reference):
        np.testing.assert_array_equal(a, b)  # the kernels compute what the references define, bit for bit
