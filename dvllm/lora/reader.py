"""Reading an adapter file into its weights (weights.py), for the registry that checks it and for whoever
applies it (cache.py).

Reads hold no lock that another read waits on: each takes a weightless skeleton of the pipeline of its own from
a pool (built on first need). A file changed since it was located, or while it was read, is refused, naming why.
Thread-safe.
"""
from __future__ import annotations

import threading
from typing import Any

from dvllm.lora.files import LoraFile
from dvllm.lora.weights import LoraWeights, read_lora


class LoraReader:
    def __init__(self, model: str | None, load: Any, max_rank: int) -> None:
        """`load`: the model's LoadConfig (its configs are found as the worker found them)."""
        self.model, self.load_config, self.max_rank = model, load, max_rank
        self._lock = threading.Lock()  # the idle skeletons; never held while reading
        self._idle_skeletons: list[Any] = []

    def read(self, name: str, file: LoraFile, digest: str) -> LoraWeights:
        """The weights in `file` (whose bytes had `digest` when it was located); ValueError if it cannot serve them."""
        why = file.changed()
        if why is None:
            skeleton = self._take_skeleton()
            try:
                weights = read_lora(skeleton, name, file, self.max_rank, digest)
            finally:
                with self._lock:
                    self._idle_skeletons.append(skeleton)
            why = file.changed()
        if why is not None:
            raise file_changed(name, why)
        return weights

    def _take_skeleton(self) -> Any:
        with self._lock:
            if self._idle_skeletons:
                return self._idle_skeletons.pop()
        from dvllm.lora.skeleton import skeleton_pipeline

        return skeleton_pipeline(self.model, self.load_config)


def file_changed(name: str, why: str) -> ValueError:
    """The error for an adapter whose file is no longer the one loaded (`why`: LoraFile.changed's answer)."""
    return ValueError(f"LoRA adapter {name!r}: its file changed since it was loaded or while it was read ({why}); "
                      "unload it and load it again to serve the new file")
