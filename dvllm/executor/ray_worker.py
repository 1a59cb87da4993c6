"""What runs inside each Ray actor: a Worker, built on request so that start-up errors name the node. The actor is
the runtime's (runtime/ray_backend.py's RayHost), which answers each call with `handle`."""
from __future__ import annotations

from typing import Any

from dvllm.config import EngineConfig


class RayWorkerWrapper:
    """The model loads in `start`, not in __init__, so the driver learns where each actor landed (the host's
    WHERE) before anything can fail."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.worker = None

    def handle(self, kind: str, payload: Any) -> Any:
        """A call: "start" (returns the state pool's (blocks, elements per block)), "execute" (a step),
        "call" ((a Worker method's name, its arguments))."""
        if kind == "start":
            return self.start()
        if kind == "execute":
            return self.worker.execute(payload)
        if kind == "call":
            method, args = payload
            return getattr(self.worker, method)(*args)
        raise ValueError(f"a Ray worker has no call {kind!r}")

    def start(self) -> tuple[int, int]:
        """Loads the model and the state pool; returns the pool's (blocks, elements per block)."""
        from dvllm.executor.worker import Worker, resolve_device
        from dvllm.runtime.spawn import use_threads

        if resolve_device(self.config.device).type == "cpu":  # as many torch threads as CPUs reserved
            use_threads(max(1, int(self.config.worker_num_cpus)))
        self.worker = Worker(self.config)
        return self.worker.pool_info()
