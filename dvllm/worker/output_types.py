"""Decoded pixels -> what a request asked for (PIL images, arrays or tensors): the loop's decode, the decode
stage's thread and a decode worker's process all convert with it."""
from __future__ import annotations

from typing import Any

import numpy as np
import torch


def to_output_type(images: torch.Tensor, output_type: str) -> list[Any]:
    """[B, 3, H, W] in [0, 1] -> the output type, as diffusers' VaeImageProcessor.postprocess does. Videos,
    [B, frames, 3, H, W], as its VideoProcessor.postprocess_video: each a [frames, 3, H, W] tensor, a
    [frames, H, W, 3] array or a list of PIL frames."""
    if images.dim() == 5:
        videos = [to_output_type(video, output_type) for video in images]
        if output_type == "pil":
            return videos
        return [torch.stack(v) if output_type == "pt" else np.stack(v) for v in videos]
    if output_type == "pt":
        return [x.cpu() for x in images]
    arrays = images.cpu().permute(0, 2, 3, 1).float().numpy()
    if output_type == "np":
        return list(arrays)
    from diffusers.image_processor import VaeImageProcessor

    return VaeImageProcessor.numpy_to_pil(arrays)
