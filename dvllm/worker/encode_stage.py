"""Prompt encoding as a stage of its own: the texts of waiting requests go to a thread of the worker's, which runs
the text encoders (on a CUDA stream of its own) while the loop steps the running batch, so admitting a request
costs the loop a copy of its conditions into the pool instead of a text-encoder call.

The scheduler decides what is encoded ahead (core/encode_ahead.py): texts of waiting requests that the prompt cache
does not hold, without text LoRA adapters (those the loop encodes at admission, as without the stage); an edit
model's texts come with the images its encoder reads them with, held here while a text needs them. It admits a request once its texts are ready here; the loop then takes them (`take`) into the
blocks admission gave them. The same encoder calls on the same texts: the conditions are those the loop would
have made. An encode that fails fails the requests that wait for it only (a batched call that raises is retried
text by text); if the thread dies, a new one takes over its texts.

With encode workers (encode_worker.py) the stage has a lane per worker process: each lane's thread sends its
texts to its process, whose copy of the text encoders encodes them, and brings their conditions to the device.
A batch whose process died is encoded once more (on the process started in its place), then text by text: a
text whose process dies twice fails the requests that wait for it only. Starts (the VAE encode of input images)
stay with the lanes' threads, in the worker's process, and so do image prompts (the IP-Adapter's image encoder call
for a request's image prompt, `image_prompt_key`).
"""
from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from dvllm.core.scheduler_output import StartJob
from dvllm.worker.encode_worker import EncodeWorker
from dvllm.worker.stage_process import WorkerProcessLost
from dvllm.worker.stage_thread import StageThread
from dvllm.worker.start_latents import Start

logger = logging.getLogger(__name__)

# (text, negative, max_sequence_length, images' digest): what the scheduler sends and the loop takes, as the loop
# keys its texts; a request's start latents are ("start", request id), its image prompt's embeds
# ("image_prompt", request id)
EncodeKey = tuple
StartFn = Callable[[StartJob], Start]
# an image prompt -> its (conditional, unconditional) embeds (ip_adapter_load.IPAdapter.encode)
ImagePromptFn = Callable[[Any], "tuple[torch.Tensor, torch.Tensor]"]


def start_key(request_id: str) -> EncodeKey:
    return ("start", request_id)


def image_prompt_key(request_id: str) -> EncodeKey:
    return ("image_prompt", request_id)


def _is_job(key: EncodeKey) -> bool:
    """A request's own job (its start or its image prompt), not a text."""
    return len(key) == 2
# (texts of one max_sequence_length and images, that length, those images or None) -> their conditions, flattened to
# one row each, on the device
EncodeFn = Callable[[list[tuple[str, bool]], "int | None", Any], torch.Tensor]


@dataclass
class Encoded:
    """What the stage finished since the last collect: keys ready to take, and keys that failed (-> why)."""

    ready: list[EncodeKey] = field(default_factory=list)
    errors: dict[EncodeKey, str] = field(default_factory=dict)
    seconds: float = 0.0  # the thread's time encoding them, and the texts it encoded (for the stage metrics)
    num_texts: int = 0


class EncodeStage(StageThread):
    kind = "encode"

    def __init__(self, encode: EncodeFn, device: torch.device, max_batch: int, lock: threading.Lock,
                 start: StartFn | None = None, workers: list[EncodeWorker] | None = None,
                 image_prompt: ImagePromptFn | None = None) -> None:
        super().__init__(device, lanes=len(workers) if workers else 1)
        self._encode, self._start_fn, self._image_prompt_fn, self.max_batch = encode, start, image_prompt, max_batch
        self.workers = workers or []  # encode processes, one a lane; none: the lane's thread encodes
        # The text encoders and their tokenizers are shared with the loop, which still encodes some texts itself
        # (adapters, images): one caller at a time (fast tokenizers refuse concurrent use).
        self.lock = lock
        self._jobs: list[EncodeKey] = []
        self._images: dict[str, Any] = {}  # digest -> images, while a text queued or taken is read with them
        self._starts: dict[EncodeKey, StartJob] = {}  # queued or taken start jobs
        self._image_prompts: dict[EncodeKey, Any] = {}  # queued or taken image prompts
        self._results: dict[EncodeKey, tuple[torch.Tensor, Any]] = {}  # ready: (flat conditions, CUDA event)
        self._dropped: set[EncodeKey] = set()  # dropped while being encoded: not kept when done
        self._done = Encoded()

    # -- the loop's side -----------------------------------------------------------------
    def submit(self, keys: list[EncodeKey], images: dict[str, Any] | None = None,
               starts: list[StartJob] | None = None, image_prompts: dict[str, Any] | None = None) -> None:
        """Texts to encode (with the images edit texts are read with), requests' starts to make, and requests'
        image prompts (request id -> image) to encode."""
        with self._cond:
            self._images.update(images or {})
            for job in starts or []:
                self._starts[start_key(job.request_id)] = job
                keys = [*keys, start_key(job.request_id)]
            for request_id, image in (image_prompts or {}).items():
                self._image_prompts[image_prompt_key(request_id)] = image
                keys = [*keys, image_prompt_key(request_id)]
            for key in keys:
                self._dropped.discard(key)
                if key not in self._results and key not in self._jobs and key not in self._taken:
                    self._jobs.append(key)
            self._wake()

    def drop(self, keys: list[EncodeKey]) -> None:
        """Forgets texts no waiting request needs any more (queued, ready, or done later)."""
        with self._cond:
            for key in keys:
                self._results.pop(key, None)
                if key in self._jobs:
                    self._jobs.remove(key)
                elif key in self._taken:
                    self._dropped.add(key)
            self._forget_images(self._taken)

    def take(self, key: EncodeKey) -> Any:
        """A ready text's flat conditions, a request's Start or its image prompt's embeds (for the loop's stream
        to read); None if it is not held."""
        with self._cond:
            held = self._results.pop(key, None)
        if held is None:
            return None
        result, ready = held
        if ready is not None:
            torch.cuda.current_stream().wait_event(ready)
            tensors = [result] if isinstance(result, torch.Tensor) else list(result) if isinstance(result, tuple) \
                else [result.latents, result.inputs]
            for tensor in tensors:
                if tensor is not None:
                    tensor.record_stream(torch.cuda.current_stream())
        return result

    def collect(self, timeout: float = 0.0) -> Encoded:
        """What is done; with a timeout, waits up to it for something to be (while texts are pending)."""
        with self._cond:
            self._revive()
            if timeout > 0 and not (self._done.ready or self._done.errors) and (self._jobs or self._taken):
                self._cond.wait(timeout)
            done, self._done = self._done, Encoded()
        return done

    @property
    def pending(self) -> int:
        """Texts submitted and not yet encoded."""
        with self._cond:
            return len(self._jobs) + len(self._taken)

    def close(self) -> None:
        """Returns once the threads are done with the texts they are on; those queued are forgotten (the requests
        that wait for them are not admitted once the worker closes). The encode processes are stopped then."""
        with self._cond:
            self._jobs.clear()
            self._forget_images(self._taken)
        self._join()
        for worker in self.workers:
            worker.close()

    # -- the thread's side -----------------------------------------------------------------
    def _work(self, taken: list[EncodeKey], lane: int) -> tuple[dict, dict, Any]:
        results, errors = self._encode_keys(taken, lane)
        event = None
        if self.device.type == "cuda":  # what the loop's stream waits for before it reads them
            event = torch.cuda.Event()
            event.record()  # (on this lane's stream)
        return results, errors, event

    def _finish(self, taken: list[EncodeKey], result: tuple[dict, dict, Any], seconds: float) -> None:
        results, errors, event = result
        for key, conditions in results.items():
            if key in self._dropped:
                continue
            self._results[key] = (conditions, event)
            self._done.ready.append(key)
        self._done.errors.update({k: v for k, v in errors.items() if k not in self._dropped})
        self._done.seconds += seconds
        self._done.num_texts += len(taken)
        self._dropped.difference_update(taken)
        self._forget_images([])

    def _forget_images(self, taken: list[EncodeKey]) -> None:
        """Keeps the images (and start jobs, image prompts) only of what is still queued (or being worked on,
        `taken`)."""
        keys = [*self._jobs, *taken]
        needed = {key[3] for key in keys if not _is_job(key)}
        self._images = {digest: images for digest, images in self._images.items() if digest in needed}
        self._starts = {key: job for key, job in self._starts.items() if key in keys}
        self._image_prompts = {key: image for key, image in self._image_prompts.items() if key in keys}

    def _make_job(self, key: EncodeKey) -> tuple[dict[EncodeKey, Any], dict[EncodeKey, str]]:
        """A request's start, or its image prompt's embeds; an error fails that request only."""
        start = key[0] == "start"
        try:
            if start:
                return {key: self._start_fn(self._starts[key])}, {}
            if self._image_prompt_fn is None:
                raise RuntimeError("this worker serves no IP-Adapter")
            return {key: self._image_prompt_fn(self._image_prompts[key])}, {}
        except Exception as e:  # noqa: BLE001 - it fails that request only
            what = "latent preparation" if start else "image prompt encoding"
            logger.exception("the %s of %s failed in the encode stage", what, key[1])
            return {}, {key: f"{what} failed: {type(e).__name__}: {e}"}

    def _requeue(self, taken: list[EncodeKey]) -> None:
        self._jobs[:0] = taken

    def _take(self) -> list[EncodeKey]:
        """The first text, and those after it of the same max_sequence_length and images, up to max_batch texts;
        or a request's start or image prompt, alone."""
        if _is_job(self._jobs[0]):
            return [self._jobs.pop(0)]
        kind = self._jobs[0][2:]
        taken = [key for key in self._jobs if not _is_job(key) and key[2:] == kind][:self.max_batch]
        self._jobs = [key for key in self._jobs if key not in taken]
        return taken

    def _encode_keys(self, keys: list[EncodeKey], lane: int) -> tuple[dict[EncodeKey, Any], dict[EncodeKey, str]]:
        if _is_job(keys[0]):
            return self._make_job(keys[0])
        try:
            length, digest = keys[0][2:]
            images = None if digest is None else self._images[digest]  # kept while the batch holds it
            flat = self._encode_texts([key[:2] for key in keys], length, images, lane)
            return dict(zip(keys, flat)), {}
        except Exception as e:  # noqa: BLE001 - pinned on the text that fails, below
            if len(keys) == 1:
                logger.exception("prompt encoding failed in the encode stage")
                return {}, {keys[0]: f"prompt encoding failed: {type(e).__name__}: {e}"}
        results, errors = {}, {}
        for key in keys:
            one, failed = self._encode_keys([key], lane)
            results.update(one)
            errors.update(failed)
        return results, errors

    def _encode_texts(self, texts: list[tuple[str, bool]], length: int | None, images: Any, lane: int
                      ) -> torch.Tensor:
        if not self.workers:
            with self.lock:
                return self._encode(texts, length, images)
        worker = self.workers[lane]
        try:
            flat = worker.encode((texts, length, images))
        except WorkerProcessLost as e:  # once more, on the process started in its place (then text by text)
            logger.error("%s; encoding its %d text(s) again", e, len(texts))
            flat = worker.encode((texts, length, images))
        return flat.to(self.device)
