"""The encode stage's starts: the VAE encode of an input image (img2img, inpainting) and the draws of the request's
generator around it are made on the stage's thread, with the stage-off engine's images; a start that fails fails
its request only."""
from __future__ import annotations

import threading

import numpy as np
import pytest

from test_encode_stage import STAGE, P, _assert_same_images, _engine, _run, _stage_done_at

from dvllm import DiffusionEngine


def _spy_starts(engine: DiffusionEngine, monkeypatch, fail: str | None = None) -> list[tuple[str, str]]:
    """Records (thread, kind) of every start made of input images; the start of the image whose first pixel
    reads `fail` raises."""
    adapter, calls = engine.executor.worker.runner.adapter, []
    for kind in ("encode_image", "prepare_inpaint"):
        real = getattr(adapter, kind)

        def spy(image, *args, _real=real, _kind=kind):
            calls.append((threading.current_thread().name, _kind))
            if fail is not None and np.asarray(image)[0, 0].tolist() == fail:
                raise RuntimeError("VAE encode out of memory")
            return _real(image, *args)

        monkeypatch.setattr(adapter, kind, spy)
    return calls


def _picture(seed: int):
    from PIL import Image

    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (24, 32, 3), dtype=np.uint8))


def _mask():
    from PIL import Image

    m = np.zeros((24, 32), np.uint8)
    m[4:18, 6:26] = 255
    return Image.fromarray(m)


IMAGE_JOBS = [("a blue square", P(seed=2, image=_picture(2), strength=0.7, height=32, width=32)),
              ("a green star", P(seed=3, image=_picture(3), mask_image=_mask(), height=32, width=32)),
              ("a yellow moon", P(seed=4, image=_picture(4), mask_image=_mask(), strength=0.6, n=2, height=32,
                                  width=32))]


@pytest.mark.slow
def test_img2img_and_inpainting_starts_are_made_by_the_stage_with_the_same_images(sd_eps_path, monkeypatch):
    """The VAE encode of an input image (and the draws of the request's generator around it) run on the stage's
    thread; the loop takes the start with the generator as they left it, so the images are the stage-off
    engine's."""
    first = ("a red circle", P(seed=1, num_inference_steps=6, height=32, width=32))
    want = _run(_engine(sd_eps_path, encode_stage=False), first=first, later=IMAGE_JOBS)
    engine = _engine(sd_eps_path)
    calls = _spy_starts(engine, monkeypatch)
    got = _run(engine, first=first, later=IMAGE_JOBS, hook=_stage_done_at(2, engine))
    assert sorted(calls) == [(STAGE, "encode_image"), (STAGE, "prepare_inpaint"), (STAGE, "prepare_inpaint")]
    _assert_same_images(got, want, ["first", "0", "1", "2"])
    stage = engine.executor.worker.runner.encode_stage
    assert stage._starts == {} and stage._results == {}  # nothing held once taken


@pytest.mark.slow
def test_a_start_that_fails_in_the_stage_fails_its_request_only(sd_eps_path, monkeypatch):
    first = ("a red circle", P(seed=1, num_inference_steps=6, height=32, width=32))
    want = _run(_engine(sd_eps_path, encode_stage=False), first=first, later=IMAGE_JOBS)
    engine = _engine(sd_eps_path)
    calls = _spy_starts(engine, monkeypatch, fail=np.asarray(_picture(3))[0, 0].tolist())
    got = _run(engine, first=first, later=IMAGE_JOBS, hook=_stage_done_at(2, engine))
    final = got["1"][-1]
    assert final.finished and final.images == []
    assert final.error == "latent preparation failed: RuntimeError: VAE encode out of memory"
    assert (STAGE, "prepare_inpaint") in calls
    _assert_same_images(got, want, ["first", "0", "2"])
