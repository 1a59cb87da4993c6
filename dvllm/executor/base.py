"""How the driver reaches its workers: one `collective_rpc(method, *args)` behind every executor."""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from dvllm.config import EngineConfig
from dvllm.core.scheduler_output import RunnerOutput, SchedulerOutput
from dvllm.models.base import ModelInfo


class Executor(ABC):
    def __init__(self, config: EngineConfig) -> None:
        self.config = config

    @abstractmethod
    def collective_rpc(self, method: str, *args: Any) -> list[Any]:
        """Call `method` on every worker; one result per worker."""

    def model_info(self) -> ModelInfo:
        return self.collective_rpc("model_info")[0]

    def pool_info(self) -> tuple[int, int]:
        """(blocks, elements per block): the smallest pool among the workers bounds admission."""
        return min(self.collective_rpc("pool_info"))

    def execute(self, scheduler_output: SchedulerOutput) -> RunnerOutput:
        return self.collective_rpc("execute", scheduler_output)[0]

    def shutdown(self) -> None:
        pass
