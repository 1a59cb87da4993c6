"""Coordinator.rebalance (data parallelism): an idle worker takes requests that wait, unstarted, on another, and
a moved request keeps the iterations it already waited, which priority aging counts, so that a move never puts
it behind requests that arrived after it."""
from __future__ import annotations

from scheduler_utils import Clock, iterate

from dvllm.config import EngineConfig
from dvllm.core.scheduler_config import SchedulerConfig
from dvllm.engine.coordinator import Coordinator
from dvllm.profiler import PhaseTimer


class TwoWorkers:
    """What the coordinator asks of an executor before any step: two workers out of process and their pools."""

    num_workers, in_process = 2, False

    def pool_info(self, index: int) -> tuple[int, int]:
        return 1000, 64


def test_a_request_moved_to_an_idle_worker_keeps_the_iterations_it_waited():
    config = EngineConfig(max_batch_size=1, scheduling_policy="priority")
    coordinator = Coordinator(config, SchedulerConfig.of(config), TwoWorkers(), PhaseTimer(False))
    busy, idle = coordinator.cores
    clock = Clock()
    busy.scheduler.add_request(clock.request("running", steps=50, cfg=False))
    for _ in range(5):
        iterate(busy.scheduler)
    busy.scheduler.add_request(clock.request("waiting", steps=3, cfg=False))
    for _ in range(7):  # one row a forward: it waits behind the running request
        iterate(busy.scheduler)
    assert busy.scheduler.requests["waiting"] in busy.scheduler.waiting
    idle.scheduler.steps_run = 4  # the idle worker's own clock, which ran other requests meanwhile

    coordinator.rebalance(idle)
    moved = idle.scheduler.requests["waiting"]
    assert coordinator.home["waiting"] is idle and "waiting" not in busy.scheduler.requests
    assert idle.scheduler.steps_run - moved.arrival_iteration == 7  # the 7 iterations it waited, kept
    later = clock.request("later", steps=3, cfg=False)  # arrives after it, at the same priority: behind it
    idle.scheduler.add_request(later)
    assert idle.scheduler.urgency(moved) < idle.scheduler.urgency(later)
