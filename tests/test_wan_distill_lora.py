"""A step-distill LoRA mixed with undistilled requests of the same Wan base, in one batch.

LightX2V's 4-step LoRAs (Wan2.1 "lightx2v" / CausVid, Wan2.2-Lightning, Wan2.2-Distill-Loras) ship in the
original Wan checkpoint's key names (`diffusion_model.blocks.N.self_attn.q.lora_down.weight`, `.alpha`), with
bias deltas (`.diff_b`: a bias of B, peft's lora_bias) and the output head as a full delta (`head.head.diff`),
which diffusers' Wan loader converts; a distilled request runs a few steps at guidance 1.0 (no CFG rows) beside
undistilled ones at many steps with CFG. Each video must equal WanPipeline's run alone with the same seed,
steps, guidance and adapter weight (set_adapters), as frames and as latents."""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from conftest import tiny_wan_pipeline
from diffusers import WanPipeline
from safetensors.torch import save_file
from test_wan import LATENT_TOL, assert_batch_equals_pipeline, pipe_of
from test_wan import reference as wan_reference

from dvllm import DiffusionEngine, SamplingParams

P = SamplingParams
NAME = "lightning"
COMMON = dict(height=16, width=16, num_frames=5)
# Each request starts in the first step: A and C join B's forwards for their own steps (C's at half weight).
BATCH = [("a red circle moving to the right", P(num_inference_steps=4, guidance_scale=1.0, seed=1,
                                                loras={NAME: 1.0}, **COMMON)),
         ("a blue square", P(num_inference_steps=8, guidance_scale=5.0, seed=2, **COMMON)),
         ("a green star", P(num_inference_steps=2, guidance_scale=1.0, seed=3, loras={NAME: 0.5}, **COMMON))]


def lightx2v_style_lora(pipe: WanPipeline, path: str, seed: int, rank: int = 4, alpha: float = 8.0,
                        std: float = 0.2, biases: bool = True) -> str:
    """A random adapter for every attention and FFN Linear of `pipe`'s transformer blocks, written as LightX2V
    writes its distill LoRAs: the original Wan module names under `diffusion_model.`, lora_down / lora_up with an
    `.alpha` per layer, and the head's weight delta as a full-rank layer; with `biases`, a `.diff_b` per layer and
    the head's as `head.head.diff` and `head.head.diff_b`, as in lightx2v/Wan2.2-Distill-Loras (without, the head
    as lora_down / lora_up of its full rank: what diffusers makes of the `.diff`, without the bias)."""
    generator = torch.Generator().manual_seed(seed)
    original = {"attn1.to_q": "self_attn.q", "attn1.to_k": "self_attn.k", "attn1.to_v": "self_attn.v",
                "attn1.to_out.0": "self_attn.o", "attn2.to_q": "cross_attn.q", "attn2.to_k": "cross_attn.k",
                "attn2.to_v": "cross_attn.v", "attn2.to_out.0": "cross_attn.o", "ffn.net.0.proj": "ffn.0",
                "ffn.net.2": "ffn.2"}
    tensors = {}
    for i, block in enumerate(pipe.transformer.blocks):
        for ours, theirs in original.items():
            layer = block.get_submodule(ours)
            key = f"diffusion_model.blocks.{i}.{theirs}"
            tensors[f"{key}.lora_down.weight"] = torch.randn(rank, layer.in_features, generator=generator) * std
            tensors[f"{key}.lora_up.weight"] = torch.randn(layer.out_features, rank, generator=generator) * std
            tensors[f"{key}.alpha"] = torch.tensor(alpha)
            if biases:
                tensors[f"{key}.diff_b"] = torch.randn(layer.out_features, generator=generator) * std
    head = pipe.transformer.proj_out
    delta = torch.randn(head.out_features, head.in_features, generator=generator) * std
    if biases:
        tensors["diffusion_model.head.head.diff"] = delta
        tensors["diffusion_model.head.head.diff_b"] = torch.randn(head.out_features, generator=generator) * std
    else:
        tensors["diffusion_model.head.head.lora_down.weight"] = delta
        tensors["diffusion_model.head.head.lora_up.weight"] = torch.eye(head.out_features)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    save_file(tensors, path)
    return path


@pytest.fixture(scope="module")
def distill(tmp_path_factory):
    """The tiny Wan base with a distill-style LoRA loaded, and the diffusers pipeline with the same adapter."""
    folder = tmp_path_factory.mktemp("wan-distill")
    tiny_wan_pipeline().save_pretrained(folder / "wan")
    pipe = WanPipeline.from_pretrained(folder / "wan")  # loaded: in eval mode, as the engine's (no dropout)
    pipe.set_progress_bar_config(disable=True)
    lora = lightx2v_style_lora(pipe, str(folder / "lora" / "wan_t2v_lightx2v_4step.safetensors"), seed=7)
    engine = DiffusionEngine(model=str(folder / "wan"), device="cpu", dtype="float32", lora_modules={NAME: lora})
    pipe.load_lora_weights(lora, adapter_name=NAME)
    yield engine, pipe
    engine.shutdown()


def reference(pipe: WanPipeline, prompt: str, p: SamplingParams, output_type: str = "np") -> np.ndarray:
    """WanPipeline alone: the adapter at the request's weight (set_adapters), or LoRA off without one."""
    if p.loras:
        pipe.enable_lora()
        pipe.set_adapters(list(p.loras), adapter_weights=list(p.loras.values()))
    else:
        pipe.disable_lora()
    return wan_reference(pipe, prompt, p, output_type)


def test_distilled_and_undistilled_requests_share_forwards_and_each_equals_the_pipeline(distill):
    engine, pipe = distill
    rows_per_call = []
    hook = pipe_of(engine).transformer.register_forward_hook(
        lambda m, args, kwargs, out: rows_per_call.append(len(kwargs["hidden_states"])), with_kwargs=True)
    try:
        outs = assert_batch_equals_pipeline(engine, pipe, BATCH, reference_of=reference)
    finally:
        hook.remove()
    # Twice (frames, then latents): 8 forwards each, the longest request's steps. A's 4 and C's 2 steps ride
    # along: 1 + 2 + 1 rows while all run, 2 (B's CFG pair) once A finished, no CFG rows for A and C.
    assert rows_per_call == 2 * ([4, 4, 3, 3] + [2] * 4), rows_per_call
    # The checks can fail: the adapter moves A's latents far past their tolerance, and half its weight is
    # another video than its full weight.
    prompt, a = BATCH[0]
    for change in ({"loras": None}, {"loras": {NAME: 0.5}}):
        other = reference(pipe, prompt, P(**{**vars(a), **change}), "latent")[0]
        assert float(np.abs(outs[0].images[0].numpy() - other).max()) > 20 * LATENT_TOL, change


def test_distilled_requests_alone_and_without_undistilled_rows_equal_the_pipeline(distill):
    """The layers' other paths: one row with its adapter (every row adapted, one set), and A and C without B
    (every row adapted, each its own weight)."""
    engine, pipe = distill
    for batch in ([BATCH[2]], [BATCH[0], BATCH[2]]):
        params = [P(**{**vars(p), "output_type": "latent"}) for _, p in batch]
        outs = engine.generate([q for q, _ in batch], params, use_tqdm=False)
        for (prompt, _), p, out in zip(batch, params, outs):
            assert out.error is None, out.error
            want = reference(pipe, prompt, p, "latent")[0]
            assert float(np.abs(out.images[0].numpy() - want).max()) <= LATENT_TOL, (prompt, len(batch))


def test_biased_adapters_replay_captured_graphs_with_the_eager_videos(distill, tmp_path):
    """A forward whose adapters add biases is captured as its own graph (the layers' bias is part of its key: an
    adapter without biases on the same layers, run first, captures graphs that add none) and replayed by a batch
    with another biased adapter, other weights and seeds (graph_emulator.py)."""
    from graph_emulator import emulated_capture

    from dvllm.worker.denoiser import Denoiser

    engine, pipe = distill
    added = {name: lightx2v_style_lora(pipe, str(tmp_path / name / "lora.safetensors"), seed=seed, biases=biased)
             for name, seed, biased in (("plain", 9, False), ("other", 8, True))}
    for name, path in added.items():
        engine.load_lora(name, path)
    graphed = DiffusionEngine(model=engine.config.model, device="cpu", dtype="float32",
                              lora_modules={NAME: engine.loras.list()[0]["file"], **added})
    runner = graphed.executor.worker.runner
    runner.denoiser = Denoiser(runner.adapter, graphed.config, capture=emulated_capture)
    latents = [(q, P(**{**vars(p), "output_type": "latent"})) for q, p in BATCH]
    batches = [[(q[::-1], P(**{**vars(p), "seed": p.seed + 10 * n, "loras": p.loras and {name: 0.8 - 0.6 * i}}))
                for i, (q, p) in enumerate(latents)] for n, name in enumerate(("plain", NAME, "other"))]
    try:
        for batch in batches:
            prompts, params = [q for q, _ in batch], [p for _, p in batch]
            want = engine.generate(prompts, params, use_tqdm=False)
            got = graphed.generate(prompts, params, use_tqdm=False)
            for w, g in zip(want, got):
                assert g.error is None, g.error
                np.testing.assert_allclose(g.images[0].numpy(), w.images[0].numpy(), atol=1e-5, rtol=0)
    finally:
        for name in added:
            engine.unload_lora(name)
    graphs = runner.denoiser.graphs
    assert graphs and all(g is not None for g in graphs.values()), "a capture failed"
    # Two LoRA structures (steps 1-2: A and C adapted beside B; steps 3-4: A beside B), each once without biases
    # (2 steps) and once with them, captured by the second batch and replayed by the third (2 steps x 2 batches)
    assert sorted(g.graph.replays for g in graphs.values() if g.lora is not None) == [2, 2, 4, 4]
    graphed.shutdown()


def test_a_step_with_biased_adapters_reads_nothing_back(distill):
    """Which layers add a bias is known on the host: the mixed step (A and C adapted, each its own weight, beside
    B's CFG rows, Wan's own UniPC for all three) waits on nothing."""
    from host_syncs import HostSyncs
    from test_host_syncs import _own_sites

    engine, _ = distill
    for i, (prompt, p) in enumerate(BATCH):
        engine.add_request(f"sync-{i}", prompt, p)
    engine.step()  # admission (encoding reads the texts' lengths once) and the first step
    with HostSyncs() as syncs:
        outputs = engine.step()
    assert not [o.error for o in outputs if o.error], outputs
    assert not _own_sites(syncs), syncs.report()
    while engine.has_unfinished_requests():
        engine.step()


def test_an_adapters_folder_defaults_steps_and_guidance_for_the_requests_naming_it(distill, tmp_path):
    """`dvllm_defaults.json` beside a distill LoRA: a request naming it and setting neither steps nor guidance runs
    the adapter's 4 steps without CFG (and equals the pipeline so run); what a request sets, and requests without
    the adapter, keep their own. Two adapters that disagree on a field the request leaves unset are refused."""
    import json
    import shutil
    from types import SimpleNamespace

    from dvllm.entrypoints.api_server import _model_cards

    engine, pipe = distill
    folder = tmp_path / "lightning-4step"
    folder.mkdir()
    shutil.copy(engine.loras.list()[0]["file"], folder)
    (folder / "dvllm_defaults.json").write_text(json.dumps({"num_inference_steps": 4, "guidance_scale": 1.0}))
    engine.load_lora("distilled", str(folder))
    engine.load_lora("plain-file", str(next(folder.glob("*.safetensors"))))  # a file path: its folder's file unread
    try:
        process = engine.processor.process
        request = process("r", "x", P(loras={"distilled": 1.0}, **COMMON))
        assert (request.params.num_inference_steps, request.params.guidance_scale, request.cfg) == (4, 1.0, False)
        own = process("r", "x", P(loras={"distilled": 1.0}, num_inference_steps=6, **COMMON)).params
        assert (own.num_inference_steps, own.guidance_scale) == (6, 1.0)
        cards = _model_cards(SimpleNamespace(engine=engine, created=0, model_name="wan", model_facts={}), False)
        shown = {card.id: card.model_dump(exclude_none=True).get("dvllm") for card in cards[1:]}
        assert shown["distilled"] == {"num_inference_steps": 4, "guidance_scale": 1.0}  # what /v1/models says
        assert shown["plain-file"] is None and shown[NAME] is None
        model = engine.model_info.defaults
        for params in (P(**COMMON), P(loras={"plain-file": 1.0}, **COMMON)):
            resolved = process("r", "x", params).params
            assert (resolved.num_inference_steps, resolved.guidance_scale) == (model.steps, model.guidance)
        (folder / "dvllm_defaults.json").write_text(json.dumps({"num_inference_steps": 8}))
        engine.load_lora("eight", str(folder))
        with pytest.raises(ValueError, match="adapters 'distilled' and 'eight' default num_inference_steps to 4 "
                                             "and 8; set num_inference_steps in the request"):
            process("r", "x", P(loras={"distilled": 1.0, "eight": 1.0}, **COMMON))
        prompt = "a red circle moving to the right"
        params = P(loras={"distilled": 1.0}, seed=1, output_type="latent", **COMMON)
        out = engine.generate(prompt, params, use_tqdm=False)[0]
        assert out.error is None, out.error
        pipe.load_lora_weights(str(folder / next(folder.glob("*.safetensors")).name), adapter_name="distilled")
        want = reference(pipe, prompt, P(**{**vars(params), "num_inference_steps": 4, "guidance_scale": 1.0}),
                         "latent")[0]
        assert float(np.abs(out.images[0].numpy() - want).max()) <= LATENT_TOL
    finally:
        for name in ("distilled", "plain-file", "eight"):
            if any(entry["name"] == name for entry in engine.loras.list()):
                engine.unload_lora(name)


def test_an_adapters_defaults_file_may_set_only_what_a_request_sets(distill, tmp_path):
    import json
    import shutil

    engine, _ = distill
    shutil.copy(engine.loras.list()[0]["file"], tmp_path)
    (tmp_path / "dvllm_defaults.json").write_text(json.dumps({"num_inference_steps": 4, "height": 32}))
    with pytest.raises(ValueError, match=r"may set num_inference_steps, guidance_scale, sampler only, not "
                                         r"\['height'\]"):
        engine.load_lora("sized", str(tmp_path))


def test_a_lightning_merged_wan_runs_its_cards_four_steps_without_cfg(tmp_path, monkeypatch):
    """The known table's Lightning-merged Wan 2.2 A14B (models/model_defaults.py): a request that sets nothing runs
    4 steps at guidance 1.0 for both experts, so no CFG rows, where Wan-AI's own A14B runs 40 with CFG. A tiny
    two-expert Wan stands in for the repo, under its Hub id (as in test_model_defaults.py)."""
    from dvllm.models import model_defaults

    hub_id = "FastDM/Wan2.2-T2V-A14B-Merge-Lightning-V1.0-Diffusers"
    assert model_defaults.known_defaults(hub_id) == {"height": 720, "width": 1280, "num_inference_steps": 4,
                                                     "guidance_scale": 1.0, "guidance_scale_2": 1.0}
    folder = tmp_path / "lightning-merge"
    tiny_wan_pipeline(two_experts=True).save_pretrained(folder)
    monkeypatch.setitem(model_defaults.KNOWN_DEFAULTS, str(folder).lower(),
                        {**model_defaults.known_defaults(hub_id), "height": 16, "width": 16})  # (CPU-sized)
    merged = DiffusionEngine(model=str(folder), device="cpu", dtype="float32")
    params = merged.processor.process("r", "x", P(num_frames=5)).params
    assert (params.num_inference_steps, params.guidance_scale, params.guidance_scale_2) == (4, 1.0, 1.0)
    assert not merged.processor.process("r", "x", P(num_frames=5)).cfg
    merged.shutdown()


def test_on_two_experts_an_adapter_changes_the_high_noise_expert_as_diffusers_loads_it(tmp_path_factory):
    """Wan 2.2 A14B: `load_lora_weights` without `load_into_transformer_2` loads into `transformer` only, and so does
    dvllm (a Lightning LoRA's low-noise half is not served: docs/lora.md). A distilled row beside a two-scale CFG
    row equals the pipeline's."""
    from conftest import _saved

    path = _saved(tmp_path_factory, "tiny-wan-a14b-distill", tiny_wan_pipeline(two_experts=True))
    pipe = WanPipeline.from_pretrained(path)
    pipe.set_progress_bar_config(disable=True)
    lora = lightx2v_style_lora(pipe, str(tmp_path_factory.mktemp("high") / "high_noise_model.safetensors"), seed=5)
    engine = DiffusionEngine(model=path, device="cpu", dtype="float32", lora_modules={NAME: lora})
    pipe.load_lora_weights(lora, adapter_name=NAME)
    batch = [BATCH[0], ("a blue square", P(**{**vars(BATCH[1][1]), "guidance_scale_2": 3.0}))]
    outs = engine.generate([q for q, _ in batch], [P(**{**vars(p), "output_type": "latent"}) for _, p in batch],
                           use_tqdm=False)
    for (prompt, p), out in zip(batch, outs):
        assert out.error is None, out.error
        want = reference(pipe, prompt, p, "latent")[0]
        assert float(np.abs(out.images[0].numpy() - want).max()) <= LATENT_TOL, prompt
    # the adapter's layers are the high-noise expert's only (the second expert ran its rows unadapted)
    assert {component for component, _ in engine.executor.worker.runner.lora.tables} == {"transformer"}
    engine.shutdown()


@pytest.mark.slow
def test_a_sequence_parallel_group_gives_one_workers_videos_with_biased_adapters(distill):
    """Each member reads its own copy of the adapter's denoiser layers, biases with them (parallel/group_member.py);
    the group's videos are the single worker's within the group's bound on the CPU (test_wan_group.py's)."""
    engine, _ = distill
    batch = [(q, P(**{**vars(p), "output_type": "latent"})) for q, p in BATCH]
    want = engine.generate([q for q, _ in batch], [p for _, p in batch], use_tqdm=False)
    group = DiffusionEngine(model=engine.config.model, device="cpu", dtype="float32", sequence_parallel_size=2,
                            lora_modules={NAME: engine.loras.list()[0]["file"]})
    try:
        got = group.generate([q for q, _ in batch], [p for _, p in batch], use_tqdm=False)
        for g, w in zip(got, want):
            assert g.error is None, g.error
            assert float(np.abs(g.images[0].numpy() - w.images[0].numpy()).max()) <= 1e-5
    finally:
        group.shutdown()
