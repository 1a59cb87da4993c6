"""The default executor: one worker in this process."""
from __future__ import annotations

from typing import Any

from dvllm.config import EngineConfig
from dvllm.executor.base import Executor
from dvllm.worker.worker import Worker


class UniProcExecutor(Executor):
    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self.worker = Worker(config)

    def collective_rpc(self, method: str, *args: Any) -> list[Any]:
        return [getattr(self.worker, method)(*args)]
