"""Where `dvllm generate` puts its images: file names, the PNG text chunk, and manifest.jsonl.

Each PNG carries its prompt and parameters (text chunks "prompt" and "parameters", the latter JSON),
and with --prompts-file every image also gets a line in <output-dir>/manifest.jsonl, so which prompt
made which file is never lost. The manifest is appended to, one line per image as it is written:
a run stopped with Ctrl-C still describes every image it left behind.
"""
from __future__ import annotations

import json
import os
from typing import Any

from PIL import Image
from PIL.PngImagePlugin import PngInfo

from dvllm.sampling_params import SamplingParams

MANIFEST = "manifest.jsonl"


def image_paths(index: int | None, seed: int, count: int, output: str | None, output_dir: str) -> list[str]:
    """The files of one request: `output` as given (numbered when n > 1), else <index>-<seed>.png in
    output_dir (batch) or dvllm-<seed>.png (one prompt)."""
    if output is None:
        stem = f"{index:05d}-{seed}" if index is not None else f"dvllm-{seed}"
        output = os.path.join(output_dir, stem + ".png")
    if count == 1:
        return [output]
    root, ext = os.path.splitext(output)
    return [f"{root}-{k}{ext or '.png'}" for k in range(count)]


def image_parameters(params: SamplingParams, model: str, inputs: dict[str, Any] | None = None,
                     sampler: str | None = None) -> dict[str, Any]:
    """What made an image, besides its prompt, seed and index: the resolved request parameters (under the
    names HTTP requests use; `sampler`: the one that ran when the request named none), and for an image
    request its input files' paths (`inputs`: "image", "mask") and strength."""
    return {"num_inference_steps": params.num_inference_steps, "guidance_scale": params.guidance_scale,
            "size": f"{params.width}x{params.height}", "sampler": params.sampler or sampler,
            "negative_prompt": params.negative_prompt, "n": params.n, "model": model,
            **({"loras": params.loras} if params.loras else {}),
            **(inputs or {}), **({"strength": params.strength} if params.strength is not None else {}),
            **({"aesthetic_score": params.aesthetic_score, "negative_aesthetic_score": params.negative_aesthetic_score}
               if params.aesthetic_score is not None else {})}


class ImageWriter:
    """Saves a finished request's images with their metadata; keeps the count of images written."""

    def __init__(self, output_dir: str, manifest: bool, model: str, sampler: str | None = None) -> None:
        """`sampler`: the one a request that names none runs (the model's)."""
        self.output_dir = output_dir
        self.manifest_path = os.path.join(output_dir, MANIFEST) if manifest else None
        self.model, self.sampler = model, sampler
        self.written = 0

    def write(self, prompt: str, params: SamplingParams, seed: int, images: list[Image.Image],
              paths: list[str], inputs: dict[str, Any] | None = None) -> None:
        parameters = image_parameters(params, self.model, inputs, self.sampler)
        for k, (image, path) in enumerate(zip(images, paths)):
            record = {"prompt": prompt, "seed": seed, "index": k, **parameters}
            _save(image, path, record)
            self.written += 1
            if self.manifest_path is not None:
                self._append({"file": self._manifest_name(path), **record})

    def _manifest_name(self, path: str) -> str:
        """Relative to the output dir when the file is in it (the folder can move), else as given."""
        rel = os.path.relpath(os.path.abspath(path), os.path.abspath(self.output_dir))
        return path if rel.startswith(os.pardir) else rel

    def _append(self, line: dict[str, Any]) -> None:
        os.makedirs(self.output_dir, exist_ok=True)
        with open(self.manifest_path, "a") as f:  # type: ignore[arg-type]
            f.write(json.dumps(line) + "\n")


def _save(image: Image.Image, path: str, record: dict[str, Any]) -> None:
    if os.path.dirname(path):
        os.makedirs(os.path.dirname(path), exist_ok=True)
    if os.path.splitext(path)[1].lower() != ".png":
        image.save(path)  # a JSONL "output" may name another format; only PNG has text chunks
        return
    info = PngInfo()
    info.add_text("prompt", record["prompt"])
    info.add_text("parameters", json.dumps(record))
    image.save(path, pnginfo=info)
