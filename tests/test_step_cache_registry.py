"""A step-cache method is one module and one registry line: the registry is the only place in dvllm/ that names
the methods, and a method the registry names is served end to end (parsed, sized, admitted, run per request
inside a shared forward, counted) with nothing else changed."""
from __future__ import annotations

import ast
import dataclasses
import pathlib
from typing import Any, Callable

import numpy as np

from dvllm import DiffusionEngine, SamplingParams
from dvllm.step_caches import registry
from dvllm.step_caches.blocks_residual import BlocksResidualRows
from dvllm.step_caches.method import CacheMethod, MethodRows, check_integer, hidden_residuals
from dvllm.step_caches.registry import served_methods


def test_the_registry_is_the_only_place_that_names_the_methods():
    """No other module of dvllm/ holds a method's name as a string (to compare a config's method with, or to
    list the methods). The benchmark traces name the caches they measure: data, not dispatch."""
    root = pathlib.Path(__file__).resolve().parent.parent / "dvllm"
    allowed = {root / "step_caches", root / "benchmarks" / "traces.py"}
    found = []
    for path in root.rglob("*.py"):
        if any(path == a or a in path.parents for a in allowed):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and node.value in registry.METHODS:
                found.append(f"{path.relative_to(root)}:{node.lineno}: {node.value!r}")
    assert not found, found


class EveryOther(CacheMethod):
    """A toy method: after its first step, a request skips every block on every `period`th step."""

    name = "every_other"
    fields = {"period": 2}

    def check(self, config: Any, given: set[str]) -> Any:
        check_integer(config, "period", 2, 100)
        return config

    def row_numel(self, config: Any, layout: Any, tokens: Callable[[str], int]) -> int:
        return hidden_residuals(1, layout, tokens)

    def rows(self, forward: Any, groups: list) -> MethodRows:
        return EveryOtherRows(forward, groups)


class EveryOtherRows(BlocksResidualRows):
    def __init__(self, forward: Any, groups: list) -> None:
        super().__init__(forward, groups)
        for g in groups:
            g.computes = not g.state.primed or g.step % g.state.config.period != 0
            g.new = g.data if g.computes else None

    def commit(self, state: Any, groups: list) -> None:
        state.primed = state.primed or any(g.computes for g in groups)


def test_a_method_the_registry_names_is_served_with_nothing_else_changed(flux_path, monkeypatch):
    monkeypatch.setitem(registry.METHODS, EveryOther.name, EveryOther())
    engine = DiffusionEngine(model=flux_path, device="cpu", dtype="float32")
    assert "every_other" in served_methods(engine.processor.info)
    base = dict(height=16, width=16, output_type="np")
    toy = SamplingParams(num_inference_steps=7, seed=1, cache={"method": "every_other", "period": 3}, **base)
    others = [SamplingParams(num_inference_steps=5, seed=2, **base),
              SamplingParams(num_inference_steps=6, seed=3, cache={"method": "first_block"}, **base)]
    outs = engine.generate(["a red circle", "a blue square", "a green star"], [toy, *others], use_tqdm=False)
    assert [o.error for o in outs] == [None] * 3
    assert outs[0].metrics.cached_steps == 2  # steps 3 and 6
    alone = engine.generate("a red circle", toy, use_tqdm=False)[0]
    uncached = engine.generate("a red circle", dataclasses.replace(toy, cache=None), use_tqdm=False)[0]
    assert float(np.abs(alone.images[0] - outs[0].images[0]).max()) <= 1e-5
    assert float(np.abs(alone.images[0] - uncached.images[0]).max()) > 1e-6, "skipping must change the image"
