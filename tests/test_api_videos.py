"""/v1/videos (OpenAI's Videos API) on a video model: the real `dvllm serve` with the tiny Wan pipeline, driven by
the openai client (which sends multipart forms) and raw httpx (JSON); an in-process app for a job that fails and
for an image model. No test depends on the machine's speed: a job meant to outlast something has ENDLESS steps
and is deleted, and waits poll what the server reports, bounded by WAIT (reached only when something is broken).
"""
from __future__ import annotations

import argparse
import base64
import io
import json
import math
import time

import httpx
import numpy as np
import openai
import pytest
from fastapi.testclient import TestClient
from openai import OpenAI
from openai.types import Video
from PIL import Image
from utils_cli import serve_args
from utils_server import BASE_ARGS, MAX_STEPS, WAIT, RemoteServer, assert_error, assert_idle, wait_until

from dvllm import DiffusionEngine, SamplingParams
from dvllm.engine.async_engine import AsyncDiffusionEngine
from dvllm.entrypoints.api_server import build_app
from dvllm.entrypoints.video_jobs import VideoJob, VideoJobs
from dvllm.entrypoints.video_protocol import frames_for_seconds
from dvllm.video.mp4 import decode_mp4, encode_mp4

MODEL = "wan"
STORE = 3
SERVER_ARGS = [*BASE_ARGS, "--served-model-name", MODEL, *MAX_STEPS, "--video-store-size", str(STORE)]
FAST = {"num_inference_steps": 3, "size": "32x16", "frames": 5}
# Minutes at the ~10 ms a step takes here, and still 20 s at 1 ms: every test deletes the ENDLESS jobs it starts.
ENDLESS = {"num_inference_steps": 20_000, "sampler": "flow_euler", "size": "16x16", "frames": 5, "guidance_scale": 1.0}


@pytest.fixture(scope="module")
def server(wan_path):
    with RemoteServer(wan_path, SERVER_ARGS) as s:
        yield s


@pytest.fixture
def started(server):
    """The ids of the jobs a test starts: any left are deleted after it, and the engine must then be idle."""
    ids: list[str] = []
    yield ids
    for video_id in ids:
        for _ in range(2):  # an unfinished job's first DELETE cancels it, the second drops it
            httpx.delete(f"{server.url}/v1/videos/{video_id}", timeout=WAIT)
    assert_idle(server.url)


@pytest.fixture
def client(server):
    return OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def post(server, body: dict, started: list[str] | None = None) -> httpx.Response:
    response = httpx.post(server.url + "/v1/videos", json=body, timeout=WAIT)
    if response.status_code == 200 and started is not None:
        started.append(response.json()["id"])
    return response


def job(server, video_id: str) -> dict:
    return httpx.get(f"{server.url}/v1/videos/{video_id}", timeout=WAIT).json()


def wait_for(server, video_id: str, done) -> dict:
    seen = {}

    def check() -> bool:
        seen.update(job(server, video_id))
        return done(seen)
    wait_until(check, what=f"video {video_id} to reach a state")
    return seen


def events(response: httpx.Response):
    """The (event, data) pairs of a server-sent event stream, as they arrive."""
    event = None
    for line in response.iter_lines():
        if line.startswith("event: "):
            event = line.removeprefix("event: ")
        elif line.startswith("data: "):
            yield event, json.loads(line.removeprefix("data: "))


def png(size: tuple[int, int] = (16, 16)) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", size, (200, 30, 30)).save(buffer, format="PNG")
    return buffer.getvalue()


# -- the openai client ------------------------------------------------------------------------------

@pytest.mark.slow
def test_openai_client_video_is_the_engines_for_the_same_seed(server, client, started, wan_path):
    params = {"seed": 3, "steps": 3, "crf": 0}  # crf 0: lossless H.264, so the frames can be compared closely
    video = client.videos.create(prompt="a red ball", seconds="0.5", size="32x16", extra_body=params)
    started.append(video.id)
    assert (video.object, video.status, video.progress, video.model) == ("video", "queued", 0, MODEL)
    assert video.id.startswith("video_") and video.size == "32x16"
    assert video.seconds == "0.5625"  # 0.5 s at 16 fps is 8 frames; the nearest count Wan makes is 9
    wait_for(server, video.id, lambda j: j["status"] in ("completed", "failed"))
    done = client.videos.retrieve(video.id)
    assert (done.status, done.progress, done.error) == ("completed", 100, None), done
    assert done.completed_at >= done.created_at and done.seed == 3
    frames, fps = decode_mp4(client.videos.download_content(video.id).content)
    assert frames.shape == (9, 16, 32, 3) and fps == 16.0

    engine = DiffusionEngine(model=wan_path, device="cpu", dtype="float32")

    def encoded(seed: int) -> tuple[np.ndarray, np.ndarray]:
        p = SamplingParams(num_inference_steps=3, height=16, width=32, num_frames=9, seed=seed, output_type="np")
        raw = engine.generate("a red ball", p, use_tqdm=False)[0].images[0]
        return raw, decode_mp4(encode_mp4(raw, 16.0, crf=0))[0].astype(np.float64)
    raw, mine = encoded(3)
    _, other = encoded(4)
    same, differ = np.abs(frames - mine).mean(), np.abs(frames - other).mean()
    assert same < 0.25 * differ, (same, differ)  # the check can fail: another seed is far further
    mse = ((frames - raw * 255) ** 2).mean()
    assert 10 * np.log10(255**2 / mse) > 30  # and the MP4 shows the engine's frames (yuv420p costs a little)


@pytest.mark.slow
def test_openai_client_lists_newest_first_in_pages(server, client, started):
    ids = [post(server, {"prompt": f"clip {i}", **FAST}, started).json()["id"] for i in range(2)]
    for video_id in ids:
        wait_for(server, video_id, lambda j: j["status"] == "completed")
    first = client.videos.list(limit=1)
    assert [v.id for v in first.data] == [ids[1]] and first.has_more
    second = first.get_next_page()
    assert [v.id for v in second.data] == [ids[0]]
    oldest_first = [v.id for v in client.videos.list(order="asc").data]
    assert oldest_first[-2:] == ids
    assert_error(httpx.get(server.url + "/v1/videos", params={"after": "video_nope"}, timeout=WAIT), 400, "after")
    assert_error(httpx.get(server.url + "/v1/videos", params={"limit": 0}, timeout=WAIT), 400, "limit")


def test_input_reference_is_refused_until_image_to_video_lands(server, client, started):
    with pytest.raises(openai.BadRequestError) as refused:
        client.videos.create(prompt="x", input_reference=("start.png", png(), "image/png"), size="16x16",
                             extra_body={"frames": 5})
    assert refused.value.body["param"] == "input_reference"
    assert "not supported for the wan family" in refused.value.body["message"]
    data_url = "data:image/png;base64," + base64.b64encode(png()).decode()
    response = post(server, {"prompt": "x", "input_reference": {"image_url": data_url}, **FAST}, started)
    assert "not supported" in assert_error(response, 400, "input_reference")["message"]
    response = post(server, {"prompt": "x", "input_reference": {"image_url": "https://a.example/x.png"}, **FAST},
                    started)
    assert "fetches no URLs" in assert_error(response, 400, "input_reference")["message"]


# -- the job's life ------------------------------------------------------------------------------------

def test_events_stream_each_step_then_the_completed_job(server, started):
    video_id = post(server, {"prompt": "a wave", **{**FAST, "num_inference_steps": 8}}, started).json()["id"]
    with httpx.stream("GET", f"{server.url}/v1/videos/{video_id}/events", timeout=WAIT) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        seen = list(events(response))
    order = ["video.queued", "video.in_progress", "video.completed"]
    kinds = [kind for kind, _ in seen]
    assert kinds[-1] == "video.completed" and kinds == sorted(kinds, key=order.index), kinds
    progress = [data["progress"] for _, data in seen]
    assert progress == sorted(progress) and progress[-1] == 100
    assert all(p < 100 for kind, p in zip(kinds, progress) if kind != "video.completed")
    for kind, data in seen:
        assert data["type"] == kind and data["id"] == video_id and set(Video.model_fields) <= set(data)
    steps = [data["step"] for _, data in seen]
    assert steps == sorted(steps) and seen[-1][1]["step"] == seen[-1][1]["num_steps"] == 8
    for kind, data in seen:  # an estimate after each step (its value depends on the machine), 0 once completed
        assert (data["eta_seconds"] is None) == (data["step"] == 0), data
        if data["step"]:
            assert math.isfinite(data["eta_seconds"]) and data["eta_seconds"] >= 0
    assert seen[-1][1]["eta_seconds"] == 0


def test_delete_cancels_a_running_job_which_then_reports_it_until_deleted_again(server, started):
    video_id = post(server, {"prompt": "forever", **ENDLESS}, started).json()["id"]
    with httpx.stream("GET", f"{server.url}/v1/videos/{video_id}/events", timeout=WAIT) as response:
        stream = events(response)
        for kind, data in stream:
            if data["status"] == "in_progress":
                break
        assert (kind, data["status"]) == ("video.in_progress", "in_progress")
        error = assert_error(httpx.get(f"{server.url}/v1/videos/{video_id}/content", timeout=WAIT), 409)
        assert error["code"] == "video_not_ready"
        cancelled = httpx.delete(f"{server.url}/v1/videos/{video_id}", timeout=WAIT).json()
        assert (cancelled["id"], cancelled["object"], cancelled["deleted"], cancelled["cancelled"]) == (
            video_id, "video.deleted", False, True)
        last_kind, last = list(stream)[-1]
        assert (last_kind, last["status"], last["error"]["code"]) == ("video.failed", "failed", "cancelled")
    assert_idle(server.url)  # the engine request was aborted: nothing runs, no state held
    later = job(server, video_id)
    assert (later["status"], later["error"]["code"], later["eta_seconds"]) == ("failed", "cancelled", None)
    assert later == cancelled["video"] and 1 <= later["step"] < later["num_steps"]
    assert f"after {later['step']} of {later['num_steps']} steps" in later["error"]["message"]
    deleted = httpx.delete(f"{server.url}/v1/videos/{video_id}", timeout=WAIT).json()
    assert deleted == {"id": video_id, "object": "video.deleted", "deleted": True}
    assert_error(httpx.get(f"{server.url}/v1/videos/{video_id}", timeout=WAIT), 404, "video_id")


def test_a_store_full_of_unfinished_jobs_refuses_new_ones_and_loses_none(server, started):
    for _ in range(STORE):
        assert post(server, {"prompt": "forever", **ENDLESS}, started).status_code == 200
    refused = post(server, {"prompt": "one more", **FAST}, started)
    error = assert_error(refused, 429)
    assert error["code"] == "rate_limit_exceeded" and "--video-store-size" in error["message"]
    assert refused.headers["retry-after"]
    assert all(job(server, video_id)["status"] in ("queued", "in_progress") for video_id in started)
    httpx.delete(f"{server.url}/v1/videos/{started[0]}", timeout=WAIT)
    assert post(server, {"prompt": "now it fits", **FAST}, started).status_code == 200


def test_finished_jobs_are_evicted_oldest_first(server, started):
    ids = []
    for i in range(STORE + 1):
        ids.append(post(server, {"prompt": f"clip {i}", **FAST}, started).json()["id"])
        wait_for(server, ids[-1], lambda j: j["status"] == "completed")
    assert_error(httpx.get(f"{server.url}/v1/videos/{ids[0]}/content", timeout=WAIT), 404, "video_id")
    for video_id in ids[1:]:
        assert httpx.get(f"{server.url}/v1/videos/{video_id}/content", timeout=WAIT).status_code == 200


# -- refusals ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("body, status, param, fragment", [
    ({"prompt": "x", "size": "24x16", "frames": 5}, 400, "size", "multiple of 16"),
    ({"prompt": "x", "size": "big", "frames": 5}, 400, "size", "WIDTHxHEIGHT"),
    ({"prompt": "x", "size": "16x16", "frames": 6}, 400, "num_frames", "num_frames - 1 must be a multiple of 4"),
    ({"prompt": "x", "size": "16x16", "seconds": "100"}, 400, "seconds", "1601 frames, but num_frames must be at most"),
    ({"prompt": "x", "size": "16x16", "seconds": 1, "frames": 5}, 400, "seconds", "not both"),
    ({"prompt": "x", "seconds": "four"}, 400, "seconds", "number of seconds"),
    ({"prompt": "x", "seconds": 0}, 400, "seconds", "number of seconds"),
    ({"prompt": "x", "size": "16x16", "fps": 500}, 400, "fps", "fps must be a number in"),
    ({"prompt": "x", "size": "16x16", "fps": 1e-300}, 400, "fps", "fps must be a number in [0.001, 240]"),
    ({"prompt": "x", "crf": 52}, 400, "crf", ""),
    ({"prompt": "x", "priority": 1}, 400, "priority", "--allow-client-priority"),
    ({"size": "16x16"}, 400, "prompt", "Missing"),
    ({"prompt": "x", "model": "sora-2"}, 404, "model", "this server serves 'wan'"),
], ids=lambda v: json.dumps(v) if isinstance(v, dict) else None)
def test_bad_requests_are_refused_naming_the_field_and_make_no_job(server, started, body, status, param, fragment):
    before = httpx.get(server.url + "/v1/videos", timeout=WAIT).json()["data"]
    assert fragment in assert_error(post(server, body, started), status, param)["message"]
    assert httpx.get(server.url + "/v1/videos", timeout=WAIT).json()["data"] == before


def test_unknown_ids_are_404_and_only_the_video_variant_is_served(server, started):
    for method, path in [("GET", ""), ("GET", "/content"), ("GET", "/events"), ("DELETE", "")]:
        response = httpx.request(method, f"{server.url}/v1/videos/video_unknown{path}", timeout=WAIT)
        assert assert_error(response, 404, "video_id")["code"] == "not_found"
    video_id = post(server, {"prompt": "x", **FAST}, started).json()["id"]
    wait_for(server, video_id, lambda j: j["status"] == "completed")
    url = f"{server.url}/v1/videos/{video_id}/content"
    assert_error(httpx.get(url, params={"variant": "thumbnail"}, timeout=WAIT), 400, "variant")
    response = httpx.get(url, params={"variant": "video"}, timeout=WAIT)
    assert response.headers["content-type"] == "video/mp4" and decode_mp4(response.content)[0].shape[0] == 5


def test_a_video_model_refuses_the_image_routes(server):
    error = assert_error(httpx.post(server.url + "/v1/images/generations", json={"prompt": "x"}, timeout=WAIT), 400)
    assert "makes videos" in error["message"] and "/v1/videos" in error["message"]
    response = httpx.post(server.url + "/v1/images/edits", data={"prompt": "x"},
                          files={"image": ("a.png", png(), "image/png")}, timeout=WAIT)
    assert "/v1/videos" in assert_error(response, 400)["message"]


def test_the_model_card_tells_the_default_frames_and_fps(server):
    card = httpx.get(server.url + "/v1/models", timeout=WAIT).json()["data"][0]
    assert card["dvllm"]["video"] == {"num_frames": 81, "fps": 16.0, "frame_multiple": 4, "seconds": 5.062,
                                      "max_num_frames": 129}


# -- in process: a job that fails, an image model, the flags ----------------------------------------

@pytest.mark.slow
def test_a_job_past_the_request_timeout_fails_with_an_error_object(wan_path):
    engine = AsyncDiffusionEngine(model=wan_path, device="cpu", dtype="float32", max_inference_steps=20_000)
    with TestClient(build_app(engine, argparse.Namespace(request_timeout=0.5))) as app:
        video_id = app.post("/v1/videos", json={"prompt": "forever", **ENDLESS}).json()["id"]
        deadline = time.monotonic() + WAIT
        while (failed := app.get(f"/v1/videos/{video_id}").json())["status"] != "failed":
            assert time.monotonic() < deadline, failed
            time.sleep(0.05)
        assert Video.construct(**failed).error.code == "timeout"  # (the openai client's parse: its sizes are Sora's)
        assert failed["completed_at"] is not None and "--request-timeout" in failed["error"]["message"]
        assert assert_error(app.get(f"/v1/videos/{video_id}/content"), 409)["code"] == "video_failed"
        with app.stream("GET", f"/v1/videos/{video_id}/events") as response:
            assert [kind for kind, _ in events(response)] == ["video.failed"]


def test_an_image_model_refuses_videos_behind_the_api_key(sd_eps_path):
    engine = AsyncDiffusionEngine(model=sd_eps_path, device="cpu", dtype="float32", state_pool_mb=16)
    args = argparse.Namespace(served_model_name="tiny", api_key="sk-video")
    with TestClient(build_app(engine, args)) as app:
        assert assert_error(app.post("/v1/videos", json={"prompt": "x"}), 401)["code"] == "invalid_api_key"
        assert_error(app.get("/v1/videos"), 401)
        response = app.post("/v1/videos", json={"prompt": "x"}, headers={"Authorization": "Bearer sk-video"})
        assert "makes images, not videos" in assert_error(response, 400)["message"]
        card = app.get("/v1/models", headers={"Authorization": "Bearer sk-video"}).json()["data"][0]
        assert "video" not in card["dvllm"]


def test_the_store_flags_are_checked_and_reach_the_app(sd_eps_path):
    for flags, message in [(("--video-store-size", "0"), "--video-store-size must be >= 1"),
                           (("--video-store-mb", "0"), "--video-store-mb must be > 0"),
                           (("--video-store-mb", "nan"), "--video-store-mb must be > 0")]:
        with pytest.raises(ValueError, match=message):
            serve_args(*flags)
    store = build_app(_StubEngine(), serve_args("--video-store-size", "5", "--video-store-mb", "2")).state.ctx.videos
    assert (store.capacity, store.max_bytes) == (5, 2 << 20)


class _StubEngine:
    """Enough of an engine for build_app; never started."""

    def __init__(self) -> None:
        self.loaded_model = argparse.Namespace(name="stub")
        self.step_listeners: list = []

    def stats(self) -> dict:
        return {}


# -- the store and the frame rule, alone -------------------------------------------------------------

def _job(**kw) -> VideoJob:
    return VideoJob(model="m", prompt="p", width=16, height=16, num_frames=5, fps=16.0, **kw)


@pytest.mark.slow
def test_the_store_evicts_finished_jobs_oldest_first_by_count_and_bytes():
    store = VideoJobs(capacity=3, max_bytes=100)
    a, b, c = _job(), _job(), _job()
    assert all(store.add(j) for j in (a, b, c))
    assert not store.add(_job())  # all unfinished: refused, none lost
    store.complete(b, b"x" * 60)
    assert store.add(d := _job()) and store.get(b.id) is None and len(store) == 3  # b was the only finished one
    store.complete(a, b"x" * 60)
    store.complete(c, b"x" * 60)  # 120 bytes: a (the oldest finished) goes
    assert store.get(a.id) is None and store.get(c.id).status == "completed" and store.num_bytes == 60
    store.complete(d, b"x" * 101)  # larger than the store alone: failed, saying why, and c is kept
    assert d.status == "failed" and d.error["code"] == "video_too_large" and store.get(c.id) is c
    assert [j.id for j in store.page(None, 10, newest_first=True)[0]] == [d.id, c.id]
    assert store.page(c.id, 10, newest_first=False) == ([d], False)
    with pytest.raises(KeyError):
        store.page(a.id, 10, newest_first=True)


def test_progress_is_the_steps_done_in_percent_and_99_until_the_mp4_is_ready():
    video = _job()
    changed = video.changed
    video.advance(0, 8, seed=5)
    assert (video.status, video.progress, video.seed) == ("queued", 0, 5) and changed.is_set()
    video.advance(3, 8, seed=5)
    assert (video.status, video.progress) == ("in_progress", 37)
    assert video.to_json()["decode_tiled"] is False
    video.advance(8, 8, seed=5, eta_s=0.0, decode_tiled=True)
    assert (video.status, video.progress) == ("in_progress", 99)  # the decode and the encode still run
    assert (video.step, video.num_steps, video.eta_seconds) == (8, 8, 0.0)
    assert video.to_json()["decode_tiled"] is True  # (max_decode_mb chose a tiled decode for it)
    store = VideoJobs(capacity=1, max_bytes=10)
    store.add(video)
    store.complete(video, b"mp4")
    assert (video.status, video.progress, video.mp4) == ("completed", 100, b"mp4")
    video.advance(8, 8, seed=5)  # nothing moves a finished job
    video.fail("late", "too late")
    assert (video.status, video.error) == ("completed", None)


@pytest.mark.parametrize("seconds, fps, frames", [(4, 16, 65), (5, 16, 81), (0.5, 16, 9), (7 / 16, 16, 9),
                                                  (0.01, 16, 1), (5, 24, 121)])
def test_seconds_become_the_nearest_frame_count_the_model_makes(seconds, fps, frames):
    assert frames_for_seconds(seconds, fps, 4) == frames


@pytest.mark.slow
def test_the_mp4_is_served_in_byte_ranges_for_players_that_seek(server, started):
    """A <video> element asks for `Range: bytes=...` and seeks only where the server answers 206."""
    video_id = post(server, {"prompt": "x", **FAST}, started).json()["id"]
    wait_for(server, video_id, lambda j: j["status"] == "completed")
    url = f"{server.url}/v1/videos/{video_id}/content"
    whole = httpx.get(url, timeout=WAIT)
    assert whole.status_code == 200 and whole.headers["accept-ranges"] == "bytes"
    size = len(whole.content)
    asked = (("bytes=0-99", 0, 99), ("bytes=100-", 100, size - 1), ("bytes=-50", size - 50, size - 1),
             (f"bytes=10-{size + 99}", 10, size - 1))
    for header, first, last in asked:
        part = httpx.get(url, headers={"Range": header}, timeout=WAIT)
        assert part.status_code == 206, header
        assert part.headers["content-range"] == f"bytes {first}-{last}/{size}"
        assert part.content == whole.content[first:last + 1]
    for header in (f"bytes={size}-", "bytes=-0"):
        refused = httpx.get(url, headers={"Range": header}, timeout=WAIT)
        assert refused.status_code == 416 and refused.headers["content-range"] == f"bytes */{size}"
    for header in ("bytes=0-1,5-9", "items=0-3", "bytes=9-2"):  # several ranges, another unit, reversed: the whole
        again = httpx.get(url, headers={"Range": header}, timeout=WAIT)
        assert again.status_code == 200 and again.content == whole.content
