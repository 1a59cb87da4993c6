"""What runs inside each Ray actor: a Worker, built on request so that start-up errors name the node."""
from __future__ import annotations

import os
import socket
from typing import Any

from dvllm.config import EngineConfig


class RayWorkerWrapper:
    """A plain class; the executor wraps it with ray.remote. The model loads in `start`, not in
    __init__, so the driver learns where each actor landed before anything can fail."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.worker = None

    def node(self) -> dict[str, Any]:
        import ray

        context = ray.get_runtime_context()
        return {"node_ip": ray.util.get_node_ip_address(), "node_id": context.get_node_id(),
                "hostname": socket.gethostname(), "pid": os.getpid(),
                "gpu_ids": [str(g) for g in ray.get_gpu_ids()]}

    def start(self) -> tuple[int, int]:
        """Loads the model and the state pool; returns the pool's (blocks, elements per block)."""
        from dvllm.executor.worker import Worker, resolve_device
        from dvllm.runtime.spawn import use_threads

        if resolve_device(self.config.device).type == "cpu":  # as many torch threads as CPUs reserved
            use_threads(max(1, int(self.config.worker_num_cpus)))
        self.worker = Worker(self.config)
        return self.worker.pool_info()

    def call(self, method: str, *args: Any) -> Any:
        return getattr(self.worker, method)(*args)

    def execute(self, scheduler_output: Any) -> Any:
        return self.worker.execute(scheduler_output)
