"""MP4 (H.264) encoding of frames: the file decodes back to the frames (as many, the same size and rate; at crf 0
exactly the frames through yuv420p, whose halved colour resolution is the only loss; within H.264's loss at the
default quality), floats in [0, 1] and torch tensors are taken, and frames or settings it cannot encode are
refused with a reason."""
from __future__ import annotations

import av
import numpy as np
import pytest
import torch

from dvllm.video.mp4 import decode_mp4, encode_mp4, to_uint8_frames


def _moving_circle(frames: int = 9, size: tuple[int, int] = (48, 64)) -> np.ndarray:
    """A red circle moving right over a soft blue-green gradient: smooth content with motion."""
    h, w = size
    y, x = np.mgrid[0:h, 0:w]
    video = np.zeros((frames, h, w, 3), dtype=np.float32)
    for f in range(frames):
        video[f, ..., 1] = x / w * 0.6
        video[f, ..., 2] = y / h * 0.8
        inside = (x - (10 + 4 * f)) ** 2 + (y - h // 2) ** 2 < 64
        video[f][inside] = (0.9, 0.1, 0.1)
    return video


def _psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return 10 * np.log10(255.0 ** 2 / max(mse, 1e-12))


def _through_yuv420(frames: np.ndarray) -> np.ndarray:
    """The frames as the encoder sees them: RGB to yuv420p (colour at half the resolution) and back."""
    return np.stack([av.VideoFrame.from_ndarray(f, format="rgb24").reformat(format="yuv420p").to_ndarray(
        format="rgb24") for f in frames])


def test_an_mp4_decodes_back_to_its_frames():
    video = _moving_circle()
    data = encode_mp4(video, fps=16)
    assert data[4:8] == b"ftyp"
    assert data.find(b"moov") < data.find(b"mdat"), "faststart: the index before the media"
    frames, fps = decode_mp4(data)
    assert frames.shape == (9, 48, 64, 3) and fps == 16.0
    assert _psnr(frames, _through_yuv420(to_uint8_frames(video))) > 38
    # the motion survives: the red circle's centre moves 4 pixels a frame
    reds = [np.argwhere((f[..., 0] > 150) & (f[..., 1] < 100))[:, 1].mean() for f in frames]
    assert np.allclose(np.diff(reds), 4, atol=0.5), reds


def test_crf_0_is_lossless_past_the_colour_conversion_and_tensors_are_taken():
    video = torch.from_numpy(_moving_circle(frames=3))
    frames, _ = decode_mp4(encode_mp4(video, fps=8, crf=0))
    np.testing.assert_array_equal(frames, _through_yuv420(to_uint8_frames(video)))
    lossy, _ = decode_mp4(encode_mp4(video, fps=8, crf=40))
    assert np.abs(lossy.astype(int) - frames).max() > 0


def test_a_fractional_rate_is_kept():
    _, fps = decode_mp4(encode_mp4(_moving_circle(frames=4), fps=23.976))
    assert fps == pytest.approx(24000 / 1001, rel=1e-4)


@pytest.mark.parametrize("frames, kwargs, match", [
    (np.zeros((2, 47, 64, 3), np.uint8), {}, "even height and width"),
    (np.zeros((0, 48, 64, 3), np.uint8), {}, "at least one frame"),
    (np.zeros((2, 48, 64), np.uint8), {}, r"\[frames, height, width, 3\]"),
    (np.zeros((2, 48, 64, 3), np.int32), {}, "uint8, or floats"),
    (np.full((2, 48, 64, 3), np.nan, np.float32), {}, "not finite"),
    (np.zeros((2, 48, 64, 3), np.uint8), {"fps": 0}, "fps must be"),
    (np.zeros((2, 48, 64, 3), np.uint8), {"fps": float("inf")}, "fps must be"),
    (np.zeros((2, 48, 64, 3), np.uint8), {"fps": 1e-300}, "fps must be"),  # rounded to 0, written as 24 fps
    (np.zeros((2, 48, 64, 3), np.uint8), {"crf": 52}, "crf must be"),
])
def test_what_cannot_be_encoded_is_refused(frames, kwargs, match):
    with pytest.raises(ValueError, match=match):
        encode_mp4(frames, **{"fps": 16, **kwargs})


def test_the_slowest_rate_an_mp4_carries_is_written_and_a_slower_one_refused_everywhere():
    """fps=1e-300 was accepted and the MP4 silently written at 24 fps: the muxer's rate (a fraction of denominator
    <= 1001) rounds it to 0, which it replaces with 24. MIN_FPS is written as asked; a slower rate is refused by the
    writer, by SamplingParams (the Python API, the CLI's JSONL lines, the HTTP APIs) and by the defaults."""
    from dvllm import EngineConfig, SamplingParams
    from dvllm.param_defaults import MIN_FPS

    _, fps = decode_mp4(encode_mp4(_moving_circle(frames=2), fps=MIN_FPS))
    assert fps == pytest.approx(MIN_FPS, rel=1e-6)
    for slow in (1e-300, MIN_FPS / 2):
        with pytest.raises(ValueError, match="fps must be a finite number >= 0.001"):
            encode_mp4(_moving_circle(frames=2), fps=slow)
        with pytest.raises(ValueError, match=r"fps must be a number in \[0.001, 240\]"):
            SamplingParams(fps=slow).validate()
        with pytest.raises(ValueError, match=r"default_params: fps must be a number in \[0.001, 240\]"):
            EngineConfig(default_params={"fps": slow})


def test_a_file_without_video_is_refused():
    with pytest.raises(Exception):
        decode_mp4(b"not an mp4")
