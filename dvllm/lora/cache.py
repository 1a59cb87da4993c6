"""The adapters a worker (or a group member) applies, read by itself from the id it is given (ref.py): its
weights by digest, the least recently used leaving first past max_cpu_loras.

A read takes the file at the ref's path, as the registry read it, and checks that its bytes still have the
ref's digest: a file replaced since the registry loaded it is refused (its requests fail, naming why) rather
than served as another adapter under the same name. Reads run on a thread of their own, one at a time: the
scheduler asks for them ahead (`read_ahead`: core/lora_reads.py) and admits an adapter's requests once the read
ended, so the step that loads a slot finds the weights in memory; an adapter nobody asked for ahead (a group
member's, or one the cache let go meanwhile) is read on that thread while the step waits. The cache itself is
the step loop's: only it calls in.
"""
from __future__ import annotations

from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any

from dvllm.lora.files import LoraFilePolicy, locate_lora
from dvllm.lora.reader import LoraReader, file_changed
from dvllm.lora.ref import LoraRef, file_digest, host_cache_size
from dvllm.lora.weights import LoraWeights
from dvllm.models.load_config import LoadConfig


class LoraCache:
    def __init__(self, reader: LoraReader, policy: LoraFilePolicy, capacity: int) -> None:
        self.reader, self.policy, self.capacity = reader, policy, max(1, capacity)
        self._weights: OrderedDict[str, LoraWeights] = OrderedDict()  # digest -> weights, least recent first
        self._reading: dict[str, Future] = {}  # digest -> its read, on the reader thread
        self._failed: dict[str, BaseException] = {}  # reads that ended in an error, until a load raises it
        self._ended: list[str] = []    # reads ended since the last report
        self._dropped: list[str] = []  # adapters let go since the last report
        self._thread: ThreadPoolExecutor | None = None
        self.reads = 0  # files read, over its life (a hit reads none)

    def weights(self, ref: LoraRef) -> LoraWeights:
        """The adapter's weights, read from its file on a miss; ValueError if the file is no longer the one loaded."""
        weights = self._weights.get(ref.digest)
        if weights is None:
            error = self._failed.pop(ref.digest, None)
            if error is not None:  # raised once, at the load that wanted it; the next ask reads the file again
                self._dropped.append(ref.digest)
                raise error
            self.read_ahead(ref)
            weights = self._reading.pop(ref.digest).result()  # (the read's own error, as a read here raises it)
            self._keep(ref.digest, weights)
            self._ended.append(ref.digest)  # (the scheduler learns it is held)
        self._weights.move_to_end(ref.digest)
        return weights

    def read_ahead(self, ref: LoraRef) -> None:
        """Starts reading the adapter on the reader thread, unless it is read (then reported so again: the scheduler
        asked, not knowing) or being read."""
        if ref.digest in self._weights or ref.digest in self._failed:
            self._ended.append(ref.digest)
            return
        if ref.digest in self._reading:
            return
        if self._thread is None:
            self._thread = ThreadPoolExecutor(1, thread_name_prefix="dvllm-lora-read")
        self._reading[ref.digest] = self._thread.submit(self._read, ref)

    def report(self, timeout: float = 0.0) -> tuple[list[str], list[str]]:
        """The reads that ended since the last report (waiting up to `timeout` for one where none has) and the
        adapters let go since then. A read that failed is reported too: its error is raised at its load."""
        if self._reading and timeout > 0 and not any(f.done() for f in self._reading.values()):
            wait(list(self._reading.values()), timeout, return_when="FIRST_COMPLETED")
        for digest, read in list(self._reading.items()):
            if read.done():
                del self._reading[digest]
                self._ended.append(digest)
                if read.exception() is not None:
                    self._failed[digest] = read.exception()
                else:
                    self._keep(digest, read.result())
        ended, dropped, self._ended, self._dropped = self._ended, self._dropped, [], []
        return ended, dropped

    def close(self) -> None:
        if self._thread is not None:
            self._thread.shutdown(wait=False, cancel_futures=True)

    def __contains__(self, digest: str) -> bool:
        return digest in self._weights

    def _keep(self, digest: str, weights: LoraWeights) -> None:
        self._weights[digest] = weights
        while len(self._weights) > self.capacity:
            self._dropped.append(self._weights.popitem(last=False)[0])

    def _read(self, ref: LoraRef) -> LoraWeights:
        file = locate_lora(ref.path, self.policy)
        digest = file_digest(file.path)
        if digest != ref.digest:
            raise file_changed(ref.name, f"{ref.path!r} holds other bytes")
        self.reads += 1
        return self.reader.read(ref.name, file, digest)


def lora_cache_for(config: Any) -> LoraCache | None:
    """The cache a worker with `config` (an EngineConfig) reads adapters into, or None without LoRA serving."""
    if not config.enable_lora:
        return None
    return LoraCache(LoraReader(config.model, LoadConfig.of(config), config.max_lora_rank), LoraFilePolicy.of(config),
                     host_cache_size(config))
