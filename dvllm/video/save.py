"""Saving a video that DiffusionEngine made: as an MP4 file (save_video) or as one PNG per frame (save_frames).

Either takes one video of a finished RequestOutput's `images`, whatever its output_type: "np" (floats in [0, 1],
[frames, H, W, 3]), "pt" (a tensor [frames, 3, H, W]) or "pil" (a list of PIL frames); uint8 arrays too.

    out = engine.generate("a red circle moving right", SamplingParams(num_frames=33))[0]
    save_video(out.images[0], "circle.mp4", fps=16)
"""
from __future__ import annotations

import os
from typing import Any

import numpy as np
from PIL import Image

from dvllm.video.mp4 import DEFAULT_CRF, encode_mp4, to_uint8_frames

VIDEO_SUFFIX = ".mp4"


def video_frames(video: Any) -> np.ndarray:
    """One video of any output type as [frames, H, W, 3] uint8."""
    if isinstance(video, (list, tuple)):  # "pil": one image per frame
        if not video:
            raise ValueError("frames: a video needs at least one frame")
        frames = [np.asarray(f.convert("RGB")) if isinstance(f, Image.Image) else np.asarray(f) for f in video]
        if len({f.shape for f in frames}) > 1:
            raise ValueError(f"frames: every frame must have one size, got {sorted({f.shape for f in frames})}")
        return to_uint8_frames(np.stack(frames))
    if hasattr(video, "detach"):  # "pt": a torch tensor [frames, 3, H, W], on any device, in any dtype
        tensor = video.detach().cpu()
        if tensor.is_floating_point():
            tensor = tensor.float()  # numpy has no bfloat16
        if tensor.ndim == 4 and tensor.shape[1] == 3:
            tensor = tensor.permute(0, 2, 3, 1)
        return to_uint8_frames(tensor.numpy())
    return to_uint8_frames(video)  # "np": [frames, H, W, 3]


def save_video(frames: Any, path: str | os.PathLike[str], fps: float, crf: int = DEFAULT_CRF,
               metadata: dict[str, str] | None = None) -> None:
    """Writes the video as an H.264 MP4 at `fps` frames a second (crf: x264's quality, 0 lossless, 18 default;
    metadata: the container's tags)."""
    if os.path.splitext(os.fspath(path))[1].lower() != VIDEO_SUFFIX:
        raise ValueError(f"save_video writes MP4 (H.264): the path must end in {VIDEO_SUFFIX}, got {os.fspath(path)!r}")
    data = encode_mp4(video_frames(frames), fps, crf, metadata)
    with open(path, "wb") as f:
        f.write(data)


def save_frames(frames: Any, folder: str | os.PathLike[str]) -> list[str]:
    """Writes each frame as a PNG (00000.png, 00001.png, ...) into `folder`, made if missing; returns their paths."""
    pixels = video_frames(frames)
    os.makedirs(folder, exist_ok=True)
    paths = [os.path.join(folder, f"{k:05d}.png") for k in range(len(pixels))]
    for frame, path in zip(pixels, paths):
        Image.fromarray(frame).save(path)
    return paths
