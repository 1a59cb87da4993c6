"""Frames to an MP4 file (H.264 in yuv420p, which every browser and player plays) and back, with PyAV, whose wheels
ship FFmpeg with libx264: no system ffmpeg to install. The encode runs where outputs are made (the output
processing, off the engine core's step loop); one call is bounded by the frames it is given.

The moov atom goes first (`faststart`), so a browser starts playing a served file before it has all of it."""
from __future__ import annotations

import io
import math
import os
import tempfile
from fractions import Fraction
from typing import Any

import numpy as np

from dvllm.param_defaults import MIN_FPS

DEFAULT_CRF = 18  # x264's constant rate factor: 18 is visually lossless for most content; 0 is lossless
MAX_CRF = 51
RATE_DENOMINATOR = 1001  # the rate is written as a fraction of at most this denominator: 24000/1001 exactly


def to_uint8_frames(frames: Any) -> np.ndarray:
    """[F, H, W, 3] uint8 from frames as uint8, or as floats in [0, 1] (a numpy array or a torch tensor)."""
    array = frames.detach().cpu().numpy() if hasattr(frames, "detach") else np.asarray(frames)
    if array.ndim != 4 or array.shape[-1] != 3:
        raise ValueError(f"frames must be [frames, height, width, 3], got shape {tuple(array.shape)}")
    if array.shape[0] == 0:
        raise ValueError("frames: a video needs at least one frame")
    if array.dtype == np.uint8:
        return array
    if not np.issubdtype(array.dtype, np.floating):
        raise ValueError(f"frames must be uint8, or floats in [0, 1], got {array.dtype}")
    if not np.isfinite(array).all():
        raise ValueError("frames hold values that are not finite numbers")
    return np.round(np.clip(array, 0.0, 1.0) * 255).astype(np.uint8)


def encode_mp4(frames: Any, fps: float, crf: int = DEFAULT_CRF, metadata: dict[str, str] | None = None) -> bytes:
    """The frames ([F, H, W, 3], uint8 or floats in [0, 1]) as an H.264 MP4 file at `fps` frames a second;
    `metadata`: the container's tags (e.g. title: the prompt, comment: the parameters as JSON, as dvllm's PNGs
    carry them), which players and ffprobe show."""
    import av

    pixels = to_uint8_frames(frames)
    height, width = pixels.shape[1:3]
    if height % 2 or width % 2:
        raise ValueError(f"an H.264 video in yuv420p needs an even height and width, got {height}x{width}")
    if isinstance(fps, bool) or not isinstance(fps, (int, float)) or not math.isfinite(fps) or fps < MIN_FPS:
        raise ValueError(f"fps must be a finite number >= {MIN_FPS:g} (an MP4 carries no slower rate), got {fps!r}")
    if isinstance(crf, bool) or not isinstance(crf, int) or not 0 <= crf <= MAX_CRF:
        raise ValueError(f"crf must be an integer in [0, {MAX_CRF}], got {crf!r}")
    # A file, not memory: faststart moves the index in a second pass that reopens the file by its name
    with tempfile.TemporaryDirectory(prefix="dvllm-mp4-") as folder:
        path = os.path.join(folder, "video.mp4")
        with av.open(path, mode="w", format="mp4", options={"movflags": "+faststart"}) as container:
            container.metadata.update(metadata or {})
            # (a rate of 0 here would be written as 24 fps: MIN_FPS keeps it near fps)
            stream = container.add_stream("libx264", rate=Fraction(fps).limit_denominator(RATE_DENOMINATOR))
            stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
            stream.options = {"crf": str(crf)}
            for pixel in pixels:
                container.mux(stream.encode(av.VideoFrame.from_ndarray(pixel, format="rgb24")))
            container.mux(stream.encode())  # the frames the encoder still holds
        with open(path, "rb") as f:
            return f.read()


def decode_mp4(data: bytes) -> tuple[np.ndarray, float]:
    """An MP4 file's first video stream as [F, H, W, 3] uint8 frames, and its frame rate."""
    import av

    with av.open(io.BytesIO(data), mode="r") as container:
        stream = container.streams.video[0]
        frames = [frame.to_ndarray(format="rgb24") for frame in container.decode(stream)]
        rate = float(stream.average_rate) if stream.average_rate else float("nan")
    if not frames:
        raise ValueError("the file holds no video frames")
    return np.stack(frames), rate
