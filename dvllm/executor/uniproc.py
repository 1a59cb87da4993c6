"""The default executor: one worker in this process; a step runs when it is submitted, or (async scheduling) on
the worker's own thread, queued behind the step in flight."""
from __future__ import annotations

from concurrent.futures import Future
from typing import Any

from dvllm.config import EngineConfig
from dvllm.core.scheduler_output import RunnerOutput, SchedulerOutput
from dvllm.executor.base import Executor, WorkerDied
from dvllm.executor.worker import Worker
from dvllm.executor.worker_thread import WorkerThread


class UniProcExecutor(Executor):
    in_process = True

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self.worker = Worker(config)
        self._done: RunnerOutput | None = None
        self._thread = WorkerThread() if config.async_scheduling else None

    def call(self, worker: int, method: str, *args: Any) -> Any:
        if self._thread is not None:  # between steps, as without the thread
            return self._thread.run(getattr(self.worker, method), *args).result()
        return getattr(self.worker, method)(*args)

    def execute_ahead(self, worker: int, scheduler_output: SchedulerOutput) -> Future:
        """Async scheduling: queues the step on the worker's thread, after the one in flight."""
        return self._thread.run(self.worker.execute, scheduler_output)

    def submit(self, worker: int, scheduler_output: SchedulerOutput) -> None:
        # A failure here is a bug in this process, not a lost worker: it propagates.
        self._done = self.worker.execute(scheduler_output)

    def execute(self, worker: int, scheduler_output: SchedulerOutput) -> RunnerOutput:
        return RunnerOutput() if scheduler_output.is_empty else self.worker.execute(scheduler_output)

    def wait(self, timeout: float | None = None) -> dict[int, RunnerOutput | WorkerDied]:
        done, self._done = self._done, None
        return {} if done is None else {0: done}

    def shutdown(self) -> None:
        if self._thread is not None:  # the steps queued finish first: nothing is torn down under them
            self._thread.close()
        self.worker.close()

