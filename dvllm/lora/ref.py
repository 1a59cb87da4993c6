"""An adapter as the control plane names it: a few strings and numbers, never its weights (as vLLM's LoRARequest).

The registry makes one when it loads an adapter (the file located, read and checked there: a bad adapter is
refused then, never at a worker). Requests, the scheduler's slots and the worker's loads carry it; whoever applies
the adapter (a worker, a group member) reads the file at `path` itself and checks it still has `digest`
(lora/cache.py). Importing this module imports no torch: the scheduler and the core process's pipe see only this.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

_CHUNK = 1 << 20


@dataclass(frozen=True)
class LoraRef:
    name: str     # as requests name it (one of possibly several names for one file)
    uid: int      # this load of it: loaded again, it is another adapter (the result cache keeps them apart)
    path: str     # the weights file, absolute (the one the registry located and read)
    digest: str   # of the file's bytes: what slots and worker caches key it by
    rank: int     # its largest layer rank (at most max_lora_rank)
    has_text_encoder: bool  # it changes the text encoders too: prompt embeddings depend on it


def file_digest(path: str) -> str:
    """The hex blake2b digest of a file's bytes, read in chunks (an adapter may be hundreds of MB)."""
    digest = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def host_cache_size(config: Any) -> int:
    """Adapters a worker keeps read in host memory (an EngineConfig's max_cpu_loras, or twice the slots): its
    LoraCache holds that many, and the scheduler asks for reads ahead within it (core/lora_reads.py)."""
    return config.max_cpu_loras or 2 * config.max_loras
