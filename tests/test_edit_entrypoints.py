"""Edits with masks (inpainting) and several images through `dvllm serve`'s /v1/images/edits and `dvllm generate
--image/--mask`. OpenAI's mask marks the pixels to edit as transparent: dvllm gives diffusers `255 - alpha`, so a
pixel is repainted where alpha < 128. Every served or generated image equals the in-process engine's for the same
request with that converted mask, pixel for pixel."""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import io
import json
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import openai
import pytest
from diffusers.image_processor import VaeImageProcessor
from fastapi.testclient import TestClient
from openai import OpenAI
from PIL import Image
from test_inpaint import sd_inpaint_path  # noqa: F401 (fixture)
from utils_cli import expect_usage_error, no_model_load, restore_logging  # noqa: F401 (fixtures)
from utils_server import BASE_ARGS, RemoteServer, assert_error, png_pixels

from dvllm import DiffusionEngine, SamplingParams
from dvllm.engine.async_engine import AsyncDiffusionEngine
from dvllm.entrypoints.api_server import build_app
from dvllm.entrypoints.cli import main
from dvllm.entrypoints.mask_upload import mask_from_upload
from dvllm.entrypoints.protocol import engine_value_error

SIZE = (32, 24)  # W x H of the uploads; inpainting answers at the model's default size (16x16 here)
REQUEST = {"seed": 5, "num_inference_steps": 4, "guidance_scale": 4.0}
ALPHAS = (0, 127, 128, 255)  # on both sides of diffusers' 0.5 binarization


def picture(seed: int, size: tuple[int, int] = SIZE) -> np.ndarray:
    return (np.random.default_rng(seed).random((size[1], size[0], 3)) * 255).astype(np.uint8)


def alpha_mask(size: tuple[int, int] = SIZE) -> Image.Image:
    """An RGBA mask: four bands of alpha 0, 127, 128, 255 across, random colours (which must not matter)."""
    w, h = size
    alpha = np.repeat(np.array(ALPHAS, np.uint8), -(-w // len(ALPHAS)))[:w]
    rgba = np.concatenate([picture(9, size), np.broadcast_to(alpha, (h, w))[..., None]], axis=2)
    return Image.fromarray(rgba, "RGBA")


def png(image: Image.Image | np.ndarray, **save_args) -> bytes:
    image = Image.fromarray(image) if isinstance(image, np.ndarray) else image
    buffer = io.BytesIO()
    image.save(buffer, format="PNG", **save_args)
    return buffer.getvalue()


def opened(data: bytes) -> Image.Image:
    return Image.open(io.BytesIO(data))


def repainted(mask: Image.Image) -> np.ndarray:
    """Where diffusers' inpainting mask processor (grey, binarized at 0.5) repaints, at the mask's own size."""
    processor = VaeImageProcessor(do_normalize=False, do_binarize=True, do_convert_grayscale=True)
    return processor.preprocess(mask, height=mask.height, width=mask.width)[0, 0].numpy() == 1


# -- the conversion ------------------------------------------------------------------------------------------

def test_alpha_is_inverted_and_repaints_below_128():
    mask = alpha_mask()
    converted = mask_from_upload(opened(png(mask)))
    alpha = np.asarray(mask)[..., 3]
    assert converted.mode == "L" and converted.size == SIZE
    np.testing.assert_array_equal(np.asarray(converted), 255 - alpha)
    np.testing.assert_array_equal(repainted(converted), alpha < 128)
    assert sorted(set(alpha[repainted(converted)])) == [0, 127]  # transparent: edited; opaque: kept


@pytest.mark.parametrize("kind", ["LA", "P-transparency", "L-transparency"])
def test_every_kind_of_transparency_is_the_mask(kind):
    """LA, and palette or grey PNGs whose transparency is a tRNS chunk: transparent pixels are the ones edited."""
    grey = np.asarray(alpha_mask())[..., 3]  # 0, 127, 128, 255 bands
    if kind == "LA":
        data = png(Image.fromarray(np.stack([picture(3)[..., 0], grey], axis=2), "LA"))
        expected = grey < 128
    else:  # the pixels of grey value 0 are declared transparent: only they are edited
        image = Image.fromarray(grey)
        data = png(image.convert("P") if kind.startswith("P") else image, transparency=0)
        expected = grey == 0
    np.testing.assert_array_equal(repainted(mask_from_upload(opened(data))), expected)


def test_a_mask_without_alpha_is_taken_as_diffusers_takes_it():
    rgb = picture(4)
    converted = mask_from_upload(opened(png(rgb)))
    np.testing.assert_array_equal(np.asarray(converted), np.asarray(Image.fromarray(rgb).convert("L")))
    np.testing.assert_array_equal(repainted(converted), repainted(Image.fromarray(rgb)))


def test_the_converted_mask_inpaints_as_an_explicit_binary_mask(sd_eps_path):
    """End to end in the engine: the alpha mask gives the image of a hand-made L mask, white where alpha < 128.
    At the model's own size (16x16), so no resizing blurs the two masks differently before the binarization."""
    mask = alpha_mask((16, 16))
    explicit = Image.fromarray(np.where(np.asarray(mask)[..., 3] < 128, 255, 0).astype(np.uint8), "L")
    engine = DiffusionEngine(model=sd_eps_path, device="cpu", dtype="float32")
    try:
        params = [SamplingParams(image=Image.fromarray(picture(1, (16, 16))), mask_image=m, output_type="np",
                                 **REQUEST) for m in (mask_from_upload(opened(png(mask))), explicit)]
        a, b = engine.generate(["a red circle"] * 2, params, use_tqdm=False)
    finally:
        engine.shutdown()
    np.testing.assert_array_equal(a.images[0], b.images[0])


def test_engine_errors_about_the_mask_name_the_form_field():
    error = engine_value_error(ValueError("mask_image must be the size of image (32x24), got 16x16"))
    assert (error.status, error.param) == (400, "mask")


# -- dvllm serve -----------------------------------------------------------------------------------------------

@dataclasses.dataclass
class Served:
    server: RemoteServer
    reference: Callable[..., np.ndarray]  # the in-process engine's image (uint8 pixels) for a request
    nine_channels: bool  # an inpainting UNet, which takes image requests with a mask only

    @property
    def client(self) -> OpenAI:
        return OpenAI(base_url=self.server.url + "/v1", api_key="unused", max_retries=0)

    @property
    def model(self) -> str:
        return httpx.get(self.server.url + "/v1/models", timeout=30).json()["data"][0]["id"]


@pytest.fixture(scope="module", params=["sd_eps_path", "sd_inpaint_path"], ids=["4-channel", "9-channel"])
def served(request):
    """A served model (a regular SD UNet, then an inpainting one) and the in-process engine on the same folder."""
    path = request.getfixturevalue(request.param)
    engine = DiffusionEngine(model=path, device="cpu", dtype="float32")

    def reference(prompt: str, **params) -> np.ndarray:
        out = engine.generate(prompt, SamplingParams(**params, output_type="pil"), use_tqdm=False)[0]
        assert out.error is None, out.error
        return np.asarray(out.images[0].convert("RGB"))

    try:
        with RemoteServer(path, BASE_ARGS) as server:
            yield Served(server, reference, request.param == "sd_inpaint_path")
    finally:
        engine.shutdown()


def _inpainted(reference, prompt: str, image: bytes, mask: bytes, **params) -> np.ndarray:
    return reference(prompt, image=opened(image), mask_image=mask_from_upload(opened(mask)), **params)


def _post(server: RemoteServer, files: list, **data) -> httpx.Response:
    return httpx.post(server.url + "/v1/images/edits", data={"prompt": "x", "num_inference_steps": "2", **data},
                      files=files, timeout=120)


def _file(name: str, data: bytes) -> tuple:
    return ("in.png" if name != "mask" else "mask.png", data, "image/png")


@pytest.mark.slow
def test_openai_client_inpaints_as_the_engine(served):
    image, mask = png(picture(1)), png(alpha_mask())
    result = served.client.images.edit(model=served.model, image=("in.png", image, "image/png"),
                                       mask=("mask.png", mask, "image/png"), prompt="a red circle", extra_body=REQUEST)
    got = png_pixels(result.data[0].b64_json)
    assert got.shape == (16, 16, 3)  # inpainting's default size: the model's, not the image's
    np.testing.assert_array_equal(got, _inpainted(served.reference, "a red circle", image, mask, **REQUEST))
    # a strength below 1, at the image's size
    result = served.client.images.edit(image=("in.png", image, "image/png"), mask=("mask.png", mask, "image/png"),
                                       prompt="a blue square", size="32x24", extra_body={**REQUEST, "strength": 0.7})
    np.testing.assert_array_equal(png_pixels(result.data[0].b64_json), _inpainted(
        served.reference, "a blue square", image, mask, strength=0.7, height=24, width=32, **REQUEST))


@pytest.mark.slow
def test_streamed_inpainting_ends_in_the_engines_image(served):
    image, mask = png(picture(2)), png(alpha_mask())
    events = list(served.client.images.edit(image=("in.png", image, "image/png"), mask=("mask.png", mask, "image/png"),
                                            prompt="a star", stream=True, partial_images=2, extra_body=REQUEST))
    assert [e.type for e in events] == ["image_edit.partial_image"] * 2 + ["image_edit.completed"]
    np.testing.assert_array_equal(png_pixels(events[-1].b64_json),
                                  _inpainted(served.reference, "a star", image, mask, **REQUEST))


@pytest.mark.slow
def test_a_mask_without_alpha_is_grey_white_repaints(served):
    image, grey = png(picture(3)), np.zeros(SIZE[::-1], np.uint8)
    grey[4:20, 8:24] = 255
    response = _post(served.server, [("image", _file("image", image)), ("mask", _file("mask", png(grey)))],
                     **{k: str(v) for k, v in REQUEST.items()})
    assert response.status_code == 200, response.text
    np.testing.assert_array_equal(png_pixels(response.json()["data"][0]["b64_json"]), served.reference(
        "x", image=opened(image), mask_image=Image.fromarray(grey), **REQUEST))


@pytest.mark.parametrize("case, param, words", [
    ("mask-of-another-size", "mask", "the mask must have the image's size"),
    ("mask-not-an-image", "mask", "not a readable image"),
    ("mask-truncated", "mask", "not a readable image"),  # the header reads; decoding fails, in the worker thread
    ("mask-over-the-pixel-limit", "mask", "over this server's limit of 4096 pixels"),  # from its header
    ("two-masks", "mask", "send one image file"),
    ("two-images", "image", "2 images, but this model takes at most 1 image"),
    ("too-many-files", "image", "too many files; this model takes at most 1 image (and one mask)"),
    ("no-image", "image", "as 'image'"),
])
def test_bad_edits_are_400s_naming_the_field(served, case, param, words):
    image, mask = ("image", _file("image", png(picture(1)))), ("mask", _file("mask", png(alpha_mask())))
    files = {
        "mask-of-another-size": [image, ("mask", _file("mask", png(alpha_mask((16, 16)))))],
        "mask-not-an-image": [image, ("mask", ("m.png", b"not a png", "image/png"))],
        "mask-truncated": [image, ("mask", _file("mask", png(alpha_mask())[:200]))],
        "mask-over-the-pixel-limit": [image, ("mask", _file("mask", png(alpha_mask((128, 64)))))],
        "two-masks": [image, mask, mask],
        "two-images": [("image[]", image[1]), ("image[]", image[1])],
        "too-many-files": [image, image, image, mask],  # past the form's file limit: the same param
        "no-image": [mask],
    }[case]
    error = assert_error(_post(served.server, files), 400, param)
    assert words in error["message"], error


def test_openai_client_sends_image_lists_as_image_brackets(served):
    with pytest.raises(openai.BadRequestError) as refused:
        served.client.images.edit(image=[("a.png", png(picture(1)), "image/png"),
                                         ("b.png", png(picture(2)), "image/png")], prompt="x")
    assert refused.value.body["param"] == "image" and "at most 1 image" in refused.value.body["message"]


def test_an_inpainting_unet_wants_a_mask(served):
    response = _post(served.server, [("image", _file("image", png(picture(1))))])
    if not served.nine_channels:  # image-to-image
        assert response.status_code == 200, response.text
        return
    assert "only inpaints" in assert_error(response, 400, "mask")["message"]  # the engine's words, as 'mask'


# -- build_app in-process: a model that does not inpaint, several images, the mask off the event loop ---------

def _app_client(engine: AsyncDiffusionEngine) -> TestClient:
    return TestClient(build_app(engine, argparse.Namespace()))


def test_a_mask_for_a_model_that_does_not_inpaint(flux_path):
    engine = AsyncDiffusionEngine(model=flux_path, device="cpu", dtype="float32", state_pool_mb=32)
    try:
        with _app_client(engine) as client:
            response = client.post("/v1/images/edits", data={"prompt": "x"},
                                   files=[("image", _file("image", png(picture(1)))),
                                          ("mask", _file("mask", png(alpha_mask())))])
    finally:
        asyncio.run(engine.shutdown(0))
    assert "inpainting is not supported for the flux family" in assert_error(response, 400, "mask")["message"]


@pytest.fixture
def sd_engine(sd_eps_path):
    """A fresh engine per test: an app's lifespan starts it on its event loop and shuts it down at the end."""
    engine = AsyncDiffusionEngine(model=sd_eps_path, device="cpu", dtype="float32", state_pool_mb=32)
    yield engine
    asyncio.run(engine.shutdown(0))


def test_several_images_reach_the_engine_as_a_list_in_the_order_sent(sd_engine, monkeypatch):
    """For a model taking several images: `image[]` parts in order, as a list (one image stays one image)."""
    sent: list = []
    real = sd_engine.generate

    def spy(prompt, params, request_id=None):
        sent.append(params.image)
        return real(prompt, params, request_id)

    info = sd_engine.model_info
    monkeypatch.setattr(sd_engine, "model_info",
                        dataclasses.replace(info, images=dataclasses.replace(info.images, max_images=2)))
    monkeypatch.setattr(sd_engine, "generate", spy)
    first, second = png(picture(1, (16, 16))), png(picture(2, (24, 16)))
    with _app_client(sd_engine) as client:
        both = client.post("/v1/images/edits", data={"prompt": "x"},
                           files=[("image[]", _file("image", first)), ("image[]", _file("image", second))])
        one = client.post("/v1/images/edits", data={"prompt": "x", "num_inference_steps": "2"},
                          files=[("image", _file("image", first))])
        three = client.post("/v1/images/edits", data={"prompt": "x"}, files=[("image[]", _file("image", first))] * 3)
    # this engine takes one image: its own check refuses the list the server passed on
    assert "2 images, but this model takes at most 1" in assert_error(both, 400, "image")["message"]
    assert one.status_code == 200, one.text
    assert "takes at most 2 images" in assert_error(three, 400, "image")["message"]
    assert isinstance(sent[0], list) and [i.size for i in sent[0]] == [(16, 16), (24, 16)]
    assert isinstance(sent[1], Image.Image) and len(sent) == 2


def test_the_mask_is_converted_off_the_event_loop(sd_engine, monkeypatch):
    """While a mask is being converted, the server answers other requests and generates images."""
    converting, release = threading.Event(), threading.Event()

    def slow_convert(image: Image.Image) -> Image.Image:
        converting.set()
        assert release.wait(60), "the test never released the conversion"
        return mask_from_upload(image)

    monkeypatch.setattr("dvllm.entrypoints.serving_edits.mask_from_upload", slow_convert)
    files = [("image", _file("image", png(picture(1)))), ("mask", _file("mask", png(alpha_mask())))]
    with _app_client(sd_engine) as client, ThreadPoolExecutor(2) as pool:
        pending = pool.submit(client.post, "/v1/images/edits", data={"prompt": "x", "num_inference_steps": "2"},
                              files=files)
        try:
            assert converting.wait(60)
            # bounded waits: with the conversion on the event loop these would hang until it is released
            assert pool.submit(client.get, "/health").result(30).status_code == 200
            image = pool.submit(client.post, "/v1/images/generations",
                                json={"prompt": "x", "size": "16x16", "num_inference_steps": 2}).result(60)
            assert image.status_code == 200, image.text
        finally:
            release.set()
        assert pending.result(60).status_code == 200


# -- dvllm generate --------------------------------------------------------------------------------------------

CLI = ["--device", "cpu", "--dtype", "float32", "--no-progress", "--steps", "4", "--guidance", "4.0", "--seed", "5"]


def _pixels(path) -> np.ndarray:
    with Image.open(path) as image:
        return np.asarray(image.convert("RGB"))


@pytest.fixture(scope="module")
def sd_reference(sd_eps_path):
    """The in-process engine's images for requests run together, as `dvllm generate` runs a file's lines (batching
    keeps an image within 1e-3, not bit for bit: the same batch gives the same pixels)."""
    engine = DiffusionEngine(model=sd_eps_path, device="cpu", dtype="float32")

    def images(*jobs: tuple[str, dict]) -> list[np.ndarray]:
        outs = engine.generate([prompt for prompt, _ in jobs], [SamplingParams(**{**REQUEST, **p}) for _, p in jobs],
                               use_tqdm=False)
        return [np.asarray(out.images[0].convert("RGB")) for out in outs]

    yield images
    engine.shutdown()


@pytest.mark.slow
def test_generate_image_and_mask_flags_and_jsonl(sd_eps_path, sd_reference, tmp_path):
    start, mask = tmp_path / "in.png", tmp_path / "mask.png"
    start.write_bytes(png(picture(1)))
    mask.write_bytes(png(alpha_mask()))
    converted = mask_from_upload(Image.open(mask))
    one = tmp_path / "one.png"
    assert main(["generate", "a red circle", "-o", str(one), "--model", sd_eps_path, *CLI, "--image", str(start),
                 "--mask", str(mask)]) == 0
    np.testing.assert_array_equal(_pixels(one), sd_reference(
        ("a red circle", {"image": Image.open(start), "mask_image": converted}))[0])
    with Image.open(one) as written:
        parameters = json.loads(written.text["parameters"])
    assert (parameters["image"], parameters["mask"], parameters["strength"]) == (str(start), str(mask), 1.0)

    # JSONL: relative paths under the prompts file's folder; a line's "mask" with --image's image; img2img
    jobs = tmp_path / "jobs"
    jobs.mkdir()
    (jobs / "in.png").write_bytes(png(picture(2)))
    (jobs / "mask.png").write_bytes(png(alpha_mask()))
    lines = jobs / "p.jsonl"
    lines.write_text("\n".join(json.dumps(line) for line in [
        {"prompt": "a star", "image": "in.png", "mask": "mask.png", "output": "inpainted.png"},
        {"prompt": "a moon", "mask": "mask.png", "strength": 0.6, "output": "flag-image.png"},
        {"prompt": "a sun", "image": "in.png", "strength": 0.75, "size": "32x24", "output": "img2img.png"},
    ]) + "\n")
    out = tmp_path / "out"
    assert main(["generate", "--prompts-file", str(lines), "--output-dir", str(out), "--model", sd_eps_path, *CLI,
                 "--image", str(start)]) == 0
    expected = sd_reference(
        ("a star", {"image": Image.open(jobs / "in.png"), "mask_image": converted}),
        ("a moon", {"image": Image.open(start), "mask_image": converted, "strength": 0.6}),
        ("a sun", {"image": Image.open(jobs / "in.png"), "strength": 0.75, "height": 24, "width": 32}))
    for name, want in zip(("inpainted.png", "flag-image.png", "img2img.png"), expected):
        np.testing.assert_array_equal(_pixels(out / name), want, err_msg=name)
    manifest = {line["file"]: line for line in map(json.loads, (out / "manifest.jsonl").read_text().splitlines())}
    assert manifest["inpainted.png"]["image"] == str(jobs / "in.png")
    assert manifest["inpainted.png"]["mask"] == str(jobs / "mask.png")
    assert (manifest["flag-image.png"]["image"], manifest["flag-image.png"]["strength"]) == (str(start), 0.6)
    assert "mask" not in manifest["img2img.png"]


@pytest.mark.parametrize("flags, expected", [
    (["--mask", "MASK"], "--mask needs --image"),
    (["--strength", "0.5"], "--strength needs --image"),
    (["--image", "IMAGE", "--strength", "1.5"], "--strength must be in (0, 1]"),
    (["--image", "/nonexistent/in.png"], "--image: no such file: '/nonexistent/in.png'"),
    (["--image", "IMAGE", "--mask", "/nonexistent/m.png"], "--mask: no such file"),
    (["--image", "TEXT"], "--image: cannot read"),
    (["--image", "IMAGE", "--mask", "TEXT"], "--mask: cannot read"),
    (["--image", "IMAGE", "--mask", "SMALL"], "--mask: mask"),
], ids=["mask-without-image", "strength-without-image", "bad-strength", "missing-image", "missing-mask",
        "image-not-an-image", "mask-not-an-image", "mask-of-another-size"])
@pytest.mark.slow
def test_bad_image_flags_are_usage_errors(capsys, no_model_load, tmp_path, flags, expected):  # noqa: F811
    files = {"IMAGE": png(picture(1)), "MASK": png(alpha_mask()), "SMALL": png(alpha_mask((16, 16))),
             "TEXT": b"not an image"}
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    flags = [str(tmp_path / f) if f in files else f for f in flags]
    err = expect_usage_error(capsys, "generate", "x", "--device", "cpu", *flags)
    assert expected in err, err
    if expected == "--mask: mask":
        assert "is 16x16, but image" in err and "must have the image's size" in err


@pytest.mark.parametrize("line, expected", [
    ({"prompt": "x", "mask": "MASK"}, ":2: a mask needs an image"),
    ({"prompt": "x", "image": "nope.png"}, ":2: image: no such file"),
    ({"prompt": "x", "image": 3}, ":2: image: must be a path or a list of paths"),
    ({"prompt": "x", "image": []}, ":2: image: must be a path or a list of paths"),
    ({"prompt": "x", "mask": ["MASK"], "image": "IMAGE"}, ":2: mask: must be a path"),
    ({"prompt": "x", "strength": 0.5}, ":2: strength needs an image"),
], ids=["mask-without-image", "missing-file", "not-a-path", "empty-list", "mask-list", "strength-without-image"])
@pytest.mark.slow
def test_bad_jsonl_inputs_are_usage_errors(capsys, no_model_load, tmp_path, line, expected):  # noqa: F811
    (tmp_path / "IMAGE").write_bytes(png(picture(1)))
    (tmp_path / "MASK").write_bytes(png(alpha_mask()))
    lines = tmp_path / "p.jsonl"
    lines.write_text("a plain line\n" + json.dumps(line) + "\n")
    err = expect_usage_error(capsys, "generate", "--prompts-file", str(lines), "--device", "cpu")
    assert expected in err, err
