"""Captured forwards replayed, proven on the CPU with graph_emulator.py (a CUDA graph's semantics: the ops of
one recorded forward, run again on the same tensors): every family, with and without LoRA rows, gives the
eager engine's images when its steps replay graphs captured by other batches, with other seeds, weights,
adapters and guidance; the gather writes each step's inputs straight into the graph's static buffers."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from graph_emulator import EmulatedGraph, UncapturableOp, emulated_capture
from lora_utils import make_lora
from test_host_syncs import FAMILIES, _requests, kontext_path  # noqa: F401  (kontext_path: a fixture)

from dvllm import DiffusionEngine, EngineConfig
from dvllm.models.layout import BatchLayout
from dvllm.worker.denoiser import Denoiser, ForwardInputs
from dvllm.worker.forward_context import ForwardHooks
from dvllm.worker.lora_layers import LoraLayers


class RowWiseAdapter:
    """A stand-in whose output row depends only on its own input row, like a real denoiser."""

    device = torch.device("cpu")

    def denoise(self, latents, timesteps, conditions, guidance, layout):
        scale = (timesteps + guidance)[:, None, None, None]
        return latents * scale + conditions["prompt_embeds"].mean(dim=(1, 2))[:, None, None, None]

    def graph_key(self, layout):
        return layout.image_size


def _inputs(rows: int, seed: int) -> ForwardInputs:
    g = torch.Generator().manual_seed(seed)
    return ForwardInputs(torch.randn(rows, 4, 2, 2, generator=g), torch.rand(rows, generator=g),
                         torch.rand(rows, generator=g), {"prompt_embeds": torch.randn(rows, 3, 5, generator=g)})


def _padded(inputs: ForwardInputs, rows: int) -> ForwardInputs:
    def pad(t):
        return torch.cat([t, t[-1:].expand(rows - len(t), *t.shape[1:])])
    return ForwardInputs(pad(inputs.latents), pad(inputs.timesteps), pad(inputs.guidance),
                         {k: pad(v) for k, v in inputs.conditions.items()})


def test_a_graph_replays_from_its_own_buffers_written_in_place():
    adapter = RowWiseAdapter()
    denoiser = Denoiser(adapter, EngineConfig(max_batch_size=4), capture=emulated_capture)
    lora = LoraLayers(None, 1, 4, ForwardHooks())
    layout = BatchLayout.single((16, 16), 3)
    first = denoiser.plan(layout, ((4, 2, 2), 0), lora)
    assert first.layout.num_rows == 4 and first.buffers is None  # padded to the bucket; nothing captured yet
    out = denoiser(first, _padded(_inputs(3, 0), 4), lora.hooks)
    torch.testing.assert_close(out, adapter.denoise(*_inputs(3, 0).args(), None))
    second = denoiser.plan(layout, ((4, 2, 2), 0), lora)
    buffers = second.buffers
    assert buffers is not None  # the captured graph's static inputs: the next batch writes into them
    new = _inputs(3, 1)
    for mine, theirs in zip(buffers.args(), _padded(new, 4).args()):
        for a, b in (zip(mine.values(), theirs.values()) if isinstance(mine, dict) else [(mine, theirs)]):
            a.copy_(b)
    out = denoiser(second, buffers, lora.hooks)
    graph = denoiser.graphs[second.key]
    assert isinstance(graph.graph, EmulatedGraph) and graph.graph.replays == 2  # its capture's, and this one
    assert out.data_ptr() == graph.output.data_ptr()  # the graph's own output buffer, no copy
    torch.testing.assert_close(out, adapter.denoise(*new.args(), None))
    with pytest.raises(RuntimeError, match="gathered into its buffers"):
        denoiser(second, _padded(new, 4), lora.hooks)


def test_the_emulator_refuses_what_a_capture_cannot_hold():
    with pytest.raises(UncapturableOp):
        emulated_capture(lambda: torch.ones(2) * torch.ones(1).sum().item())
    with pytest.raises(UncapturableOp):
        emulated_capture(lambda: torch.arange(4.0)[torch.arange(4) > 1])
    # and what it records replays on new inputs, as a graph would
    x = torch.zeros(3)
    graph, out = emulated_capture(lambda: (x * 2 + 1).exp())
    x.copy_(torch.tensor([1.0, 2.0, 3.0]))
    graph.replay()
    torch.testing.assert_close(out, (x * 2 + 1).exp())


@pytest.fixture(scope="module")
def two_loras(tmp_path_factory) -> dict[str, tuple[str, str]]:
    return {}


def _engine(path: str, graphs: bool, loras: tuple[str, str] | None) -> DiffusionEngine:
    engine = DiffusionEngine(model=path, device="cpu", dtype="float32", enable_lora=loras is not None)
    if loras:
        engine.load_lora("l", loras[0])
        engine.load_lora("m", loras[1])
    if graphs:
        runner = engine.executor.worker.runner
        runner.denoiser = Denoiser(runner.adapter, engine.config, capture=emulated_capture)
    return engine


def _batches(edit: bool, unet: bool, lora: bool) -> list[list]:
    """Two batches of one layout with other seeds, texts, guidance and adapters: the second replays graphs
    the first captured."""
    first = [(p, dataclasses.replace(s, output_type="np")) for p, s in _requests(edit, unet, lora, None, steps=3)]
    second = []
    for i, (prompt, params) in enumerate(first):
        loras = params.loras and {"m": -0.6}  # another adapter and weight, the same structure: one graph
        second.append((prompt[::-1] or "y", dataclasses.replace(params, seed=params.seed + 10,
                                                                 guidance_scale=params.guidance_scale + 0.5 * i,
                                                                 loras=loras)))
    return [first, second]


@pytest.mark.parametrize("lora", [False, True], ids=["plain", "lora"])
@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.slow
def test_every_family_replays_captured_forwards_with_the_eager_images(family, lora, request, two_loras,
                                                                     tmp_path_factory):
    fixture, edit, unet = FAMILIES[family]
    path = request.getfixturevalue(fixture)
    loras = None
    if lora:
        if path not in two_loras:
            from diffusers import DiffusionPipeline
            pipe = DiffusionPipeline.from_pretrained(path)
            two_loras[path] = tuple(make_lora(pipe, str(tmp_path_factory.mktemp("lora")), seed=s) for s in (0, 1))
        loras = two_loras[path]
    eager, graphed = _engine(path, False, loras), _engine(path, True, loras)
    for batch in _batches(edit, unet, lora):
        prompts, params = [p for p, _ in batch], [s for _, s in batch]
        want = eager.generate(prompts, params, use_tqdm=False)
        got = graphed.generate(prompts, params, use_tqdm=False)
        for w, g in zip(want, got):
            assert g.error is None, g.error
            for a, b in zip(g.images, w.images):
                # the same kernels on the same rows; only the bucket's padding rows are extra
                np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)
    graphs = graphed.executor.worker.runner.denoiser.graphs
    assert graphs and all(g is not None for g in graphs.values()), f"{family}: a capture failed"
    assert all(g.graph.replays >= 2 for g in graphs.values())  # captured once, replayed by later steps
    if lora:  # the LoRA rows' forward ran from one graph for both batches: 3 steps each
        assert max(g.graph.replays for g in graphs.values() if g.lora is not None) == 6
