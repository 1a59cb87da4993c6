"""`dvllm generate` on a video model (the tiny Wan pipeline), in-process through cli.main: one MP4 per video, named
and listed as images are, decoding to the engine's own frames at the request's rate; --save-frames; an image
model refuses video flags with the engine's message. And dvllm.video's save_video / save_frames for each output
type."""
from __future__ import annotations

import json
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from utils_cli import expect_usage_error, no_model_load, restore_logging, write_lines  # noqa: F401 (fixtures)

from dvllm import DiffusionEngine, SamplingParams
from dvllm.entrypoints.cli import main
from dvllm.entrypoints.generate_output import OutputThread
from dvllm.video import save_frames, save_video
from dvllm.video.mp4 import decode_mp4, encode_mp4

FAST = ["--device", "cpu", "--dtype", "float32", "--no-progress", "--steps", "2"]
# H.264 at crf 18 on the tiny model's noisy 16-pixel frames gives ~32-34 dB; its videos differ little by seed
# (by less than that loss), so which video a file holds is told by encoding the engine's frames alike
MIN_PSNR = 28.0


def generate(model: str, *args: str) -> int:
    return main(["generate", *args, "--model", model, *FAST])


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return 10 * np.log10(255.0 ** 2 / max(mse, 1e-12))


def engine_video(engine: DiffusionEngine, prompt: str, **params) -> np.ndarray:
    """The engine's own video for these parameters, as the uint8 frames a lossless file would hold."""
    out = engine.generate(prompt, SamplingParams(num_inference_steps=2, output_type="np", **params), use_tqdm=False)[0]
    assert out.error is None, out.error
    return np.round(np.clip(out.images[0], 0, 1) * 255).astype(np.uint8)


def read_mp4(path: Path) -> tuple[np.ndarray, float]:
    return decode_mp4(path.read_bytes())


def test_prompts_file_writes_one_mp4_per_video(wan_path, tmp_path, capsys):
    out_dir = tmp_path / "out"
    prompts = write_lines(tmp_path / "p.jsonl", [
        {"prompt": "a red circle", "seed": 1, "num_frames": 5, "size": "16x16", "fps": 8},
        {"prompt": "a blue square", "seed": 2, "num_frames": 9, "size": "32x16"},  # the model's fps
    ])
    assert generate(wan_path, "--prompts-file", str(prompts), "--output-dir", str(out_dir), "--save-frames") == 0
    assert sorted(p.name for p in out_dir.iterdir()) == ["00000-1-frames", "00000-1.mp4", "00001-2-frames",
                                                          "00001-2.mp4", "manifest.jsonl"]
    stdout = capsys.readouterr().out
    assert f"{out_dir / '00000-1.mp4'}  (seed 1, 2 steps)" in stdout and "2 videos in" in stdout

    engine = DiffusionEngine(model=wan_path, device="cpu", dtype="float32")
    default_fps = engine.model_info.video.fps
    expected = {"00000-1.mp4": ("a red circle", {"seed": 1, "num_frames": 5, "height": 16, "width": 16}, 8.0),
                "00001-2.mp4": ("a blue square", {"seed": 2, "num_frames": 9, "height": 16, "width": 32}, default_fps)}
    for name, (prompt, params, fps) in expected.items():
        frames, rate = read_mp4(out_dir / name)
        want = engine_video(engine, prompt, **params)
        assert frames.shape == want.shape == (params["num_frames"], params["height"], params["width"], 3), name
        assert rate == fps, name
        assert psnr(frames, want) > MIN_PSNR, name
        # the frame PNGs are the engine's frames exactly
        folder = out_dir / name.replace(".mp4", "-frames")
        pngs = sorted(folder.iterdir())
        assert [p.name for p in pngs] == [f"{k:05d}.png" for k in range(params["num_frames"])]
        np.testing.assert_array_equal(np.stack([np.asarray(Image.open(p)) for p in pngs]), want)
    # ...and the comparison can fail: another seed's video is another file
    other = engine_video(engine, "a red circle", seed=3, num_frames=5, height=16, width=16)
    assert not np.array_equal(read_mp4(out_dir / "00000-1.mp4")[0], decode_mp4(encode_mp4(other, 8.0))[0])

    manifest = [json.loads(line) for line in (out_dir / "manifest.jsonl").read_text().splitlines()]
    assert [(m["file"], m["num_frames"], m["fps"], m["size"], m["frames_folder"]) for m in manifest] == [
        ("00000-1.mp4", 5, 8.0, "16x16", "00000-1-frames"), ("00001-2.mp4", 9, default_fps, "32x16", "00001-2-frames")]
    # each MP4 is tagged with its prompt and parameters, as dvllm's PNGs are
    import av

    for m in manifest:
        with av.open(str(out_dir / m["file"])) as container:
            tags = container.metadata
        assert tags["title"] == m["prompt"] and json.loads(tags["comment"])["seed"] == m["seed"]


def test_flags_name_frames_and_fps_and_n_videos_get_numbered_files(wan_path, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # the default name lands in the working directory
    assert generate(wan_path, "x", "--num-frames", "5", "--fps", "10", "--size", "32x16", "--seed", "4",
                    "-n", "2") == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dvllm-4-0.mp4", "dvllm-4-1.mp4"]
    first, second = (read_mp4(tmp_path / f"dvllm-4-{k}.mp4") for k in (0, 1))
    assert first[0].shape == second[0].shape == (5, 16, 32, 3) and first[1] == second[1] == 10.0
    assert not np.array_equal(first[0], second[0])  # two videos of one request, not one twice
    assert "2 videos in" in capsys.readouterr().out


def test_videos_are_written_off_the_engine_loop(wan_path, tmp_path, monkeypatch):
    seen = []
    monkeypatch.setattr("dvllm.entrypoints.generate_output.save_video",
                        lambda *args, **kwargs: seen.append(threading.current_thread().name))
    assert generate(wan_path, "x", "-o", str(tmp_path / "x.mp4"), "--num-frames", "5", "--size", "16x16") == 0
    assert seen == ["dvllm-generate-writer"]


def test_output_thread_keeps_order_and_hands_back_a_failed_write():
    done: list[int] = []
    thread = OutputThread(backlog=1)
    for k in range(5):
        thread.submit(lambda k=k: done.append(k))
    thread.close()
    assert done == [0, 1, 2, 3, 4]

    def fail() -> None:
        raise OSError("disk full")
    thread = OutputThread()
    thread.submit(fail)
    thread.submit(lambda: done.append(99))  # skipped: the run stops at the first failed write
    with pytest.raises(OSError, match="disk full"):
        thread.close()
    assert 99 not in done


@pytest.mark.slow
def test_an_image_model_refuses_video_flags_with_the_engines_message(sd_eps_path, tmp_path, capsys):
    engine = DiffusionEngine(model=sd_eps_path, device="cpu", dtype="float32")
    with pytest.raises(ValueError) as refused:
        SamplingParams(num_frames=5).resolve(engine.model_info, engine.config)
    for flags in (["--num-frames", "5"], ["--fps", "12"]):
        err = expect_usage_error(capsys, "generate", "x", "-o", str(tmp_path / "x.png"), "--model", sd_eps_path,
                                 *FAST, "--size", "16x16", *flags)
        assert "makes images, not videos" in err
    assert str(refused.value) in expect_usage_error(
        capsys, "generate", "x", "-o", str(tmp_path / "x.png"), "--model", sd_eps_path, *FAST, "--num-frames", "5")
    prompts = write_lines(tmp_path / "p.jsonl", [{"prompt": "x", "num_frames": 5}])
    err = expect_usage_error(capsys, "generate", "--prompts-file", str(prompts), "--output-dir", str(tmp_path / "o"),
                             "--model", sd_eps_path, *FAST)
    assert f"{prompts}:1: {refused.value}" in err
    err = expect_usage_error(capsys, "generate", "x", "-o", str(tmp_path / "x.mp4"), "--model", sd_eps_path, *FAST)
    assert "this model makes images" in err
    assert not list(tmp_path.glob("*.png")) and not (tmp_path / "o").exists()


def test_a_video_model_refuses_image_names_and_bad_frames(wan_path, tmp_path, capsys):
    err = expect_usage_error(capsys, "generate", "x", "-o", str(tmp_path / "x.png"), "--model", wan_path, *FAST)
    assert "this model makes videos: give a .mp4 name" in err
    err = expect_usage_error(capsys, "generate", "x", "-o", str(tmp_path / "x.mp4"), "--model", wan_path, *FAST,
                             "--num-frames", "6")
    assert "num_frames - 1 must be a multiple of 4" in err
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("flags, message", [
    (["--num-frames", "0"], "--num-frames must be >= 1"),
    (["--fps", "0"], "--fps must be a number in [0.001, 240]"),
    (["--fps", "1e-300"], "--fps must be a number in [0.001, 240], got 1e-300"),  # was written at 24 fps
    (["--fps", "nan"], "--fps must be a number"),
])
def test_bad_video_flags_are_refused_before_the_model_loads(no_model_load, tmp_path, capsys, flags,  # noqa: F811
                                                           message):
    err = expect_usage_error(capsys, "generate", "x", "-o", str(tmp_path / "x.mp4"), "--model", str(tmp_path),
                             *flags)
    assert message in err


# -- dvllm.video.save_video / save_frames ------------------------------------------------------------

def moving_square(frames: int = 5, height: int = 16, width: int = 32) -> np.ndarray:
    """Floats in [0, 1]: a square moving right over a soft gradient. At crf 18 such tiny frames come back at
    ~34 dB (the colour at half resolution and 16-pixel blocks cost most)."""
    y, x = np.mgrid[0:height, 0:width]
    video = np.full((frames, height, width, 3), 0.4, dtype=np.float32)
    for f in range(frames):
        video[f, ..., 1], video[f, ..., 2] = 0.2 + x / width * 0.5, 0.2 + y / height * 0.5
        video[f, 4:12, 2 + 4 * f:10 + 4 * f] = (0.8, 0.6, 0.4)
    return video


def as_output_type(video: np.ndarray, output_type: str):
    """The video as DiffusionEngine gives it for output_type."""
    if output_type == "pt":
        return torch.from_numpy(video).permute(0, 3, 1, 2)  # [frames, 3, H, W]
    if output_type == "pil":
        return [Image.fromarray(f) for f in np.round(video * 255).astype(np.uint8)]
    return video


@pytest.mark.parametrize("output_type", ["np", "pt", "pil"])
def test_save_video_and_save_frames_round_trip(tmp_path, output_type):
    video = moving_square()
    pixels = np.round(video * 255).astype(np.uint8)
    save_video(as_output_type(video, output_type), tmp_path / "v.mp4", fps=12)
    frames, fps = read_mp4(tmp_path / "v.mp4")
    assert frames.shape == (5, 16, 32, 3) and fps == 12.0
    assert psnr(frames, pixels) > 30
    # these frames in this layout (a transposed or channel-swapped one comes back near 10 dB). Not compared with a
    # second encode of the same pixels: under load x264 gave another stream now and then (2026-12-04)

    paths = save_frames(as_output_type(video, output_type), tmp_path / "frames")
    assert [Path(p).name for p in paths] == [f"{k:05d}.png" for k in range(5)]
    np.testing.assert_array_equal(np.stack([np.asarray(Image.open(p)) for p in paths]), pixels)


def test_save_video_takes_uint8_and_bfloat16_and_refuses_what_it_cannot_write(tmp_path):
    video = moving_square()
    pixels = np.round(video * 255).astype(np.uint8)
    save_video(pixels, tmp_path / "u8.mp4", fps=8)
    save_video(torch.from_numpy(video).permute(0, 3, 1, 2).to(torch.bfloat16), tmp_path / "bf16.mp4", fps=8)
    assert psnr(read_mp4(tmp_path / "u8.mp4")[0], pixels) > 30
    assert psnr(read_mp4(tmp_path / "bf16.mp4")[0], pixels) > 30  # bfloat16 keeps 8 bits of mantissa
    with pytest.raises(ValueError, match="must end in .mp4"):
        save_video(video, tmp_path / "v.gif", fps=8)
    with pytest.raises(ValueError, match="fps"):
        save_video(video, tmp_path / "v.mp4", fps=0)
    with pytest.raises(ValueError, match="at least one frame"):
        save_frames([], tmp_path / "none")
    with pytest.raises(ValueError, match=r"\[frames, height, width, 3\]"):
        save_video(video[0], tmp_path / "v.mp4", fps=8)  # one image, not a video
    assert not (tmp_path / "v.mp4").exists() and not (tmp_path / "none").exists()
