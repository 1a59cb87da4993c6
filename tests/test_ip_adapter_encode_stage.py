"""IP-Adapter image prompts encoded on the encode stage's thread: a request that arrives while a batch runs has its
image encoded ahead of its admission, off the step loop (identical images once, whichever thread met them first),
and its images still equal the diffusers pipeline's with the adapter; an image encode that fails fails its request
only, with the reason."""
from __future__ import annotations

import threading

import numpy as np
import pytest
from diffusers import StableDiffusionPipeline

from test_encode_stage import STAGE, P, _engine, _run, _stage_done_at
from test_ip_adapter import LATENT_TOL, TOL, image_prompt, reference, tiny_image_encoder, tiny_unet_ip_adapter

from dvllm.core.block_manager import BlockManager
from dvllm.core.encode_ahead import EncodeAhead
from dvllm.core.request import Request
from dvllm.sampling_params import SamplingParams

FIRST = ("a red circle", P(seed=1, num_inference_steps=6))  # no image prompt: the batch the others arrive behind


@pytest.fixture(scope="module")
def staged(sd_eps_path, tmp_path_factory):
    """(engine with the encode stage on, the plain pipeline, the pipeline with the adapter)."""
    folder = tmp_path_factory.mktemp("sd-ip-adapter-stage")
    tiny_image_encoder(folder / "image_encoder")
    plain = StableDiffusionPipeline.from_pretrained(sd_eps_path)
    tiny_unet_ip_adapter(plain.unet, folder / "ip-adapter.safetensors")
    with_adapter = StableDiffusionPipeline.from_pretrained(sd_eps_path)
    with_adapter.load_ip_adapter(str(folder), subfolder="", weight_name="ip-adapter.safetensors")
    for pipe in (plain, with_adapter):
        pipe.set_progress_bar_config(disable=True)
    engine = _engine(sd_eps_path, ip_adapter=str(folder / "ip-adapter.safetensors"))
    yield engine, plain, with_adapter
    engine.shutdown()


def _spy_encoder(engine, fail_on=None) -> tuple[list[str], object]:
    """Records the thread of every image-encoder forward; the image prompt equal to `fail_on` raises instead.
    Returns (threads, a function that undoes the spy)."""
    ip_adapter, threads = engine.executor.worker.runner.ip_adapter, []
    ip_adapter._kept.clear()  # (the module's engine: no image is held from another test)
    hook = ip_adapter.encoder.register_forward_pre_hook(
        lambda module, args: threads.append(threading.current_thread().name))
    real = ip_adapter._run_encoder

    def run(image):
        if fail_on is not None and np.array_equal(np.asarray(image), np.asarray(fail_on)):
            raise RuntimeError("image encoder out of memory")
        return real(image)

    ip_adapter._run_encoder = run

    def undo() -> None:
        hook.remove()
        del ip_adapter._run_encoder
    return threads, undo


def _assert_equal_to_the_pipeline(staged, outputs: dict[str, list], jobs: dict[str, tuple], tol: float) -> None:
    for request_id, (prompt, p) in jobs.items():
        final = outputs[request_id][-1]
        assert final.finished and final.error is None, final.error
        want = np.asarray(reference(staged, prompt, p, p.output_type))
        got = np.stack([np.asarray(image) for image in final.images])
        assert got.shape == want.shape
        diff = float(np.abs(got - want).max())
        assert diff <= tol, f"{request_id} {prompt!r}: max abs diff {diff}"


@pytest.mark.slow
def test_image_prompts_arriving_during_a_batch_are_encoded_on_the_stage_thread_once_per_image(staged):
    engine = staged[0]
    one, two = image_prompt(11), image_prompt(12, (16, 30))
    # the first request meets an idle engine: admission encodes its image on the loop (no one to stall)
    first = (FIRST[0], P(**{**vars(FIRST[1]), "ip_adapter_image": one, "ip_adapter_scale": 0.6}))
    later = [("a blue square", P(seed=2, ip_adapter_image=one)),
             ("a blue square", P(seed=3, guidance_scale=1.0, ip_adapter_image=one, ip_adapter_scale=0.4)),
             ("two triangles", P(seed=4, n=2, negative_prompt="blurry", ip_adapter_image=two,
                                 ip_adapter_scale=0.8))]
    threads, undo = _spy_encoder(engine)
    try:
        outputs = _run(engine, first=first, later=later, hook=_stage_done_at(2, engine))
    finally:
        undo()
    # two images, two encoder calls: the first request's on the loop; of those arriving during its batch, only
    # the new image's, on the stage's thread (the repeated image's embeds are the loop's, kept)
    assert threads == [threading.current_thread().name, STAGE]
    _assert_equal_to_the_pipeline(staged, outputs, {"first": first, **{str(i): job for i, job in enumerate(later)}},
                                  TOL)
    stage = engine.executor.worker.runner.encode_stage
    assert stage._image_prompts == {} and stage._results == {}  # nothing held once taken


@pytest.mark.slow
def test_an_image_encode_that_fails_in_the_stage_fails_its_request_only(staged):
    engine = staged[0]
    good, bad = image_prompt(21), image_prompt(22)
    latent = dict(output_type="latent")
    later = [("a blue square", P(seed=2, ip_adapter_image=good, **latent)),
             ("a green star", P(seed=3, ip_adapter_image=bad, **latent)),
             ("a yellow moon", P(seed=4, **latent))]
    first = (FIRST[0], P(**{**vars(FIRST[1]), **latent}))
    threads, undo = _spy_encoder(engine, fail_on=bad)
    try:
        outputs = _run(engine, first=first, later=later, hook=_stage_done_at(2, engine))
    finally:
        undo()
    final = outputs["1"][-1]
    assert final.finished and final.images == []
    assert final.error == "image prompt encoding failed: RuntimeError: image encoder out of memory"
    assert threads == [STAGE]  # the good image's encode (the bad one raised before the encoder)
    _assert_equal_to_the_pipeline(staged, outputs, {"first": first, "0": later[0], "2": later[2]}, LATENT_TOL)


def test_encode_ahead_sends_a_waiting_image_prompt_once_and_admits_its_request_when_ready():
    ahead, blocks = EncodeAhead(capacity=8), BlockManager(64)
    params = SamplingParams(guidance_scale=1.0, ip_adapter_image=image_prompt(1))
    request = Request("a", "cat", params, num_steps=3, cfg=False, plan=None, arrival_time=0.0, arrival_seq=0)
    plan = ahead.plan([request], blocks)
    assert plan.image_prompts == {"a": params.ip_adapter_image} and plan.starts == []
    assert ahead.plan([request], blocks).image_prompts == {}  # sent once
    ahead.mark_ready(plan.send)
    assert ahead.must_wait(request, blocks)  # its texts are ready, its image prompt is not
    ahead.mark_ready([("image_prompt", "a")])
    assert not ahead.must_wait(request, blocks)
    swapped = Request("b", "dog", params, num_steps=3, cfg=False, plan=None, arrival_time=0.0, arrival_seq=1)
    swapped.swapped = True  # its embeds come back with its state
    assert ahead.plan([swapped], blocks).image_prompts == {}
    failing = Request("c", "bird", params, num_steps=3, cfg=False, plan=None, arrival_time=0.0, arrival_seq=2)
    ahead.plan([failing], blocks)
    assert ahead.failed({("image_prompt", "c"): "image prompt encoding failed: x"}, [request, failing]) == \
        [(failing, "image prompt encoding failed: x")]
