"""How the driver reaches its workers.

Every executor hosts `num_workers` workers, each with its own model and state pool. The
engine submits one step to a worker and later collects it; a worker runs one step at a
time, and workers step independently of each other. A worker that dies comes back from
`wait` as WorkerDied, never as an exception, so the engine can move its requests.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from dvllm.config import EngineConfig
from dvllm.core.scheduler_output import RunnerOutput, SchedulerOutput
from dvllm.models.base import ModelInfo
from dvllm.models.load_config import LoadedModel


@dataclass(frozen=True)
class WorkerDied:
    """A worker and every request state on it are gone (killed, node lost, out of memory)."""

    worker: int
    reason: str


class Executor(ABC):
    num_workers: int = 1
    in_process: bool = False  # the worker runs in the driver's thread and cannot die apart from it

    def __init__(self, config: EngineConfig) -> None:
        self.config = config

    @abstractmethod
    def call(self, worker: int, method: str, *args: Any) -> Any:
        """Calls `method` on one worker and waits for its result."""

    def collective_rpc(self, method: str, *args: Any) -> list[Any]:
        """Calls `method` on every live worker; one result each."""
        return [self.call(i, method, *args) for i in self.live_workers()]

    def live_workers(self) -> list[int]:
        return list(range(self.num_workers))

    def model_info(self) -> ModelInfo:
        return self.call(self.live_workers()[0], "model_info")

    def loaded_model(self) -> LoadedModel:
        return self.call(self.live_workers()[0], "loaded_model")

    def pool_info(self, worker: int) -> tuple[int, int]:
        """(blocks, elements per block) of one worker's state pool."""
        return self.call(worker, "pool_info")

    @abstractmethod
    def submit(self, worker: int, scheduler_output: SchedulerOutput) -> None:
        """Starts one step on `worker`, which must have none in flight."""

    def execute(self, worker: int, scheduler_output: SchedulerOutput) -> RunnerOutput:
        """Runs one step on `worker` and returns its result (an empty step costs no call)."""
        if scheduler_output.is_empty:
            return RunnerOutput()
        self.submit(worker, scheduler_output)
        result = self.wait()[worker]
        if isinstance(result, WorkerDied):
            raise RuntimeError(f"worker {worker} died: {result.reason}")
        return result

    def execute_ahead(self, worker: int, scheduler_output: SchedulerOutput) -> Future:
        """Async scheduling: queues the step behind the one in flight; its result comes in the future."""
        raise NotImplementedError(f"{type(self).__name__} does not schedule ahead (async_scheduling)")

    @abstractmethod
    def wait(self, timeout: float | None = None) -> dict[int, RunnerOutput | WorkerDied]:
        """Steps that completed, by worker: at least one if any is in flight (unless timeout passes)."""

    def restart(self, worker: int) -> None:
        """Starts a fresh worker in a dead one's place; `poll_restarts` says when it is ready."""
        raise RuntimeError(f"{type(self).__name__} cannot restart a worker")

    def poll_restarts(self) -> dict[int, str | None]:
        """Restarts that settled: None when the worker is ready, else why it failed."""
        return {}

    @property
    def heartbeat_interval(self) -> float | None:
        """How often check_health should run (None: workers cannot die apart from the engine)."""
        return None

    def check_health(self) -> dict[int, str]:
        """Workers with no step in flight found dead since the last call: worker -> why."""
        return {}

    def describe(self, worker: int) -> dict[str, Any]:
        """Where a worker runs (node, devices), for stats and error messages."""
        return {}

    def shutdown(self) -> None:
        pass
