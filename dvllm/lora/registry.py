"""The driver's adapters: names -> the ids requests carry (ref.py).

Loading an adapter locates its file (files.py), reads it whole and checks it for this model (reader.py): in the
caller's thread, which for the async engine is the admission thread pool, never the step loop. What a bad
adapter fails, it fails there, with a ValueError naming why. The registry then keeps only the adapter's id (its
file's path and digest, what the scheduler needs of it): the weights are read again by whoever applies them
(cache.py). Admission takes the id after checking that the file is still the one loaded. A request holds its
adapters' ids until it finishes, so unloading an adapter loses nothing that was accepted. Thread-safe.
"""
from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass
from typing import Any

from dvllm.lora.adapter_defaults import read_adapter_defaults
from dvllm.lora.files import LoraFile, LoraFilePolicy, check_lora_name, locate_lora
from dvllm.lora.reader import LoraReader, file_changed
from dvllm.lora.ref import LoraRef, file_digest
from dvllm.lora.weights import LoraWeights
from dvllm.models.load_config import LoadConfig


@dataclass(frozen=True)
class _Entry:
    ref: LoraRef
    path: str       # as the operator named it
    file: LoraFile  # the weights file it resolved to, as it was when loaded
    defaults: dict[str, Any]  # its folder's request defaults (adapter_defaults.py), read when it was loaded


class LoraRegistry:
    def __init__(self, model: str | None, served_name: str, max_rank: int, policy: LoraFilePolicy,
                 load: Any = None) -> None:
        """`load`: the model's LoadConfig (its configs are found as the worker found them)."""
        self.served_name, self.policy = served_name, policy
        self.reader = LoraReader(model, load, max_rank)
        self._entries: dict[str, _Entry] = {}
        self._uids = itertools.count(1)
        self._lock = threading.Lock()  # the names; never held while reading

    def load(self, name: str, path: str) -> LoraRef:
        """Reads, checks and registers an adapter; ValueError (bad name, name taken, not a LoRA for this model)."""
        check_lora_name(name)
        if name == self.served_name:
            raise ValueError(f"LoRA name {name!r} is the base model's name; choose another")
        with self._lock:
            if name in self._entries:
                raise ValueError(f"a LoRA adapter named {name!r} is already loaded; unload it first")
            uid = next(self._uids)
        file = locate_lora(path, self.policy)
        digest = file_digest(file.path)
        weights = self.reader.read(name, file, digest)  # (a file changed after the digest is refused here)
        defaults = read_adapter_defaults(path, file.path)
        ref = LoraRef(name, uid, file.path, digest, weights.rank, weights.has_text_encoder)
        with self._lock:
            if name in self._entries:  # another load of this name finished first
                raise ValueError(f"a LoRA adapter named {name!r} is already loaded; unload it first")
            self._entries[name] = _Entry(ref, path, file, defaults)
        return ref

    def unload(self, name: str) -> None:
        """Forgets an adapter; requests already accepted with it finish with it."""
        with self._lock:
            if self._entries.pop(name, None) is None:
                raise ValueError(f"no LoRA adapter named {name!r} is loaded (loaded: {sorted(self._entries)})")

    def ref(self, name: str) -> LoraRef:
        """The id of a loaded adapter whose file is still the one loaded (a stat, no read): what a request carries."""
        entry = self._entry(name)
        why = entry.file.changed()
        if why is not None:
            raise file_changed(name, why)
        return entry.ref

    def defaults(self, name: str) -> dict[str, Any]:
        """A loaded adapter's request defaults ({} for most: adapter_defaults.py)."""
        return dict(self._entry(name).defaults)

    def get(self, name: str) -> LoraWeights:
        """The weights of a loaded adapter, read again from its file (to inspect them: serving reads its own)."""
        entry = self._entry(name)
        return self.reader.read(name, entry.file, entry.ref.digest)

    def list(self) -> list[dict[str, Any]]:
        with self._lock:
            return [{"name": name, "path": e.path, "file": e.file.path, "digest": e.ref.digest,
                     "defaults": dict(e.defaults)} for name, e in self._entries.items()]

    def _entry(self, name: str) -> _Entry:
        with self._lock:
            entry = self._entries.get(name)
            if entry is None:
                known = sorted(self._entries)
                raise ValueError(f"unknown LoRA adapter {name!r}; loaded: {known if known else 'none'}")
            return entry


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
    return LoraRegistry(config.model, served_name, config.max_lora_rank, LoraFilePolicy.of(config),
                        LoadConfig.of(config))
