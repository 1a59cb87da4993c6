"""Many LoRA adapters in one batch: each request's image equals the diffusers pipeline's for that request
alone, after `load_lora_weights` for each adapter and `set_adapters(names, adapter_weights)` (LoRA off for
a request without any), alone and inside one mixed batch; for SD 1.x and SDXL UNets and the Flux,
Qwen-Image, SD3 and Z-Image transformers, with adapters made by peft on the tiny pipelines and saved with
save_lora_weights.

Two adapters per family: "full" changes the denoiser and every LoRA-loadable text encoder, with alpha 8 at
rank 4 in its metadata (scale 2); "plain" changes the denoiser only, at rank 8, saved without metadata (so
alpha = rank, scale 1).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from dvllm import DiffusionEngine, SamplingParams
from lora_utils import allow_peft_for_transformers, fail_first_load, make_lora, reference_images

TOL = 1e-3
P = SamplingParams


def _family(tmp_path_factory, name: str, make, text_encoders: tuple[str, ...]) -> dict:
    pipe = make()
    folder = tmp_path_factory.mktemp(name)
    pipe.save_pretrained(folder / "model")
    denoiser = "unet" if hasattr(pipe, "unet") else "transformer"
    return {
        "path": str(folder / "model"), "class": type(pipe).__name__,
        "adapters": {
            "full": make_lora(pipe, str(folder / "full"), seed=11, components=(denoiser, *text_encoders)),
            "plain": make_lora(pipe, str(folder / "plain"), seed=12, rank=8, metadata=False),
        },
    }


@pytest.fixture(scope="module")
def families(tmp_path_factory) -> dict:
    from conftest import (tiny_flux_pipeline, tiny_qwen_image_pipeline, tiny_sd3_pipeline, tiny_sd_pipeline,
                          tiny_sdxl_pipeline, tiny_z_image_pipeline)

    return {
        "sd": _family(tmp_path_factory, "lora-sd", tiny_sd_pipeline, ("text_encoder",)),
        "sdxl": _family(tmp_path_factory, "lora-sdxl", tiny_sdxl_pipeline, ("text_encoder", "text_encoder_2")),
        "flux": _family(tmp_path_factory, "lora-flux", tiny_flux_pipeline, ("text_encoder",)),
        "qwen": _family(tmp_path_factory, "lora-qwen", tiny_qwen_image_pipeline, ()),
        "sd3": _family(tmp_path_factory, "lora-sd3", tiny_sd3_pipeline, ("text_encoder", "text_encoder_2")),
        "z-image": _family(tmp_path_factory, "lora-z-image", tiny_z_image_pipeline, ()),
    }


def _reference(family: dict, prompt: str, p: SamplingParams) -> np.ndarray:
    import diffusers

    cache = family.setdefault("_pipe", {})
    if "pipe" not in cache:
        cache["pipe"] = getattr(diffusers, family["class"]).from_pretrained(family["path"])
        cache["pipe"].set_progress_bar_config(disable=True)
    pipe = cache["pipe"]
    guidance = {"true_cfg_scale": p.guidance_scale} if family["class"] == "QwenImagePipeline" \
        else {"guidance_scale": p.guidance_scale}
    return reference_images(pipe, family["adapters"], p.loras, prompt=prompt, negative_prompt=p.negative_prompt,
                            num_inference_steps=p.num_inference_steps, height=p.height, width=p.width,
                            num_images_per_prompt=p.n, output_type="np",
                            generator=torch.Generator("cpu").manual_seed(p.seed), **guidance)


def _mixed_batch(name: str) -> list[tuple[str, SamplingParams]]:
    """No LoRA, one adapter, two with weights, the same adapter at another weight, other steps, guidance
    and sizes. Qwen-Image runs CFG only with a negative prompt: some requests carry one."""
    neg = {"negative_prompt": "blurry"} if name == "qwen" else {}
    base = dict(num_inference_steps=4, guidance_scale=4.0, height=32, width=32, output_type="np")
    return [
        ("a red circle", P(**base, seed=1, **neg)),
        ("a red circle", P(**base, seed=1, loras={"full": 1.0}, **neg)),
        ("a blue square", P(**{**base, "num_inference_steps": 3}, seed=2, loras={"full": 0.6, "plain": 0.8})),
        ("a red circle", P(**{**base, "guidance_scale": 2.5}, seed=3, loras={"full": 0.3}, **neg)),
        ("a green square", P(**{**base, "num_inference_steps": 5}, seed=4, n=2, loras={"plain": 1.2})),
        ("a red circle", P(**{**base, "height": 16}, seed=5, loras={"full": 1.0, "plain": -0.5}, **neg)),
    ]


def _engine(family: dict, **kwargs) -> DiffusionEngine:
    return DiffusionEngine(model=family["path"], device="cpu", dtype="float32", lora_modules=family["adapters"],
                           **{"max_batch_size": 16, **kwargs})


def _run_to_end(engine: DiffusionEngine) -> tuple[dict, dict]:
    """Steps until every request finished: (request id -> final output, request id -> first step it took)."""
    finished, started, step = {}, {}, 0
    while engine.has_unfinished_requests():
        step += 1
        for out in engine.step():
            started.setdefault(out.request_id, step)
            if out.finished:
                finished[out.request_id] = out
    assert all(o.error is None for o in finished.values()), {k: o.error for k, o in finished.items()}
    return finished, started


def _assert_close(got: list, want, what: str) -> None:
    assert len(got) == len(want), what
    for a, b in zip(got, want):
        diff = float(np.abs(np.asarray(a) - b).max())
        assert diff <= TOL, f"{what}: max abs diff {diff}"


@pytest.mark.slow
@pytest.mark.parametrize("name", ["sd", "sdxl", "flux", "qwen", "sd3", "z-image"])
def test_each_request_equals_diffusers_with_its_adapters_alone_and_in_a_mixed_batch(families, name, monkeypatch):
    allow_peft_for_transformers(monkeypatch)
    family = families[name]
    requests = _mixed_batch(name)
    engine = _engine(family)
    alone = engine.generate(requests[2][0], requests[2][1], use_tqdm=False)[0]
    outs = engine.generate([r for r, _ in requests], [p for _, p in requests], use_tqdm=False)
    assert all(o.error is None for o in outs), [o.error for o in outs]
    wants = [_reference(family, prompt, p) for prompt, p in requests]
    _assert_close(alone.images, wants[2], f"{name}: two adapters, alone")
    for (prompt, p), out, want in zip(requests, outs, wants):
        _assert_close(out.images, want, f"{name}: {prompt!r} with loras={p.loras} in the mixed batch")
    # the adapters do change the image: same prompt and seed with and without
    change = float(np.abs(outs[1].images[0] - outs[0].images[0]).max())
    assert change > 0.05, f"{name}: the 'full' adapter changed the image by only {change}"
    stats = engine.stats()
    assert stats["loras_resident"] == 2 and stats["lora_slot_loads"] == 2
    engine.shutdown()


def test_text_encoder_adapters_join_the_prompt_cache_key_denoiser_only_ones_do_not(families):
    family = families["sd"]
    engine = _engine(family)
    base = dict(num_inference_steps=2, guidance_scale=4.0, height=32, width=32, output_type="np", seed=1)
    engine.generate("a red circle", P(**base), use_tqdm=False)
    before = engine.stats()
    engine.generate("a red circle", P(**base, loras={"plain": 1.0}), use_tqdm=False)  # denoiser only: shared
    after_plain = engine.stats()
    assert after_plain["prompt_cache_hits"] - before["prompt_cache_hits"] == 2  # prompt and negative prompt
    engine.generate("a red circle", P(**base, loras={"full": 1.0}), use_tqdm=False)
    after_full = engine.stats()
    assert after_full["prompt_cache_hits"] == after_plain["prompt_cache_hits"]  # its own embeddings
    engine.generate("a red circle", P(**base, loras={"full": 0.5}), use_tqdm=False)
    assert engine.stats()["prompt_cache_hits"] == after_full["prompt_cache_hits"]  # another weight: another key
    engine.shutdown()


@pytest.mark.slow
def test_one_slot_serves_adapters_in_turn_and_requests_without_loras_never_wait(families):
    """max_loras=1: the second adapter waits until the first one's request finished (an adapter in use is
    never evicted), then replaces it; a request without adapters runs alongside either."""
    family = families["sd"]
    engine = _engine(family, max_loras=1)
    base = dict(num_inference_steps=3, guidance_scale=4.0, height=32, width=32, output_type="np")
    requests = [("a red circle", P(**base, seed=1, loras={"full": 1.0})),
                ("a blue square", P(**base, seed=2, loras={"plain": 1.0})),
                ("a green circle", P(**base, seed=3)),
                ("a red circle", P(**base, seed=4, loras={"full": 0.5}))]
    for i, (prompt, p) in enumerate(requests):
        engine.add_request(f"r{i}", prompt, p)
    finished, started = _run_to_end(engine)
    assert started["r2"] == started["r0"], "a request without adapters must not wait for a slot"
    r0_last_step = started["r0"] + finished["r0"].num_inference_steps - 1
    assert started["r1"] > r0_last_step, "'plain' waits for 'full' to leave the slot"
    # full, plain, full again; or, where 'plain' was still being read (off the loop, while r0 ran) when r0 left the
    # slot, r3 took 'full' on first (no load) and 'plain' came after it
    assert engine.stats()["lora_slot_loads"] == (2 if started["r3"] < started["r1"] else 3)
    for i, (prompt, p) in enumerate(requests):
        _assert_close(finished[f"r{i}"].images, _reference(family, prompt, p), f"r{i}")
    engine.shutdown()


def test_unloading_an_adapter_keeps_accepted_requests_and_refuses_new_ones(families):
    family = families["sd"]
    engine = _engine(family)
    p = P(num_inference_steps=3, guidance_scale=4.0, height=32, width=32, output_type="np", seed=1,
          loras={"plain": 0.7})
    engine.add_request("accepted", "a red circle", p)
    engine.step()
    engine.unload_lora("plain")
    assert [a["name"] for a in engine.list_loras()] == ["full"]
    with pytest.raises(ValueError, match="unknown LoRA adapter 'plain'"):
        engine.add_request("late", "a red circle", p)
    final = _run_to_end(engine)[0]["accepted"]
    _assert_close(final.images, _reference(family, "a red circle", p), "finished after its adapter was unloaded")
    engine.load_lora("plain", family["adapters"]["plain"])  # the name is free again
    assert engine.generate("a red circle", p, use_tqdm=False)[0].error is None
    engine.shutdown()


def test_preempted_lora_request_comes_back_with_the_same_image(families):
    """Preemption unpins its adapter (another may take the slot); readmission loads it again."""
    family = families["sd"]
    engine = _engine(family, scheduling_policy="priority", max_loras=1, max_batch_size=2)
    # 'plain' read into the worker's host memory first: else, arriving while 'low' runs, it would wait for its
    # file's read (off the loop), and 'low' might finish meanwhile
    engine.generate("warm", P(num_inference_steps=1, height=32, width=32, loras={"plain": 1.0}), use_tqdm=False)
    low = P(num_inference_steps=6, guidance_scale=4.0, height=32, width=32, output_type="np", seed=7,
            loras={"full": 0.8}, priority=5)
    engine.add_request("low", "a red circle", low)
    for _ in range(2):
        engine.step()
    urgent = P(num_inference_steps=2, guidance_scale=4.0, height=32, width=32, output_type="np", seed=8,
               loras={"plain": 1.0}, priority=0)
    engine.add_request("urgent", "a blue square", urgent)
    finals = _run_to_end(engine)[0]
    assert engine.stats()["num_preemptions"] >= 1
    _assert_close(finals["low"].images, _reference(family, "a red circle", low), "LoRA request after preemption")
    _assert_close(finals["urgent"].images, _reference(family, "a blue square", urgent), "the urgent one")
    engine.shutdown()


def _kohya_file(folder, pipe, seed: int, alpha: float) -> str:
    """An adapter in the kohya-ss key style (lora_unet_..., lora_down/lora_up, one `.alpha` per layer), which
    diffusers converts on load: its alpha comes from the `.alpha` keys, not from metadata."""
    from safetensors.torch import save_file

    plain = make_lora(pipe, str(folder / "peft"), seed=seed, rank=4, metadata=False)
    from safetensors.torch import load_file

    tensors = {}
    for key, value in load_file(f"{plain}/pytorch_lora_weights.safetensors").items():
        module, _, kind = key.removeprefix("unet.").rpartition(".lora_")
        name = "lora_unet_" + module.replace(".", "_")
        tensors[f"{name}.lora_{'down' if kind.startswith('A') else 'up'}.weight"] = value
        tensors[f"{name}.alpha"] = torch.tensor(alpha)
    path = str(folder / "kohya.safetensors")
    save_file(tensors, path)
    return path


@pytest.mark.slow
def test_alpha_from_kohya_alpha_keys_and_from_metadata_and_else_rank(families, tmp_path, monkeypatch):
    """Three ways of saying alpha, each as diffusers reads it: an `.alpha` key per layer (here alpha 2 at rank
    4: scale 0.5), adapter metadata ('full': alpha 8 at rank 4), none ('plain': alpha = rank)."""
    from conftest import tiny_sd_pipeline

    allow_peft_for_transformers(monkeypatch)
    family = dict(families["sd"])
    family["adapters"] = {**family["adapters"], "kohya": _kohya_file(tmp_path, tiny_sd_pipeline(), seed=13, alpha=2.0)}
    family.pop("_pipe", None)
    engine = _engine(family)
    layer = next(iter(engine.loras.get("kohya").layers["unet"].values()))
    full = next(iter(engine.loras.get("full").layers["unet"].values()))
    assert layer[0].shape[0] == 4 and full[0].shape[0] == 4
    base = dict(num_inference_steps=3, guidance_scale=4.0, height=32, width=32, output_type="np")
    requests = [("a red circle", P(**base, seed=1, loras={"kohya": 1.0})),
                ("a red circle", P(**base, seed=1, loras={"kohya": 0.5, "full": 0.5}))]
    outs = engine.generate([r for r, _ in requests], [p for _, p in requests], use_tqdm=False)
    for (prompt, p), out in zip(requests, outs):
        assert out.error is None, out.error
        _assert_close(out.images, _reference(family, prompt, p), f"loras={p.loras}")
    engine.shutdown()


@pytest.mark.parametrize("method", ["first_block", "taylorseer"])
@pytest.mark.slow
def test_lora_rows_follow_step_caching_inside_the_forward(tmp_path, method, monkeypatch):
    """With step caching, some rows leave the batch inside the forward; each remaining row must still get
    its own adapters. A cached LoRA request equals the pipeline with the same adapter and enable_cache."""
    import diffusers
    from conftest import tiny_flux_pipeline

    from dvllm.step_cache import parse_cache

    pipe = tiny_flux_pipeline(num_layers=2, num_single_layers=2)
    pipe.save_pretrained(tmp_path / "model")
    adapters = {"full": make_lora(pipe, str(tmp_path / "full"), seed=21, components=("transformer",)),
                "plain": make_lora(pipe, str(tmp_path / "plain"), seed=22, rank=8, metadata=False)}
    cache = {"method": method, "threshold": 0.21} if method == "first_block" else {"method": method}
    base = dict(num_inference_steps=8, guidance_scale=3.5, height=32, width=32, output_type="np")
    requests = [("a red circle", P(**base, seed=1, cache=cache, loras={"full": 1.0})),
                ("a blue square", P(**base, seed=2, cache=cache)),
                ("a red circle", P(**base, seed=3, loras={"plain": 0.7, "full": 0.4})),
                ("a green circle", P(**base, seed=4, cache=cache, loras={"plain": 1.0}))]
    engine = DiffusionEngine(model=str(tmp_path / "model"), device="cpu", dtype="float32", lora_modules=adapters)
    outs = engine.generate([r for r, _ in requests], [p for _, p in requests], use_tqdm=False)
    assert all(o.error is None for o in outs), [o.error for o in outs]
    assert any(o.metrics.cached_steps for o in outs), "some steps must be cached for the test to mean anything"
    for (prompt, p), out in zip(requests, outs):
        ref = diffusers.FluxPipeline.from_pretrained(tmp_path / "model")
        ref.set_progress_bar_config(disable=True)
        if isinstance(p.cache, dict):
            ref.transformer.enable_cache(parse_cache(p.cache).diffusers_config())
        want = reference_images(ref, adapters, p.loras, prompt=prompt, num_inference_steps=p.num_inference_steps,
                                height=p.height, width=p.width, guidance_scale=p.guidance_scale, output_type="np",
                                generator=torch.Generator("cpu").manual_seed(p.seed))
        _assert_close(out.images, want, f"{method}: loras={p.loras} cache={p.cache}")
    engine.shutdown()


def _bad_lora_folder(folder, tensors: dict) -> str:
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "pytorch_lora_weights.safetensors"))
    return str(folder)


def test_adapters_this_model_cannot_serve_are_value_errors_naming_why(families, tmp_path):
    from safetensors.torch import load_file

    family = families["sd"]
    engine = DiffusionEngine(model=family["path"], device="cpu", dtype="float32", max_lora_rank=4,
                             lora_modules={"full": family["adapters"]["full"]})  # "plain" has rank 8
    with pytest.raises(ValueError, match="rank 8, more than max_lora_rank=4"):
        engine.load_lora("wide", family["adapters"]["plain"])
    with pytest.raises(ValueError, match="does not exist"):
        engine.load_lora("gone", str(tmp_path / "nowhere"))
    with pytest.raises(ValueError, match="not a LoRA adapter|no LoRA weights"):
        engine.load_lora("junk", _bad_lora_folder(tmp_path / "junk", {"some.weight": torch.ones(3, 3)}))
    with pytest.raises(ValueError, match="not a LoRA adapter|no LoRA weights|does not have"):
        engine.load_lora("other-model", families["flux"]["adapters"]["plain"])
    tensors = load_file(f"{family['adapters']['full']}/pytorch_lora_weights.safetensors")
    a, b = next((tensors[k], tensors[k.replace("lora_A", "lora_B")]) for k in tensors
                if k.startswith("unet.") and "lora_A" in k)
    extra = {**tensors, "unet.no_such_block.to_q.lora_A.weight": a.clone(),
             "unet.no_such_block.to_q.lora_B.weight": b.clone()}
    with pytest.raises(ValueError, match="no_such_block"):
        engine.load_lora("extra", _bad_lora_folder(tmp_path / "extra", extra))
    with pytest.raises(ValueError, match="already loaded"):
        engine.load_lora("full", family["adapters"]["full"])
    with pytest.raises(ValueError, match="LoRA name"):
        engine.load_lora("bad name/", family["adapters"]["full"])
    with pytest.raises(ValueError, match="no LoRA adapter named 'nope'"):
        engine.unload_lora("nope")
    assert sorted(a["name"] for a in engine.list_loras()) == ["full"]  # every failed load left nothing behind
    p = dict(num_inference_steps=2, height=32, width=32, output_type="np")
    with pytest.raises(ValueError, match="unknown LoRA adapter 'nope'"):
        engine.generate("x", P(**p, loras={"nope": 1.0}), use_tqdm=False)
    for weight in (float("nan"), True, "1"):
        with pytest.raises(ValueError, match="loras: the weight of 'full'"):
            engine.generate("x", P(**p, loras={"full": weight}), use_tqdm=False)
    with pytest.raises(ValueError, match="loras must be an object"):
        engine.generate("x", P(**p, loras=["full"]), use_tqdm=False)
    engine.shutdown()


@pytest.mark.slow
def test_too_many_adapters_and_loras_without_lora_serving_are_refused(families):
    family = families["sd"]
    engine = _engine(family, max_loras=1)
    p = dict(num_inference_steps=2, height=32, width=32, output_type="np")
    with pytest.raises(ValueError, match="2 adapters in one request, but max_loras is 1"):
        engine.generate("x", P(**p, loras={"full": 1.0, "plain": 1.0}), use_tqdm=False)
    engine.shutdown()
    plain = DiffusionEngine(model=family["path"], device="cpu", dtype="float32")
    with pytest.raises(ValueError, match="serves no LoRA adapters"):
        plain.generate("x", P(**p, loras={"full": 1.0}), use_tqdm=False)
    with pytest.raises(ValueError, match="serves no LoRA adapters"):
        plain.load_lora("full", family["adapters"]["full"])
    assert plain.list_loras() == []
    plain.shutdown()


def test_a_failed_load_does_not_disturb_running_requests(families, tmp_path):
    family = families["sd"]
    engine = _engine(family)
    p = P(num_inference_steps=3, guidance_scale=4.0, height=32, width=32, output_type="np", seed=1,
          loras={"full": 1.0})
    engine.add_request("running", "a red circle", p)
    engine.step()
    with pytest.raises(ValueError):
        engine.load_lora("junk", _bad_lora_folder(tmp_path / "junk", {"x": torch.ones(2)}))
    final = _run_to_end(engine)[0]["running"]
    _assert_close(final.images, _reference(family, "a red circle", p), "request running across a failed load")
    engine.shutdown()


def test_a_load_that_fails_on_the_worker_fails_its_requests_and_frees_the_slot(families, monkeypatch):
    family = families["sd"]
    engine = _engine(family, max_loras=1)
    calls = fail_first_load(engine.executor.worker.runner.lora, monkeypatch)
    p = P(num_inference_steps=2, guidance_scale=4.0, height=32, width=32, output_type="np", seed=1,
          loras={"full": 1.0})
    plain = P(num_inference_steps=2, guidance_scale=4.0, height=32, width=32, output_type="np", seed=2)
    first = engine.generate(["a red circle", "a blue square"], [p, plain], use_tqdm=False)
    assert "could not be loaded" in first[0].error and "simulated" in first[0].error
    assert first[1].error is None  # a request without adapters in the same step is untouched
    assert engine.stats()["loras_resident"] == 0
    again = engine.generate("a red circle", p, use_tqdm=False)[0]  # the slot is free and loads again
    assert again.error is None, again.error
    assert calls == ["full", "full"]
    _assert_close(again.images, _reference(family, "a red circle", p), "after a failed load")
    engine.shutdown()
