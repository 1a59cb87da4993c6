"""The scheduler's side of the encode stage (worker/encode_stage.py): which waiting requests' texts the worker
encodes ahead of admission, and whether a request may be admitted yet.

While a batch runs, a waiting request whose texts the prompt cache lacks is admitted only once the stage has
encoded them, so that admission never runs a text encoder on the loop. With nothing running there is no one to
stall: admission encodes at once, as without the stage. An edit model's prompts, which its encoder reads with the
request's images, go with those images (once per digest). Texts with text LoRA adapters and the texts of
preempted requests (their conditions come back with their state) are never sent. At most `capacity` texts are
queued or held ready at a time; the rest wait their turn.

With encode workers (`always`), the worker has no text encoders: every text waits for the stage, running
batch or not.

A request with input images (img2img, inpainting, an edit) has its start made ahead too: its VAE encode and the
draws of its seeded generator, which the loop takes with the generator as those draws left it (`start_key`).
It counts as one item against the same capacity.

A request with an IP-Adapter image prompt has its image embeds made ahead the same way (`image_prompt_key`): the
image encoder's call, which the loop takes at admission. One item too; identical images are encoded once (the
worker's IP-Adapter keeps the last images' embeds).
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any, NamedTuple

from dvllm.core.block_manager import BlockManager
from dvllm.core.request import Request
from dvllm.core.scheduler_output import StartJob

# (text, negative, max_sequence_length, digest of the images the encoder reads it with), as the worker keys them;
# a request's start is ("start", request id), its image prompt's embeds ("image_prompt", request id)
EncodeKey = tuple


def start_keys(request: Request) -> list[EncodeKey]:
    """The key of the request's start, if the stage may make it (a request with input images, not preempted)."""
    return [] if request.swapped or request.params.image is None else [("start", request.request_id)]


def image_prompt_keys(request: Request) -> list[EncodeKey]:
    """The key of the request's image-prompt embeds, if the stage may make them (a request with an image prompt,
    not preempted: its embeds come back with its state)."""
    return [] if request.swapped or request.params.ip_adapter_image is None \
        else [("image_prompt", request.request_id)]


def _job_keys(request: Request) -> list[EncodeKey]:
    return start_keys(request) + image_prompt_keys(request)


def encode_keys(request: Request) -> list[tuple[bytes, EncodeKey]]:
    """(prompt-cache key, encode key) of each text the stage may encode for the request; none if it may not."""
    if request.swapped or request.text_loras:
        return []
    length, images = request.params.max_sequence_length, request.image_key
    texts = ((request.prompt, False), (request.params.negative_prompt, True))
    return [(cache_key, (text, negative, length, images))
            for cache_key, (text, negative) in zip(request.cond_keys, texts) if cache_key is not None]


class Plan(NamedTuple):
    """What the scheduler sends the encode stage this iteration."""

    send: list[EncodeKey]             # texts to encode
    drop: list[EncodeKey]             # what no waiting request needs any more
    images: dict[str, Any]            # the images the texts sent are read with, by digest
    starts: list[StartJob]            # starts to make
    image_prompts: dict[str, Any]     # request id -> its image prompt, whose embeds to make


class EncodeAhead:
    def __init__(self, capacity: int, always: bool = False) -> None:
        self.capacity = capacity
        # Every text waits for the stage, even with nothing running (with encode workers the worker holds no text
        # encoders of its own)
        self.always = always
        self.keys: dict[EncodeKey, bool] = {}  # sent to the stage and not yet used or dropped -> ready

    def plan(self, waiting: Iterable[Request], blocks: BlockManager) -> "Plan":
        """What to send and drop this iteration: the uncached texts, the starts and the image prompts of the
        waiting requests, most urgent first, and what no waiting request needs any more."""
        needed: set[EncodeKey] = set()
        send: list[EncodeKey] = []
        images: dict[str, Any] = {}
        starts: list[StartJob] = []
        image_prompts: dict[str, Any] = {}
        for request in waiting:
            for key in _job_keys(request):
                if key not in self.keys:
                    if len(self.keys) >= self.capacity:
                        continue
                    self.keys[key] = False
                    if key[0] == "start":
                        starts.append(request.start_job())
                    else:
                        image_prompts[request.request_id] = request.params.ip_adapter_image
                needed.add(key)
            for cache_key, key in encode_keys(request):
                if blocks.is_cached(cache_key) or key in needed:
                    continue
                if key not in self.keys:
                    if len(self.keys) >= self.capacity:
                        continue
                    self.keys[key] = False
                    send.append(key)
                    if key[3] is not None:
                        images[key[3]] = request.params.image
                needed.add(key)
        drop = [key for key in self.keys if key not in needed]
        for key in drop:
            del self.keys[key]
        return Plan(send, drop, images, starts, image_prompts)

    def must_wait(self, request: Request, blocks: BlockManager) -> bool:
        """Whether admission waits for the stage: some text of the request is uncached and not ready, or its
        start or image prompt is not."""
        return any(not blocks.is_cached(cache_key) and not self.keys.get(key, False)
                   for cache_key, key in encode_keys(request)) \
            or any(not self.keys.get(key, False) for key in _job_keys(request))

    def ready_cache_keys(self, request: Request) -> set[bytes]:
        """The prompt-cache keys of the request's texts that the stage holds ready (admission encodes none)."""
        return {cache_key for cache_key, key in encode_keys(request) if self.keys.get(key, False)}

    def used(self, request: Request, writes: tuple[bool, bool]) -> list[EncodeKey]:
        """Admitted: the worker takes its ready texts out of the stage, into the blocks it fills. Returns those it
        will not fill (the prompt cache had them after all), for the stage to drop."""
        write = dict(zip(request.cond_keys, writes))
        for key in _job_keys(request):  # the worker takes it, or drops it if the request fails first
            self.keys.pop(key, None)
        drops = []
        for cache_key, key in encode_keys(request):
            if self.keys.get(key, False):
                del self.keys[key]
                if not write[cache_key]:
                    drops.append(key)
        return drops

    def mark_ready(self, keys: Iterable[EncodeKey]) -> None:
        for key in keys:
            if key in self.keys:
                self.keys[key] = True

    def failed(self, errors: dict[EncodeKey, str], waiting: Iterable[Request]) -> list[tuple[Request, str]]:
        """Forgets the texts the stage could not encode; returns the waiting requests that needed them, with why."""
        wanted = {key: message for key, message in errors.items() if self.keys.pop(key, None) is not None}
        failed = []
        for request in waiting:
            keys = [key for _, key in encode_keys(request)] + _job_keys(request)
            message = next((wanted[key] for key in keys if key in wanted), None)
            if message is not None:
                failed.append((request, message))
        return failed

    def clear(self) -> None:
        self.keys = {}
