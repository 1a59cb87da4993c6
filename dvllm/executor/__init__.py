from __future__ import annotations

from dvllm.config import EngineConfig
from dvllm.executor.base import Executor, WorkerDied


def create_executor(config: EngineConfig) -> Executor:
    if config.executor == "ray":
        from dvllm.executor.ray import RayExecutor  # Ray is imported only when chosen

        return RayExecutor(config)
    from dvllm.executor.uniproc import UniProcExecutor

    return UniProcExecutor(config)


__all__ = ["Executor", "WorkerDied", "create_executor"]
