"""memory_estimate: fake runs tracked as real CPU runs are, weights as the loaded models hold them, and the
commands of docs/gpus.md's "Serve a real model on one GPU" and of the README's "Choose your flags" true to
`dvllm serve` and to the estimator."""
from __future__ import annotations

import argparse
import re
import shlex
from pathlib import Path

import pytest
import torch
from torch.profiler import ProfilerActivity, profile
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from dvllm.sizing.fake_memory import PeakTracker, TrackedMemory, tensor_bytes
from dvllm.sizing.memory_estimate import GIB, HUB_PRESETS, build_parser, estimate, main, render
from dvllm.sizing.quant_bytes import parse_spec, quantized_bytes
from dvllm.config import EngineConfig
from dvllm.models.load_config import LoadConfig
from dvllm.models.loader import load_adapter, preset_names
from dvllm.models.model_defaults import KNOWN_DEFAULTS
from dvllm.worker.memory_profile import step_peaks

README = Path(__file__).resolve().parents[1] / "README.md"  # its short table: "Choose your flags"
GPUS = Path(__file__).resolve().parents[1] / "docs" / "gpus.md"  # the full table
# The small models' worst step, kept small so the real CPU runs take a second or two
LIMITS = {"max_batch_size": 2, "max_image_pixels": 64 * 64, "max_decode_batch": 1}


def test_the_tracker_follows_a_known_allocation_pattern():
    outside = torch.zeros(256)  # made before: its views and in-place updates add nothing
    tracker = PeakTracker()
    with tracker:
        a = torch.empty(1000)  # 4000 bytes
        b = a + 1  # 8000
        outside[:10].add_(1)
        del a  # 4000
        c = b.view(10, 100) * 2  # a view adds nothing; the product does: 8000
        d = torch.stack([b, b])  # 16000, the peak
        del b, d  # 4000: c
        e = c.view(-1)
        del c  # e keeps c's storage alive
        assert tracker.now == 4000
        del e
    assert (tracker.peak, tracker.now, tracker.live) == (16000, 0, {})


class ProfiledMemory(TrackedMemory):
    """The tracker's peak of each run on real tensors, and the CPU allocator's own, from the profiler's record
    of every allocation (kernels' scratch buffers too) in the same run."""

    def __init__(self) -> None:
        super().__init__(None)
        self.allocator: list[int] = []

    def measure(self, run) -> int:
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            peak = super().measure(run)
        events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                        key=lambda e: e.start_ns())
        now = most = 0
        for event in events:
            now += event.nbytes()
            most = max(most, now)
        self.allocator.append(most)
        return peak


@pytest.fixture(scope="module")
def real():
    """The small models loaded for real on the CPU, in float32."""
    return {name: load_adapter(name, "dummy", torch.device("cpu"), torch.float32) for name in ("tiny-sd", "flux-cpu")}


@pytest.mark.parametrize("name", ["tiny-sd", "flux-cpu"])
@pytest.mark.slow
def test_the_fake_step_is_the_real_cpu_step_and_the_weights_the_loaded_ones(real, name):
    adapter = real[name]
    memory = ProfiledMemory() if name == "tiny-sd" else TrackedMemory(None)  # (the profiler is slow on flux-cpu)
    measured = step_peaks(adapter, EngineConfig(**LIMITS), memory)
    fake = estimate(name, dtype="float32", size=(64, 64), **LIMITS)
    assert fake.worst == measured  # byte for byte: the same ops on fake tensors
    # The CPU allocator's own record: what the tracker counted, plus buffers kernels allocate inside themselves
    # (a VAE's convolutions; T5's attention), which no op returns. Measured: 1.0x to 1.21x the tracker's on
    # tiny-sd; on flux-cpu 0.986x (denoise) to 1.31x (the T5 encode).
    for tracked, allocator in zip(measured.values(), getattr(memory, "allocator", ())):
        assert 0.97 * tracked <= allocator <= 1.4 * tracked
    on_cpu = {k: tensor_bytes(v) for k, v in adapter.pipeline.components.items() if isinstance(v, torch.nn.Module)}
    assert fake.weights == on_cpu
    assert fake.attention["denoise"] and all("flash" in k for k in fake.attention["denoise"])


def _stored_bytes(module: torch.nn.Module) -> int:
    """Bytes a module's tensors hold, a quantized weight's parts (data, scales, zero points) included."""
    def nbytes(t: torch.Tensor) -> int:
        if is_traceable_wrapper_subclass(t):
            return sum(nbytes(getattr(t, part)) for part in t.__tensor_flatten__()[0])
        return t.numel() * t.element_size()

    return sum(nbytes(t) for t in {id(t): t for t in (*module.parameters(), *module.buffers())}.values())


@pytest.mark.parametrize("spec", ["torchao:int8wo", "torchao:float8wo"])
def test_quantized_weights_are_the_bytes_torchao_stores(spec):
    pytest.importorskip("torchao")
    from dvllm.models.quantization import parse_quantization

    adapter = load_adapter("tiny-sd", "dummy", torch.device("cpu"), torch.float32,
                           load=LoadConfig(quantization=parse_quantization(spec)))
    assert quantized_bytes(_meta_unet(), parse_spec(spec)) == _stored_bytes(adapter.pipeline.unet)


def _meta_unet() -> torch.nn.Module:
    from dvllm.sizing.memory_estimate import _build

    return _build("tiny-sd", "float32", "auto", False)[2]["unet"]


def test_bad_arguments_are_value_errors():
    for spec in ("gguf", "torchao:int3", '{"backend": "torchao", "options": {"quant_type": "int8wo", '
                 '"quant_type_kwargs": {"group_size": 32}}}', '{"backend": "quanto", "options": {"dtype": "x"}}'):
        with pytest.raises(ValueError, match="quantization"):
            parse_spec(spec)
    bad = [{"dtype": "float64"}, {"encoder_device": "cuda:1"}, {"size": (0, 64)}, {"max_batch_size": 0},
           {"cards_gib": ()}, {"quantization": "bitsandbytes:3bit"}]
    for kwargs in bad:
        with pytest.raises(ValueError):
            estimate("tiny-sd", **kwargs)
    with pytest.raises(ValueError, match="does not exist"):
        estimate("./no-such-model")
    with pytest.raises(SystemExit):
        main(["--model", "tiny-sd", "--size", "64"])


def test_the_table_says_it_is_an_estimate(capsys):
    main(["--model", "tiny-sd", "--dtype", "float32", "--max-batch-size", "2", "--max-image-pixels", "4096",
          "--max-decode-batch", "1", "--cards", "1"])
    out = capsys.readouterr().out
    assert "not measured on a GPU" in out and "1 GiB card" in out and "requests" in out


# -- docs/gpus.md's section and the README's short table -----------------------------------------------------------
def _section(path: Path = GPUS, title: str = "## Serve a real model on one GPU") -> str:
    text = path.read_text()
    start = text.index(title)
    return text[start:text.index("\n## ", start + 1)]


def _readme_commands() -> list[list[str]]:
    """The README's "Choose your flags": a model a row, then a card a cell (its flags, "no flags", or no command)."""
    commands = []
    for row in re.findall(r"^\|(.+)\|$", _section(README, "## Choose your flags"), re.MULTILINE):
        cells = [c.strip() for c in row.split("|")]
        model = re.search(r"`([\w.-]+/[\w.-]+)`", cells[0])
        for cell in cells[1:] if model else ():
            flags = re.findall(r"`(--[^`]+)`", cell)
            if flags or cell == "no flags":
                commands.append(["--model", model.group(1), *(part for f in flags for part in shlex.split(f))])
    return commands


def _commands() -> list[list[str]]:
    """Every dvllm serve command of the section: its code block's lines, and its table's rows (model, flags; a
    row with no model is the row above's model on another card)."""
    section = _section()
    block = re.search(r"```bash\n(.*?)```", section, re.DOTALL).group(1)
    commands = [shlex.split(line)[2:] for line in block.splitlines() if line.startswith("dvllm serve ")]
    model = None
    for row in re.findall(r"^\|(.+)\|$", section, re.MULTILINE):
        cells = [c.strip() for c in row.split("|")]
        named = re.search(r"`([\w.-]+/[\w.-]+)`", cells[0])
        model = named.group(1) if named else model if not cells[0] else None
        if model:
            flags = re.findall(r"`(--[^`]+)`", cells[1])
            commands.append(["--model", model, *(part for f in flags for part in shlex.split(f))])
    return commands


def test_the_readme_commands_are_dvllm_serve_commands_the_estimate_computes():
    from dvllm.entrypoints.cli import _add_serve_args

    serve = argparse.ArgumentParser(exit_on_error=False)
    _add_serve_args(serve)
    estimator = build_parser()
    commands, short = _commands(), _readme_commands()
    assert len(commands) >= 8 and {c[1].lower() for c in commands} == set(HUB_PRESETS)
    assert len(short) >= 8 and {c[1].lower() for c in short} == set(HUB_PRESETS)
    assert all(argv in commands for argv in short)  # the short table's commands are the full table's
    for argv in commands:
        serve.parse_args(argv)  # every flag exists, every value its type (argparse exits otherwise)
        estimator.parse_args(argv)  # and the estimate takes the same flags
        model = argv[1].lower()
        assert model in HUB_PRESETS or model in KNOWN_DEFAULTS or model in preset_names()
    assert "python -m dvllm.sizing.memory_estimate" in _section()


def test_text_encoders_on_the_cpu_leave_the_gpu():
    fake = estimate("tiny-sd", dtype="float32", size=(64, 64), encoder_device="cpu", **LIMITS)
    assert fake.step["encode"] == fake.worst["encode"] == 0
    assert "text_encoder" in fake.host_weights and "text_encoder" not in fake.weights
    assert "weights on the CPU" in render(fake)


@pytest.mark.slow
def test_the_decode_stage_reserves_its_vae_beside_the_loops_work_and_its_queue():
    off = estimate("tiny-sd", dtype="float32", size=(64, 64), **LIMITS)
    on = estimate("tiny-sd", dtype="float32", size=(64, 64), decode_stage=True, max_decode_queue=8, **LIMITS)
    assert off.reserved == max(off.worst.values()) and on.worst == off.worst
    one = estimate("tiny-sd", dtype="float32", size=(64, 64), decode_stage=True, max_decode_queue=1, **LIMITS)
    queue = 8 * one.decode_queue  # eight images' latents at the largest size
    assert on.decode_queue == queue > 0
    assert on.reserved == max(on.worst["encode"], on.worst["denoise"]) + on.worst["decode"] + queue
    assert on.needed - off.needed == on.reserved - off.reserved > 0
    assert "the decode stage's VAE beside the loop's" in render(on)


def test_decode_workers_take_the_stages_vae_off_the_gpu_and_keep_its_queue():
    """As memory_profile.gpu_pool_bytes reserves it with decode processes on another device: the stage runs (its
    queue's latents reserved), its VAE is not beside the loop's work (the loop may still decode when the stage is
    full: the decode peak counts among the loop's)."""
    workers = estimate("tiny-sd", dtype="float32", size=(64, 64), decode_workers=2, max_decode_queue=8, **LIMITS)
    assert workers.decode_stage is True and workers.decode_queue > 0
    assert workers.reserved == max(workers.worst.values()) + workers.decode_queue
    assert "in 2 decode process(es) off this GPU" in render(workers)
    with pytest.raises(ValueError, match="decode_stage=False"):
        estimate("tiny-sd", dtype="float32", size=(64, 64), decode_workers=1, decode_stage=False, **LIMITS)


@pytest.mark.slow
def test_the_encode_stage_reserves_its_encoders_beside_the_loops_work_and_its_ready_texts():
    """As memory_profile.gpu_pool_bytes reserves it: the text encoders' peak (and, for a family that takes input
    images, the VAE encode of a start) on top of the loop's forward (and the decode stage's VAE), plus
    max_encode_ahead items ready, each a text's conditions or a start (n images' latents and inpainting state)."""
    from dvllm.models.loader import load_adapter as load

    off = estimate("tiny-sd", dtype="float32", size=(64, 64), decode_stage=False, **LIMITS)
    on = estimate("tiny-sd", dtype="float32", size=(64, 64), decode_stage=False, encode_stage=True,
                  max_encode_ahead=4, **LIMITS)
    info = load("tiny-sd", "dummy", torch.device("cpu"), torch.float32).info
    latents = info.latents.numel(64, 64)  # a start at the largest size: latents, then the inpainting state
    start = 8 * (latents + info.images.inpaint_channels * latents // info.latents.channels)  # n up to 8
    assert start > info.text.condition_numel
    assert on.encode_ahead == 4 * start * 4 > 0 and off.encode_ahead == 0  # float32
    assert on.reserved == max(on.worst["denoise"], on.worst["decode"]) + on.worst["encode"] + on.encode_ahead
    assert on.reserved > off.reserved
    both = estimate("tiny-sd", dtype="float32", size=(64, 64), decode_stage=True, max_decode_queue=1,
                    encode_stage=True, max_encode_ahead=4, **LIMITS)
    assert both.reserved == both.worst["denoise"] + both.worst["encode"] + both.worst["decode"] \
        + both.decode_queue + both.encode_ahead
    assert "the encode stage's encoders beside the loop's" in render(on)


@pytest.mark.slow
def test_encode_workers_take_the_text_encoders_off_the_gpu():
    """As memory_profile.gpu_pool_bytes reserves it with encode processes: the stage runs, the text encoders'
    weights are not on the GPU and their work not among its peaks (the stage's starts, a VAE encode, still are),
    and the ready texts and starts are reserved."""
    limits = LIMITS | {"max_batch_size": 32}  # 64 texts: the text encoders' peak is above the start's
    threads = estimate("tiny-sd", dtype="float32", size=(64, 64), decode_stage=False, encode_stage=True,
                       max_encode_ahead=4, **limits)
    workers = estimate("tiny-sd", dtype="float32", size=(64, 64), decode_stage=False, encode_workers=1,
                       max_encode_ahead=4, **limits)
    assert workers.encode_stage is True and workers.encode_ahead == threads.encode_ahead > 0
    moved = {name for name in threads.weights if name.startswith("text_encoder")}
    assert moved and moved == set(workers.host_weights) and not moved & set(workers.weights)
    assert 0 < workers.worst["encode"] < threads.worst["encode"]
    assert workers.needed < threads.needed - sum(workers.host_weights.values())
    assert "text encoders in 1 encode process(es) off this GPU" in render(workers)


def test_auto_turns_the_decode_stage_on_per_card_where_the_pool_keeps_half():
    """As start-up chooses (memory_profile.choose_decode_stage): a card where the stage's reservation leaves the
    pool at least half of what it has without it runs the stage; one where it would take more does not."""
    auto = estimate("tiny-sd", dtype="float32", size=(64, 64), **LIMITS)
    cost = auto.needed_for(True) - auto.needed_for(False)
    assert auto.decode_stage is None and cost > 0 and auto.needed == auto.needed_for(False)
    roomy = (auto.needed_for(False) + 4 * cost) / GIB / 0.9   # with the stage: 3/4 of the pool left
    tight = (auto.needed_for(False) + 1.5 * cost) / GIB / 0.9  # with the stage: 1/3 of the pool left
    cards = estimate("tiny-sd", dtype="float32", size=(64, 64), cards_gib=(roomy, tight), **LIMITS).cards
    (on, off) = cards.values()
    assert on["decode_stage"] and not off["decode_stage"]
    assert on["pool_bytes"] == pytest.approx(3 * cost, abs=2) and off["pool_bytes"] == pytest.approx(1.5 * cost, abs=2)
    assert "needed with the decode stage (auto)" in render(auto) and "decode stage on" in render(auto)
