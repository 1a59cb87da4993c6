"""The driver's adapters: names -> paths, and the parsed weights of recently used ones (max_cpu_loras).

Reading an adapter (disk, diffusers' conversion) happens here, when it is loaded and when a request
names one that fell out of the host cache: in the caller's thread, which for the async engine is the
admission thread pool, never the step loop. A request holds its adapters' weights until it finishes,
so unloading or evicting an adapter loses nothing that was accepted. Thread-safe.
"""
from __future__ import annotations

import itertools
import os
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from dvllm.lora.weights import LoraWeights, read_lora

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:@+-]{0,127}$")


@dataclass(frozen=True)
class _Entry:
    uid: int
    path: str


class LoraRegistry:
    def __init__(self, model: str | None, served_name: str, max_rank: int, max_cpu_loras: int) -> None:
        self.model, self.served_name = model, served_name
        self.max_rank, self.max_cpu_loras = max_rank, max_cpu_loras
        self._entries: dict[str, _Entry] = {}
        self._cache: OrderedDict[int, LoraWeights] = OrderedDict()  # uid -> weights, least recently used first
        self._uids = itertools.count(1)
        self._lock = threading.Lock()       # names and the cache
        self._read_lock = threading.Lock()  # one read at a time: they share the skeleton
        self._skeleton: Any = None

    def load(self, name: str, path: str) -> LoraWeights:
        """Reads and registers an adapter; ValueError (bad name, name taken, not a LoRA for this model)."""
        if not isinstance(name, str) or not _NAME.match(name):
            raise ValueError(f"LoRA name must be 1-128 letters, digits or ._:@+- (starting with a letter or "
                             f"digit), got {name!r}")
        if name == self.served_name:
            raise ValueError(f"LoRA name {name!r} is the base model's name; choose another")
        if not isinstance(path, str) or not path:
            raise ValueError(f"LoRA path must be a non-empty string, got {path!r}")
        path = os.path.expanduser(path)
        if not os.path.exists(path):
            raise ValueError(f"LoRA path {path!r} does not exist")
        with self._lock:
            if name in self._entries:
                raise ValueError(f"a LoRA adapter named {name!r} is already loaded; unload it first")
            uid = next(self._uids)
        weights = self._read(name, uid, path)
        with self._lock:
            if name in self._entries:  # another load of this name finished first
                raise ValueError(f"a LoRA adapter named {name!r} is already loaded; unload it first")
            self._entries[name] = _Entry(uid, path)
            self._remember(weights)
        return weights

    def unload(self, name: str) -> None:
        """Forgets an adapter; requests already accepted with it finish with it."""
        with self._lock:
            entry = self._entries.pop(name, None)
            if entry is None:
                raise ValueError(f"no LoRA adapter named {name!r} is loaded (loaded: {sorted(self._entries)})")
            self._cache.pop(entry.uid, None)

    def get(self, name: str) -> LoraWeights:
        """The weights of a loaded adapter, read again if they fell out of the host cache."""
        with self._lock:
            entry = self._entries.get(name)
            if entry is None:
                known = sorted(self._entries)
                raise ValueError(f"unknown LoRA adapter {name!r}; loaded: {known if known else 'none'}")
            weights = self._cache.get(entry.uid)
            if weights is not None:
                self._cache.move_to_end(entry.uid)
                return weights
        weights = self._read(name, entry.uid, entry.path)
        with self._lock:
            if self._entries.get(name) == entry:
                self._remember(weights)
        return weights

    def list(self) -> list[dict[str, Any]]:
        with self._lock:
            return [{"name": name, "path": e.path, "in_host_cache": e.uid in self._cache}
                    for name, e in self._entries.items()]

    def _remember(self, weights: LoraWeights) -> None:
        self._cache[weights.uid] = weights
        while len(self._cache) > self.max_cpu_loras:
            self._cache.popitem(last=False)

    def _read(self, name: str, uid: int, path: str) -> LoraWeights:
        with self._read_lock:
            if self._skeleton is None:
                from dvllm.lora.skeleton import skeleton_pipeline

                self._skeleton = skeleton_pipeline(self.model)
            return read_lora(self._skeleton, name, uid, path, self.max_rank)
