"""The tiny Qwen-Image-Edit pipelines save, load back offline from their folders, and edit: the output is a
finite image of the size asked, and it depends on the input image (the image conditions the result)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from diffusers import DiffusionPipeline, QwenImageEditPipeline, QwenImageEditPlusPipeline
from PIL import Image

from dvllm.models.byte_tokenizer import allow_qwen_vl_processor_without_torchvision


BLACK, WHITE = (0, 0, 0), (255, 255, 255)


def _image(height: int, width: int, color: tuple[int, int, int]) -> Image.Image:
    return Image.new("RGB", (width, height), color)


def _load(path: str) -> DiffusionPipeline:
    # any process that loads a Qwen-Image-Edit folder needs this where torchvision is missing (see its docstring)
    allow_qwen_vl_processor_without_torchvision()
    pipe = DiffusionPipeline.from_pretrained(path)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _edit(pipe: DiffusionPipeline, image) -> np.ndarray:
    # whatever its size, each input image is resized to about 1024x1024 px for the VAE: that sets the cost
    out = pipe(image=image, prompt="a cat", negative_prompt="blurry", true_cfg_scale=4.0, num_inference_steps=2,
               height=32, width=32, generator=torch.Generator().manual_seed(0), output_type="np")
    assert out.images.shape == (1, 32, 32, 3) and np.isfinite(out.images).all()
    return out.images


def _assert_differ(a: np.ndarray, b: np.ndarray) -> None:
    # Random tiny weights pass little of the input image through (two noise images: 3e-5 to 1e-4 apart);
    # black against white moves the output by 1e-3 (Plus, both images) to 4e-3 (Edit).
    assert np.abs(a - b).max() > 1e-4


@pytest.mark.slow
def test_edit_pipeline_loads_and_the_image_conditions_it(qwen_image_edit_path):
    pipe = _load(qwen_image_edit_path)
    assert type(pipe) is QwenImageEditPipeline
    _assert_differ(_edit(pipe, _image(56, 40, BLACK)), _edit(pipe, _image(56, 40, WHITE)))


@pytest.mark.slow
def test_edit_plus_pipeline_takes_several_images(qwen_image_edit_plus_path):
    pipe = _load(qwen_image_edit_plus_path)
    assert type(pipe) is QwenImageEditPlusPipeline
    black, white = [_image(56, 40, BLACK), _image(30, 70, BLACK)], [_image(56, 40, WHITE), _image(30, 70, WHITE)]
    _assert_differ(_edit(pipe, black), _edit(pipe, white))
