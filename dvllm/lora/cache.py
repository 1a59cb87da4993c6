"""The adapters a worker (or a group member) applies, read by itself from the id it is given (ref.py): its
weights by digest, the least recently used leaving first past max_cpu_loras.

A miss reads the file at the ref's path, as the registry read it, and checks that its bytes still have the
ref's digest: a file replaced since the registry loaded it is refused (its requests fail, naming why) rather
than served as another adapter under the same name. Used by one thread (the worker's step loop).
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Any

from dvllm.lora.files import LoraFilePolicy, locate_lora
from dvllm.lora.reader import LoraReader, file_changed
from dvllm.lora.ref import LoraRef, file_digest
from dvllm.lora.weights import LoraWeights
from dvllm.models.load_config import LoadConfig


class LoraCache:
    def __init__(self, reader: LoraReader, policy: LoraFilePolicy, capacity: int) -> None:
        self.reader, self.policy, self.capacity = reader, policy, max(1, capacity)
        self._weights: OrderedDict[str, LoraWeights] = OrderedDict()  # digest -> weights, least recent first
        self.reads = 0  # files read, over its life (a hit reads none)

    def weights(self, ref: LoraRef) -> LoraWeights:
        """The adapter's weights, read from its file on a miss; ValueError if the file is no longer the one loaded."""
        weights = self._weights.get(ref.digest)
        if weights is None:
            weights = self._read(ref)
            self._weights[ref.digest] = weights
            while len(self._weights) > self.capacity:
                self._weights.popitem(last=False)
        self._weights.move_to_end(ref.digest)
        return weights

    def __contains__(self, digest: str) -> bool:
        return digest in self._weights

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
                     cpu_lora_cache_size(config))


def cpu_lora_cache_size(config: Any) -> int:
    """Adapters kept read in host memory: max_cpu_loras, or twice the slots."""
    return config.max_cpu_loras or 2 * config.max_loras
