"""Where `dvllm generate` puts its images and videos: file names, the PNG text chunk, and manifest.jsonl.

Each PNG carries its prompt and parameters (text chunks "prompt" and "parameters", the latter JSON; with a step
cache, the cache and `cached_steps`, the steps it skipped), and with --prompts-file every image also gets a line
in <output-dir>/manifest.jsonl, so which prompt made which file is never lost. The manifest is appended to, one
line per image as it is written: a run stopped with Ctrl-C still describes every image it left behind. A video
model's request makes one MP4 per video where an image model's makes one PNG per image, named alike, listed alike
(with its frames and fps, its parameters in the MP4's comment tag), and with --save-frames also a folder of its
frames as PNGs.

Files are written on a thread of their own (OutputThread), so a PNG's or an MP4's encode runs while the
engine steps the next requests.
"""
from __future__ import annotations

import json
import os
import queue
import threading
from collections.abc import Callable
from typing import Any

from PIL import Image
from PIL.PngImagePlugin import PngInfo

from dvllm.sampling_params import SamplingParams
from dvllm.step_cache import CacheConfig
from dvllm.video.save import save_frames, save_video

MANIFEST = "manifest.jsonl"


def image_paths(index: int | None, seed: int, count: int, output: str | None, output_dir: str,
                suffix: str = ".png") -> list[str]:
    """The files of one request: `output` as given (numbered when n > 1), else <index>-<seed><suffix> in
    output_dir (batch) or dvllm-<seed><suffix> (one prompt). suffix: ".mp4" for a video model's."""
    if output is None:
        stem = f"{index:05d}-{seed}" if index is not None else f"dvllm-{seed}"
        output = os.path.join(output_dir, stem + suffix)
    if count == 1:
        return [output]
    root, ext = os.path.splitext(output)
    return [f"{root}-{k}{ext or suffix}" for k in range(count)]


def frames_folder(video_path: str) -> str:
    """Where --save-frames puts a video's frames: beside it, named after it (x.mp4: x-frames/)."""
    return os.path.splitext(video_path)[0] + "-frames"


def image_parameters(params: SamplingParams, model: str, inputs: dict[str, Any] | None = None,
                     sampler: str | None = None) -> dict[str, Any]:
    """What made an image, besides its prompt, seed and index: the resolved request parameters (under the
    names HTTP requests use; `sampler`: the one that ran when the request named none), and for an image
    request its input files' paths (`inputs`: "image", "mask", "ip_adapter_image", and "controls": each control's
    image path) and strength."""
    inputs = dict(inputs or {})
    control_paths = inputs.pop("controls", None) or [None] * len(params.controls or ())
    return {"num_inference_steps": params.num_inference_steps, "guidance_scale": params.guidance_scale,
            "size": f"{params.width}x{params.height}", "sampler": params.sampler or sampler,
            "negative_prompt": params.negative_prompt, "n": params.n, "model": model,
            **({"loras": params.loras} if params.loras else {}),
            **(inputs or {}), **({"strength": params.strength} if params.strength is not None else {}),
            **({"aesthetic_score": params.aesthetic_score, "negative_aesthetic_score": params.negative_aesthetic_score}
               if params.aesthetic_score is not None else {}),
            **({"num_frames": params.num_frames, "fps": params.fps} if params.num_frames is not None else {}),
            **({"cache": params.cache.as_dict()} if isinstance(params.cache, CacheConfig) else {}),
            **({"controls": [_control_record(c, path) for c, path in zip(params.controls, control_paths)]}
               if params.controls else {}),
            **({"ip_adapter_scale": params.ip_adapter_scale} if params.ip_adapter_image is not None else {})}


class ImageWriter:
    """Saves a finished request's images (or videos) with their metadata; keeps the count of files written."""

    def __init__(self, output_dir: str, manifest: bool, model: str, sampler: str | None = None,
                 frame_pngs: bool = False) -> None:
        """`sampler`: the one a request that names none runs (the model's); `frame_pngs`: each video's frames
        as PNGs too, in a folder beside it."""
        self.output_dir = output_dir
        self.manifest_path = os.path.join(output_dir, MANIFEST) if manifest else None
        self.model, self.sampler, self.frame_pngs = model, sampler, frame_pngs
        self.written = 0

    def write(self, prompt: str, params: SamplingParams, seed: int, images: list[Any],
              paths: list[str], inputs: dict[str, Any] | None = None, cached_steps: int | None = None) -> None:
        """`images`: a final output's images, or its videos (a video request: params.num_frames is set);
        `cached_steps`: the steps its step cache skipped (None: it had no cache)."""
        parameters = image_parameters(params, self.model, inputs, self.sampler)
        if cached_steps is not None:  # (the request's count: its images were denoised as one batch)
            parameters["cached_steps"] = cached_steps
        for k, (image, path) in enumerate(zip(images, paths)):
            record = {"prompt": prompt, "seed": seed, "index": k, **parameters}
            if params.num_frames is None:
                _save(image, path, record)
            else:
                record.update(self._save_video(image, path, params.fps, record))
            self.written += 1
            if self.manifest_path is not None:
                self._append({"file": self._manifest_name(path), **record})

    def _save_video(self, video: Any, path: str, fps: float | None, record: dict[str, Any]) -> dict[str, str]:
        """Writes the MP4, tagged with its prompt and parameters as the PNGs are (and its frames); returns what
        the manifest adds about them."""
        if os.path.dirname(path):
            os.makedirs(os.path.dirname(path), exist_ok=True)
        tags = {"title": record["prompt"], "comment": json.dumps(record)}
        save_video(video, path, fps, metadata=tags)  # type: ignore[arg-type]  (a resolved request has its fps)
        if not self.frame_pngs:
            return {}
        folder = frames_folder(path)
        save_frames(video, folder)
        return {"frames_folder": self._manifest_name(folder)}

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


class OutputThread:
    """Runs the writes given to it one after another, in order, on a thread of its own: a PNG's or a long
    video's MP4 encode takes the CPU for a while, during which the engine loop goes on stepping. At most
    `backlog` writes wait; past that, submit waits, so finished outputs never pile up in memory."""

    def __init__(self, backlog: int = 4) -> None:
        self._queue: queue.Queue[Callable[[], None] | None] = queue.Queue(maxsize=backlog)
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="dvllm-generate-writer", daemon=True)
        self._thread.start()

    def submit(self, write: Callable[[], None]) -> None:
        """Queues a write; raises the error of an earlier one (the writes after a failed one are skipped)."""
        self._raise()
        self._queue.put(write)

    def close(self) -> None:
        """Waits until every write submitted is done; raises the first one's error."""
        self._queue.put(None)
        self._thread.join()
        self._raise()

    def _run(self) -> None:
        while (write := self._queue.get()) is not None:
            if self._error is None:
                try:
                    write()
                except Exception as e:  # noqa: BLE001  (handed to the loop's thread, which stops the run)
                    self._error = e

    def _raise(self) -> None:
        if self._error is not None:
            raise self._error


def _control_record(control: Any, path: str | None) -> dict[str, Any]:
    """A control as a prompts file takes it (its mode only where it names one: a union controlnet's)."""
    record = {"name": control.name, "image": path, "scale": control.scale, "start": control.start, "end": control.end}
    return record if control.mode is None else {**record, "mode": control.mode}
