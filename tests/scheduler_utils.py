"""The scheduler's test harness: requests on a counter clock, a fake worker, a scheduler over a block pool."""
from __future__ import annotations

from dvllm.config import EngineConfig
from dvllm.core.block_manager import BlockManager
from dvllm.core.request import Request
from dvllm.core.scheduler import Scheduler
from dvllm.core.scheduler_config import SchedulerConfig
from dvllm.core.scheduler_output import RunnerOutput
from dvllm.sampling_params import SamplingParams


class Clock:
    def __init__(self) -> None:
        self.seq = 0

    def request(self, rid: str, steps: int, n: int = 1, cfg: bool = True, size: int = 16, priority: int = 0,
                prompt: str | None = None, latent_blocks: int = 1, cond_blocks: int = 1,
                history: bool = False) -> Request:
        self.seq += 1
        params = SamplingParams(num_inference_steps=steps, guidance_scale=5.0 if cfg else 1.0, height=size,
                                width=size, seed=0, n=n, priority=priority)
        return Request(request_id=rid, prompt=prompt or rid, params=params, num_steps=steps, cfg=cfg, plan=None,
                       arrival_time=float(self.seq), arrival_seq=self.seq, latent_blocks=latent_blocks,
                       cond_blocks=cond_blocks, history_slots=int(history))


def iterate(scheduler: Scheduler):
    """One engine iteration with a fake worker that finishes whoever took its last step."""
    out = scheduler.schedule()
    done = [rid for rid in out.scheduled_ids
            if scheduler.requests[rid].num_steps_done + 1 == scheduler.requests[rid].num_steps]
    outputs = scheduler.update_from_output(out, RunnerOutput(images={rid: ["img"] for rid in done}))
    return out, outputs


def make(num_blocks: int = 1000, cache: bool = True, **kwargs) -> Scheduler:
    return Scheduler(SchedulerConfig.of(EngineConfig(**kwargs)), BlockManager(num_blocks, cache))
