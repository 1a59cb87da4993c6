"""The driver's adapters: names -> paths, and the parsed weights of recently used ones (max_cpu_loras).

Reading an adapter (disk, diffusers' conversion) happens here, when it is loaded and when a request
names one that fell out of the host cache: in the caller's thread, which for the async engine is the
admission thread pool, never the step loop. A path is checked before anything reads it (files.py), and
reads hold no lock that another read waits on: each takes a skeleton of its own from a pool. A request
holds its adapters' weights until it finishes, so unloading or evicting an adapter loses nothing that was
accepted. Thread-safe.
"""
from __future__ import annotations

import itertools
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from dvllm.lora.files import LoraFile, LoraFilePolicy, check_lora_name, locate_lora
from dvllm.lora.weights import LoraWeights, read_lora
from dvllm.models.load_config import LoadConfig


@dataclass(frozen=True)
class _Entry:
    uid: int
    path: str       # as the operator named it
    file: LoraFile  # the weights file it resolved to, as it was when loaded


class LoraRegistry:
    def __init__(self, model: str | None, served_name: str, max_rank: int, max_cpu_loras: int,
                 policy: LoraFilePolicy, load: Any = None) -> None:
        """`load`: the model's LoadConfig (its configs are found as the worker found them)."""
        self.model, self.served_name, self.load_config = model, served_name, load
        self.max_rank, self.max_cpu_loras, self.policy = max_rank, max_cpu_loras, policy
        self._entries: dict[str, _Entry] = {}
        self._cache: OrderedDict[int, LoraWeights] = OrderedDict()  # uid -> weights, least recently used first
        self._uids = itertools.count(1)
        self._lock = threading.Lock()  # names, the cache and the idle skeletons; never held while reading
        self._idle_skeletons: list[Any] = []  # a read takes one (or builds one): reads never wait on each other

    def load(self, name: str, path: str) -> LoraWeights:
        """Reads and registers an adapter; ValueError (bad name, name taken, not a LoRA for this model)."""
        check_lora_name(name)
        if name == self.served_name:
            raise ValueError(f"LoRA name {name!r} is the base model's name; choose another")
        with self._lock:
            if name in self._entries:
                raise ValueError(f"a LoRA adapter named {name!r} is already loaded; unload it first")
            uid = next(self._uids)
        file = locate_lora(path, self.policy)
        weights = self._read(name, uid, file)
        with self._lock:
            if name in self._entries:  # another load of this name finished first
                raise ValueError(f"a LoRA adapter named {name!r} is already loaded; unload it first")
            self._entries[name] = _Entry(uid, path, file)
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
        weights = self._read(name, entry.uid, entry.file)
        with self._lock:
            if self._entries.get(name) == entry:
                self._remember(weights)
        return weights

    def list(self) -> list[dict[str, Any]]:
        with self._lock:
            return [{"name": name, "path": e.path, "file": e.file.path, "in_host_cache": e.uid in self._cache}
                    for name, e in self._entries.items()]

    def _remember(self, weights: LoraWeights) -> None:
        self._cache[weights.uid] = weights
        while len(self._cache) > self.max_cpu_loras:
            self._cache.popitem(last=False)

    def _read(self, name: str, uid: int, file: LoraFile) -> LoraWeights:
        """Reads the file that was checked: a file changed since (or while being read) is refused, naming why."""
        why = file.changed()
        if why is None:
            skeleton = self._take_skeleton()
            try:
                weights = read_lora(skeleton, name, uid, file, self.max_rank)
            finally:
                with self._lock:
                    self._idle_skeletons.append(skeleton)
            why = file.changed()
        if why is not None:
            raise ValueError(f"LoRA adapter {name!r}: its file changed since it was loaded or while it was read "
                             f"({why}); unload it and load it again to serve the new file")
        return weights

    def _take_skeleton(self) -> Any:
        with self._lock:
            if self._idle_skeletons:
                return self._idle_skeletons.pop()
        from dvllm.lora.skeleton import skeleton_pipeline

        return skeleton_pipeline(self.model, self.load_config)


def require_registry(registry: LoraRegistry | None) -> LoraRegistry:
    """The engine's registry, or the error that says how to get one."""
    if registry is None:
        raise ValueError("this engine serves no LoRA adapters: create it with enable_lora=True or lora_modules")
    return registry


def registry_for(config: Any, served_name: str) -> LoraRegistry | None:
    """The registry an engine with `config` (an EngineConfig) serving `served_name` reads adapters into, or None
    without LoRA."""
    if not config.enable_lora:
        return None
    return LoraRegistry(config.model, served_name, config.max_lora_rank, config.cpu_lora_cache_size,
                        LoraFilePolicy.of(config), LoadConfig.of(config))
