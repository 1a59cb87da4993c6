"""What the state pool's sizing takes from the engine's settings, checked here (the flat EngineConfig stays the
one source of the CLI flags and keywords).

`of` takes the flat config as `Any`: dvllm.config is below this package, and naming its type here would make
an import circle."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dvllm.config_checks import positive_int



@dataclass(frozen=True)
class PoolConfig:
    state_pool_mb: float | None = None    # the pool's size as given (None: profiled on CUDA, else 1 GiB)
    num_state_blocks: int | None = None   # a block count over any size (testing, tuning)
    gpu_memory_utilization: float = 0.9   # the share of the GPU the engine may use in all
    decode_stage: bool | None = None      # as asked: None lets the GPU memory profile choose

    @classmethod
    def of(cls, config: Any) -> PoolConfig:
        """The pool's settings of an EngineConfig; ValueError naming a field out of range."""
        check(config)
        return cls(state_pool_mb=config.state_pool_mb, num_state_blocks=config.num_state_blocks,
                   gpu_memory_utilization=config.gpu_memory_utilization, decode_stage=config.decode_stage)


def check(config: Any) -> None:
    if config.num_state_blocks is not None:
        positive_int("num_state_blocks", config.num_state_blocks)
    if config.state_pool_mb is not None and not (isinstance(config.state_pool_mb, (int, float))
                                                 and config.state_pool_mb > 0):
        raise ValueError(f"state_pool_mb must be a number > 0, got {config.state_pool_mb!r}")
    if not (isinstance(config.gpu_memory_utilization, (int, float)) and 0 < config.gpu_memory_utilization <= 1):
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {config.gpu_memory_utilization!r}")
