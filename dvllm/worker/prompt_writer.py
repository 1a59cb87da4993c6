"""The prompt conditions of newly admitted requests, written into the blocks admission gave them: texts the
worker's encode stage has ready are copied in, the others are encoded here in one text-encoder call per
(length, text adapters, images). Shared by the loop and, for its own calls, the encode stage.
"""
from __future__ import annotations

import threading
from typing import Any

import torch

from dvllm.core.scheduler_output import NewRequestData
from dvllm.models.base import ModelAdapter
from dvllm.request_sizes import as_images
from dvllm.worker.conditions import encode_flat, flatten, unflatten
from dvllm.worker.encode_stage import EncodeStage
from dvllm.worker.lora_layers import LoraLayers
from dvllm.worker.per_request import per_request
from dvllm.worker.request_state import RequestState
from dvllm.worker.state_pool import StatePool


class PromptWriter:
    def __init__(self, adapter: ModelAdapter, pool: StatePool, lora: LoraLayers) -> None:
        self.adapter, self.pool, self.lora = adapter, pool, lora
        self.encode_stage: EncodeStage | None = None  # None: admission encodes every text
        self.lock = threading.Lock()  # the text encoders: the loop's calls and the encode stage's
        self.encoders_released = False  # encode workers hold the text encoders: every text comes from the stage

    def read_text_lengths(self, states: list[RequestState]) -> None:
        """Each new request's real text lengths, read from its stored masks once (one read for all of them),
        so that no step has to read them back from the device."""
        info = self.adapter.info
        if not states or "prompt_embeds_mask" not in info.text.condition_shapes:
            return
        blocks = [b for s in states for b in (s.blocks.cond, s.blocks.uncond if s.data.cfg else s.blocks.cond)]
        mask = unflatten(self.pool.read(blocks, info.text.condition_numel), info.text.condition_shapes)["prompt_embeds_mask"]
        lengths = (mask > 0.5).sum(dim=1).tolist()
        for i, s in enumerate(states):
            s.text_lengths = (lengths[2 * i], lengths[2 * i + 1])

    def write(self, new: list[NewRequestData]) -> dict[tuple[int, ...], str]:
        """Encodes every text whose blocks must be filled (one call); returns failed blocks -> message."""
        # (text, negative, length, text adapters, images an edit model reads the text with), by the blocks to fill
        targets: dict[tuple[int, ...], tuple[str | None, bool, int | None, tuple, Any]] = {}
        for d in new:
            images = ImageKey(d) if d.input_grids and self.adapter.info.text.reads_images else None
            if d.blocks.write_cond:
                targets[tuple(d.blocks.cond)] = (d.prompt, False, d.max_sequence_length, d.text_loras, images)
            if d.cfg and d.blocks.write_uncond:
                targets[tuple(d.blocks.uncond)] = (d.negative_prompt, True, d.max_sequence_length, d.text_loras,
                                                   images)
        if not targets:
            return {}
        shapes = self.adapter.info.text.condition_shapes
        failed: dict[tuple[int, ...], str] = {}

        def encode(texts: list[tuple[str | None, bool, int | None, tuple, Any]]) -> None:
            if self.encoders_released:  # (the scheduler admits no request before the stage has its texts)
                raise RuntimeError("the worker holds no text encoders (its encode workers do), and the encode "
                                   "stage has not encoded this text")
            encoded = {}
            # one encoder call per length, adapters and images
            for length, loras, images in dict.fromkeys(t[2:] for t in texts):
                group = [t for t in texts if t[2:] == (length, loras, images)]
                items = [t[:2] for t in group]
                # the length and images only where the family takes them: others keep the one-argument call
                kwargs = {} if length is None else {"max_sequence_length": length}
                if images is not None:
                    kwargs["images"] = images.images
                with self.lock, self.lora.encoding([loras] * len(items)):  # all of the call take these adapters
                    conditions = self.adapter.on_device(self.adapter.encode_prompt(items, **kwargs))
                encoded.update(zip(group, conditions))
            blocks = [b for b, text in targets.items() if text in encoded]
            self.pool.write([list(b) for b in blocks], torch.cat([flatten(encoded[targets[b]], shapes) for b in blocks]))

        texts = list(dict.fromkeys(targets.values()))  # identical texts (with the same adapters) are encoded once
        texts = self._write_ahead(targets, texts)
        errors: dict[Any, str] = {}
        per_request(texts, encode, errors, "prompt encoding", key=lambda text: text)
        for b, text in targets.items():
            if text in errors:
                failed[b] = errors[text]
        return failed

    def _write_ahead(self, targets: dict[tuple[int, ...], tuple], texts: list[tuple]) -> list[tuple]:
        """Writes the texts the encode stage has ready into their blocks; returns the others, to encode here."""
        if self.encode_stage is None:
            return texts
        ahead = {}
        for text in texts:
            if not text[3]:  # no text adapters: the stage's kind of text
                flat = self.encode_stage.take((*text[:3], None if text[4] is None else text[4].key))
                if flat is not None:
                    ahead[text] = flat
        if ahead:
            blocks = [b for b, text in targets.items() if text in ahead]
            self.pool.write([list(b) for b in blocks], torch.stack([ahead[targets[b]] for b in blocks]))
        return [text for text in texts if text not in ahead]

    def encode_flat(self, texts: list[tuple[str | None, bool]], max_sequence_length: int | None,
                    images: Any = None) -> torch.Tensor:
        """The encode stage's call (see encode_flat)."""
        return encode_flat(self.adapter, texts, max_sequence_length, images)


class ImageKey:
    """An edit's images, equal to another request's when their digests are (so identical texts with identical
    images are encoded once)."""

    def __init__(self, data: NewRequestData) -> None:
        self.images, self.key = as_images(data.image), data.image_key

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ImageKey) and other.key == self.key

    def __hash__(self) -> int:
        return hash(self.key)
