"""The engine's flat settings (EngineConfig: the CLI flags and Python keywords) resolved once into the small
configs each package owns and checks. Every way of starting an engine resolves them before anything loads
(start_checks.check_at_start), so a value out of range is refused then; a process handed the flat config (a Ray
worker, a group member) resolves its own part at its start."""
from __future__ import annotations

from dataclasses import dataclass

from dvllm.config import EngineConfig
from dvllm.core.scheduler_config import SchedulerConfig
from dvllm.parallel.parallel_config import ParallelConfig
from dvllm.worker.pool_config import PoolConfig
from dvllm.worker.stage_config import StageConfig


@dataclass(frozen=True)
class EngineConfigs:
    scheduler: SchedulerConfig
    pool: PoolConfig
    stages: StageConfig
    parallel: ParallelConfig

    @classmethod
    def of(cls, config: EngineConfig) -> EngineConfigs:
        """ValueError naming the field that is out of range."""
        return cls(scheduler=SchedulerConfig.of(config), pool=PoolConfig.of(config), stages=StageConfig.of(config),
                   parallel=ParallelConfig.of(config))
