"""The combination matrix: every served family crossed pairwise with the engine's documented modes (decode stage
and workers, encode stage and workers, the core's process, async scheduling, the result cache, LoRA rows, step
caching, cfg- and sequence-parallel groups, the CUDA-graph emulator, compile, torchao quantization, VAE tiling,
max_running_pixels, priority preemption, request-level batching, ControlNet). Every pair of values appears together in at least one cell; each cell
gives the plain engine's images (combination_matrix.py says what that is), or its pair is refused at start with
a message naming both sides. Never a failed request, a hang or a 500. README.md's table lists the refusals."""
from __future__ import annotations

import os
import re
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch.distributed as dist
from combination_matrix import (COSTS, FACTORS, TOL, Family, Models, References, engine_options, jobs_for,
                                run_cell)
from pairwise import Pair, all_pairs, covering_rows, pairs_of
from process_tree import descendants, process_name, zombie

from dvllm import AsyncDiffusionEngine, EngineConfig
from dvllm.engine.start_checks import check_at_start


def pair(a: tuple[str, Any], b: tuple[str, Any]) -> Pair:
    return frozenset((a, b))


def _refusals() -> dict[Pair, tuple[str, ...]]:
    """Pairs the engine refuses at start -> words its message must hold (both sides named)."""
    refused: dict[Pair, tuple[str, ...]] = {}
    for group in ("cfg", "sp"):
        refused[pair(("group", group), ("compile", True))] = ("worker group", "compile")
        refused[pair(("group", group), ("graphs", True))] = ("worker group", "cuda_graph")
    refused[pair(("encode", "workers"), ("lora", True))] = ("encode_workers", "LoRA")
    for family in NO_STEP_CACHE:
        refused[pair(("family", family), ("step_cache", True))] = ("default_cache", "serves no step caching")
    for family, denoiser in NO_SEQUENCE_PLAN.items():
        refused[pair(("family", family), ("group", "sp"))] = ("sequence_parallel_size", denoiser)
    for family in FACTORS["family"]:
        if family not in CONTROLNET_FAMILIES and family not in CONTROLNET_ELSEWHERE:
            refused[pair(("family", family), ("controlnet", True))] = ("controlnets", "takes no ControlNet")
    for group in ("cfg", "sp"):
        refused[pair(("group", group), ("controlnet", True))] = ("worker group", "controlnets")
    refused[pair(("step_cache", True), ("controlnet", True))] = ("controlnets", "default_cache")
    return refused


# Families whose adapters give the step-cache hooks nowhere to sit, and those whose denoiser diffusers has no
# context-parallel plan for (so its tokens cannot be split)
NO_STEP_CACHE = ("sd", "sdxl", "kontext", "qwen-image-edit", "inpaint")
NO_SEQUENCE_PLAN = {"sd": "UNet2DConditionModel", "sdxl": "UNet2DConditionModel", "inpaint": "UNet2DConditionModel",
                    "sd3": "SD3Transformer2DModel", "z-image": "ZImageTransformer2DModel"}
# The families whose cells load the tiny SD ControlNets, and those served with their own controlnets by their own
# tests (Flux's, SD3's, Qwen-Image's and Z-Image's are other models; an inpainting UNet's requests bring an image and
# a mask): those pairs are served, not crossed with every mode here yet
CONTROLNET_FAMILIES = ("sd", "sdxl")
CONTROLNET_ELSEWHERE = {"flux": "test_controlnet_flux.py", "sd3": "test_controlnet_sd3.py",
                        "qwen-image": "test_controlnet_qwen.py", "z-image": "test_controlnet_z_image.py",
                        "inpaint": "test_controlnet_inputs.py"}
REFUSED = _refusals()
ELSEWHERE = {pair(("family", family), ("controlnet", True)): test for family, test in CONTROLNET_ELSEWHERE.items()}
# Pairs served, but which this CPU harness cannot build: the emulator replaces the denoiser of a worker in the
# test's process, and with the core's process the worker is in another
NOT_ON_CPU = {pair(("graphs", True), ("core", "process")):
              "the CUDA-graph emulator patches the test's process; the engine core's process has its own worker"}
XDIST_SPLIT = 2  # the longest file: its cells are dealt to two workers (tests/xdist_order.py)
ROWS = covering_rows(FACTORS, lambda p: p in REFUSED or p in NOT_ON_CPU or p in ELSEWHERE,
                     lambda value: COSTS.get(value, 0))


def row_id(index: int, row: dict[str, Any]) -> str:
    plain = {name: values[0] for name, values in FACTORS.items()}
    shown = [row["family"]] + [name if value is True else f"{name}={value}" for name, value in row.items()
                               if name != "family" and value != plain[name]]
    return f"{index:02d}-" + ",".join(shown)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> Models:
    return Models(tmp_path_factory.mktemp("matrix"))


@pytest.fixture(scope="module")
def references():
    refs = References()
    yield refs
    refs.close()


def test_the_cells_hold_every_pair_but_the_refused_and_none_of_those():
    covered = set().union(*(pairs_of(row) for row in ROWS))
    allowed = {p for p in all_pairs(FACTORS) if p not in REFUSED and p not in NOT_ON_CPU and p not in ELSEWHERE}
    assert allowed <= covered and not (covered & (REFUSED.keys() | NOT_ON_CPU.keys() | ELSEWHERE.keys()))
    assert len(ROWS) < 0.01 * np.prod([len(v) for v in FACTORS.values()])  # pairwise, not the product


def test_the_cells_are_the_same_in_every_process():
    """The covering array does not depend on string hashing (which differs per process): the cells' ids are the
    same wherever the module is collected."""
    import json
    import subprocess
    import sys

    code = ("import json, sys; sys.path.insert(0, sys.argv[1]); from pairwise import covering_rows; "
            "f, refused, costs = json.loads(sys.stdin.read()); "
            "forbid = {frozenset(map(tuple, p)) for p in refused}; "
            "cost = {(k, v): c for k, v, c in costs}; "
            "print(json.dumps(covering_rows(f, lambda p: p in forbid, lambda v: cost.get(v, 0))))")
    data = json.dumps([FACTORS, [sorted(p) for p in [*REFUSED, *NOT_ON_CPU, *ELSEWHERE]],
                       [[*k, c] for k, c in COSTS.items()]])
    for seed in ("1", "2"):
        done = subprocess.run([sys.executable, "-c", code, str(Path(__file__).parent)], input=data, text=True,
                              capture_output=True, env={**os.environ, "PYTHONHASHSEED": seed}, timeout=120,
                              check=True)
        assert json.loads(done.stdout) == ROWS


class _Emulator:
    """Installs the CUDA-graph emulator as the worker's capture, and keeps the denoiser to check its graphs."""

    def __init__(self) -> None:
        self.denoiser = None

    def __call__(self, engine: Any) -> None:
        from graph_emulator import emulated_capture

        from dvllm.worker.denoiser import Denoiser

        runner = engine.executor.worker.runner
        runner.denoiser = self.denoiser = Denoiser(runner.adapter, engine.config, capture=emulated_capture)


@pytest.mark.slow
@pytest.mark.parametrize("row", ROWS, ids=[row_id(i, row) for i, row in enumerate(ROWS)])
def test_each_cell_gives_the_plain_engines_images(row, models, references):
    family = models.families[row["family"]]
    path = models.path(row["family"])
    loras = models.loras(row["family"]) if row["lora"] else {}
    nets = models.controlnets(row["family"]) if row["controlnet"] else {}
    jobs = jobs_for(row, family)
    emulator = _Emulator()
    result = run_cell(path, row, family, jobs, loras, emulator, nets)
    for job in jobs:
        out = result.outputs[job.name]
        assert out is not None and out.finished and out.error is None, f"{job.name}: {out and out.error}"
        want = references.images(path, row, family, loras, job, nets)
        assert len(out.images) == len(want), job.name
        for got, expected in zip(out.images, want):
            np.testing.assert_allclose(np.asarray(got), expected, atol=TOL, rtol=0, err_msg=job.name)
    # each mode did what it is for, not only left the images alone
    if row["priority"]:  # the request-level policy runs a batch to completion: priority only orders batches
        assert (result.stats["num_preemptions"] >= 1) == (row["batching"] == "step")
    if row["result_cache"]:
        assert result.outputs["again"].metrics.result_cache_hit
    if row["step_cache"]:
        assert any(result.outputs[job.name].metrics.cached_steps for job in jobs)
    if row["graphs"]:  # no capture failed; forwards with step-cached rows run eagerly (the cache decides inside)
        graphs = emulator.denoiser.graphs
        assert all(g is not None for g in graphs.values()), [k for k, g in graphs.items() if g is None]
        assert row["step_cache"] or any(g.graph.replays >= 2 for g in graphs.values())


def _refusal_options(refused: Pair, family: Family, loras: dict[str, str],
                     nets: dict[str, str]) -> dict[str, Any]:
    """A cell with the refused pair and every other mode plain."""
    row = {name: values[0] for name, values in FACTORS.items()}
    row.update(dict(refused))
    options = engine_options(row, family, loras, nets)
    if row["graphs"]:  # a real CUDA graph: what the emulator stands in for
        options.update(device="cuda", cuda_graph=True)
    return options


@pytest.mark.slow
@pytest.mark.parametrize("refused", list(REFUSED), ids=["+".join(f"{k}={v}" for k, v in sorted(p)) for p in REFUSED])
def test_each_refused_pair_is_refused_at_start_naming_both(refused, models):
    values = dict(refused)
    name = values.get("family", "flux" if values.get("group") != "sp" else "flux")
    family = models.families[name]
    loras = models.loras(name) if values.get("lora") else {}
    nets = models.controlnets("sd") if values.get("controlnet") else {}  # (SD's: refused before they load)
    options = _refusal_options(refused, family, loras, nets)
    before = set(descendants(os.getpid()))
    with pytest.raises(ValueError) as error:
        if options.get("device") == "cuda":  # no GPU here: the config refuses it before any device is touched
            check_at_start(EngineConfig(model=models.path(name), **options))
        else:
            AsyncDiffusionEngine(model=models.path(name), dtype="float32", **{"device": "cpu", **options})
    for word in REFUSED[refused]:
        assert word in str(error.value), f"{sorted(refused)}: {error.value}"
    # and nothing it started is left behind: no process group, no member or stage process
    assert not dist.is_initialized()
    deadline = time.monotonic() + 120
    while left := [pid for pid in descendants(os.getpid())  # (the fork server stays: this process's, not the start's)
                   if pid not in before and not zombie(pid) and process_name(pid) != "dvllm-fork"]:
        assert time.monotonic() < deadline, f"processes left behind by a refused start: {left}"
        time.sleep(0.05)


def test_docs_options_md_lists_every_refused_pair():
    """docs/options.md's table of refused pairs (and of the pair not run on the CPU) is this module's."""
    text = (Path(__file__).parent.parent / "docs" / "options.md").read_text()
    assert f"({len(ROWS)} cells," in text
    table = text[text.index("<!-- refused-pairs -->"):text.index("<!-- /refused-pairs -->")]
    rows = [line for line in table.splitlines() if line.startswith("| `")]
    listed = {frozenset(re.findall(r"`([^`]+)`", line)[:2]) for line in rows}
    expected = {frozenset(README_NAMES[v] for v in p) for p in [*REFUSED, *NOT_ON_CPU, *ELSEWHERE]}
    assert listed == expected


def _readme_names() -> dict[tuple[str, Any], str]:
    """How README.md's table names a factor's value (a flag, or a family)."""
    names: dict[tuple[str, Any], str] = {("family", f): f for f in FACTORS["family"]}
    names.update({("group", "cfg"): "--cfg-parallel-size", ("group", "sp"): "--sequence-parallel-size",
                  ("compile", True): "--compile", ("graphs", True): "--cuda-graph",
                  ("encode", "workers"): "--encode-workers", ("lora", True): "--lora-modules",
                  ("step_cache", True): "--default-cache", ("core", "process"): "--engine-core-process",
                  ("controlnet", True): "--controlnet"})
    return names


README_NAMES = _readme_names()
