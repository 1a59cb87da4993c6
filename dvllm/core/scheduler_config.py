"""What the scheduler and the block manager take from the engine's settings, checked here (the flat
EngineConfig stays the one source of the CLI flags and keywords; this package owns what its fields mean).

`of` takes the flat config as `Any`: dvllm.config is below this package, and naming its type here would make
an import circle."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dvllm.config_checks import choice, positive_int
from dvllm.lora.ref import host_cache_size

SCHEDULING_POLICIES = ("fcfs", "priority")
BATCHING_POLICIES = ("step", "request")
SHAPE_ORDERS = ("auto", "oldest", "turns")


@dataclass(frozen=True)
class SchedulerConfig:
    max_batch_size: int = 16              # denoiser rows per forward (a CFG request's count twice)
    max_running_pixels: int | None = None  # rows x frames x height x width running at once (None: unbounded)
    prompt_chars_per_step: int = 20000    # characters of new prompts admitted per step (one always is)
    max_input_images_per_step: int = 4    # input images encoded per step as their requests are admitted
    scheduling_policy: str = "fcfs"       # fcfs | priority
    batching: str = "step"                # step | request (the request-level policy, for comparisons)
    shape_order: str = "oldest"           # oldest | turns ("auto" resolved)
    request_batch_wait_s: float = 0.0     # batching=request: a batch's window for more of its kind
    priority_aging_iterations: int = 100  # iterations of earlier arrival one priority level is worth
    max_loras: int = 4                    # adapters resident per worker (LoRA slots)
    lora_cache_size: int = 8              # adapters a worker keeps read in host memory (max_cpu_loras)
    elastic: bool = False                 # group_policy=elastic: late requests step alone (deadlines.Pace)
    encode_ahead: int | None = None       # the encode stage's queue (None: no encode stage)
    encode_always: bool = False           # encode workers: every text waits for the stage
    prompt_cache: bool = True             # identical prompt embeddings shared in the pool

    @classmethod
    def of(cls, config: Any) -> SchedulerConfig:
        """The scheduler's settings of an EngineConfig; ValueError naming a field out of range."""
        check(config)
        elastic = config.group_policy == "elastic"
        # auto: oldest, but in turn where the elastic policy's deadline pace (deadlines.py) assumes it
        order = config.shape_order if config.shape_order != "auto" else "turns" if elastic else "oldest"
        return cls(max_batch_size=config.max_batch_size, max_running_pixels=config.max_running_pixels,
                   prompt_chars_per_step=config.max_prompt_chars_per_step or 2 * config.max_prompt_chars,
                   max_input_images_per_step=config.max_input_images_per_step,
                   scheduling_policy=config.scheduling_policy, batching=config.batching, shape_order=order,
                   request_batch_wait_s=config.request_batch_wait_s,
                   priority_aging_iterations=config.priority_aging_iterations, max_loras=config.max_loras,
                   lora_cache_size=host_cache_size(config),
                   elastic=elastic, encode_ahead=config.max_encode_ahead if config.encode_stage else None,
                   encode_always=config.encode_workers > 0, prompt_cache=config.enable_prompt_cache)


def check(config: Any) -> None:
    """The scheduling fields in range, and the combinations that cannot work refused."""
    choice("scheduling_policy", config.scheduling_policy, SCHEDULING_POLICIES)
    choice("batching", config.batching, BATCHING_POLICIES)
    choice("shape_order", config.shape_order, SHAPE_ORDERS)
    if config.shape_order == "oldest" and config.group_policy == "elastic":
        raise ValueError("shape_order='oldest' with group_policy='elastic': the elastic policy's deadline pace counts "
                         "a step of every shape per step (shapes in turn); leave shape_order at auto (turns there)")
    if not 0 <= config.request_batch_wait_s <= 60:
        raise ValueError(f"request_batch_wait_s must be within [0, 60] seconds, got {config.request_batch_wait_s}")
    if config.request_batch_wait_s and config.batching != "request":
        raise ValueError("request_batch_wait_s is the request-level policy's window: set batching='request' with it")
    # (max_batch_size is every layer's bound: EngineConfig checks it)
    for name in ("priority_aging_iterations", "max_encode_ahead", "max_input_images_per_step"):
        positive_int(name, getattr(config, name))
    for name in ("max_running_pixels", "max_prompt_chars_per_step"):
        if getattr(config, name) is not None:
            positive_int(name, getattr(config, name))
