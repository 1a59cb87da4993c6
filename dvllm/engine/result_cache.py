"""The exact result cache: final images of finished requests, by a digest of everything that made them.

dvllm's images depend only on (model, adapters, prompt, seed, parameters), so a request whose key was
served before is answered from here without a step. Opt-in (`result_cache_mb`), bounded in bytes, least
recently used out first. Only the engine's loop thread touches it (the input processor computes keys in
other threads; lookups and stores happen between steps), so it takes no lock.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from PIL import Image

from dvllm.sampling_params import SamplingParams


@dataclass(frozen=True)
class CachedResult:
    images: tuple[Any, ...]
    cached_steps: int | None  # the first run's step-cache count, reported again on each hit
    nbytes: int


class ResultCache:
    def __init__(self, max_bytes: int) -> None:
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0:
            raise ValueError(f"max_bytes must be an integer >= 0, got {max_bytes!r}")
        self.max_bytes = max_bytes
        self._entries: OrderedDict[bytes, CachedResult] = OrderedDict()
        self.num_bytes = 0
        self.hits = 0
        self.queries = 0

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: bytes) -> bool:
        return key in self._entries

    def get(self, key: bytes) -> CachedResult | None:
        """The entry with fresh copies of its images (the caller's to mutate), or None; counts the query."""
        self.queries += 1
        entry = self._entries.get(key)
        if entry is None:
            return None
        self._entries.move_to_end(key)
        self.hits += 1
        return dataclasses.replace(entry, images=tuple(copy_image(i) for i in entry.images))

    def put(self, key: bytes, images: list[Any], cached_steps: int | None = None) -> bool:
        """Stores copies of `images` (so a client mutating what it got cannot change later hits); evicts the
        least recently used entries until the total fits. False when the entry alone is over the budget."""
        nbytes = sum(image_nbytes(i) for i in images)
        if not self.enabled or nbytes > self.max_bytes:
            return False
        old = self._entries.pop(key, None)
        if old is not None:
            self.num_bytes -= old.nbytes
        while self._entries and self.num_bytes + nbytes > self.max_bytes:
            _, evicted = self._entries.popitem(last=False)
            self.num_bytes -= evicted.nbytes
        self._entries[key] = CachedResult(tuple(copy_image(i) for i in images), cached_steps, nbytes)
        self.num_bytes += nbytes
        return True

    def stats(self) -> dict[str, int]:
        return {"result_cache_hits": self.hits, "result_cache_queries": self.queries,
                "result_cache_bytes": self.num_bytes, "result_cache_entries": len(self._entries)}


def image_nbytes(image: Any) -> int:
    """Host bytes of one output image: a PIL image, a numpy array or a torch tensor (a video's frames in PIL: a
    list of them)."""
    if isinstance(image, list):
        return sum(image_nbytes(frame) for frame in image)
    if isinstance(image, torch.Tensor):
        return image.numel() * image.element_size()
    if isinstance(image, np.ndarray):
        return int(image.nbytes)
    if isinstance(image, Image.Image):  # 1 byte per band in the modes dvllm makes (RGB)
        return image.width * image.height * len(image.getbands())
    raise TypeError(f"cannot size an image of type {type(image).__name__}")


def copy_image(image: Any) -> Any:
    if isinstance(image, list):  # a video's PIL frames
        return [frame.copy() for frame in image]
    return image.clone() if isinstance(image, torch.Tensor) else image.copy()  # numpy and PIL copy()


def result_key(model: str, prompt: str, params: SamplingParams, lora_load_ids: tuple[tuple[int, float], ...],
               image_key: str, mask_key: str | None, controls: tuple[tuple, ...] = (),
               image_prompt: tuple[str, float] | None = None) -> bytes:
    """The digest of what decides a request's final images: the model's identity, the prompt, the resolved
    parameters that change pixels (not priority, output_kind or num_previews), adapters by load id with their
    weights, the input images by pixel digest, the controls (name, prepared image's digest, scale, window) and
    the image prompt (its pixels' digest, its scale)."""
    cache = params.cache
    fields = {
        "model": model, "prompt": prompt, "negative_prompt": params.negative_prompt,
        "steps": params.num_inference_steps, "guidance": float(params.guidance_scale),
        "guidance_2": _number(params.guidance_scale_2),
        "size": list(params.size), "seed": params.seed, "n": params.n, "sampler": params.sampler,
        "output_type": params.output_type, "strength": _number(params.strength), "eta": _number(params.eta),
        "max_sequence_length": params.max_sequence_length,
        "cache": None if cache is None else [type(cache).__name__, dataclasses.asdict(cache)],
        "aesthetic": [_number(params.aesthetic_score), _number(params.negative_aesthetic_score)],
        "image": image_key, "mask": mask_key, "loras": [[uid, float(w)] for uid, w in lora_load_ids],
        "controls": [list(c) for c in controls], "image_prompt": None if image_prompt is None else list(image_prompt),
    }
    payload = json.dumps(fields, ensure_ascii=False, sort_keys=True).encode("utf-8", "surrogatepass")
    return hashlib.blake2b(payload, digest_size=16).digest()


def _number(value: float | None) -> float | None:
    return None if value is None else float(value)
