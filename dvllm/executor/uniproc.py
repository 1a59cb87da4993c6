"""The default executor: one worker in this process; a step runs when it is submitted."""
from __future__ import annotations

from typing import Any

from dvllm.config import EngineConfig
from dvllm.core.scheduler_output import RunnerOutput, SchedulerOutput
from dvllm.executor.base import Executor, WorkerDied
from dvllm.worker.worker import Worker


class UniProcExecutor(Executor):
    in_process = True

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self.worker = Worker(config)
        self._done: RunnerOutput | None = None

    def call(self, worker: int, method: str, *args: Any) -> Any:
        return getattr(self.worker, method)(*args)

    def submit(self, worker: int, scheduler_output: SchedulerOutput) -> None:
        # A failure here is a bug in this process, not a lost worker: it propagates.
        self._done = self.worker.execute(scheduler_output)

    def execute(self, worker: int, scheduler_output: SchedulerOutput) -> RunnerOutput:
        return RunnerOutput() if scheduler_output.is_empty else self.worker.execute(scheduler_output)

    def wait(self, timeout: float | None = None) -> dict[int, RunnerOutput | WorkerDied]:
        done, self._done = self._done, None
        return {} if done is None else {0: done}

    def shutdown(self) -> None:
        self.worker.close()

