"""Data parallel over Ray actors: each hosts a Worker (model and state pool) on its own device.

The driver keeps the schedulers; only each step's SchedulerOutput goes to a worker and
its small RunnerOutput comes back (images once, at the end). Workers sit in one
placement group, one bundle each, and are numbered with the driver's node first, then
by node address. A worker that dies is reported by `wait` and restarted in its bundle
when the cluster allows.
"""
from __future__ import annotations

import logging
import time
from typing import Any

from dvllm.config import EngineConfig
from dvllm.core.scheduler_output import RunnerOutput, SchedulerOutput
from dvllm.executor.base import Executor, WorkerDied
from dvllm.executor.ray_worker import RayWorkerWrapper

logger = logging.getLogger(__name__)


def _import_ray():
    try:
        import ray
    except ImportError:
        raise ImportError("executor='ray' needs Ray: pip install 'dvllm[ray]'") from None
    return ray


class RayExecutor(Executor):
    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        ray = self.ray = _import_ray()
        from ray.util.placement_group import placement_group, remove_placement_group

        self._started_ray = not ray.is_initialized()
        if self._started_ray:
            # address None starts a local Ray runtime; "auto" or host:port joins a running cluster.
            try:
                ray.init(address=config.ray_address, include_dashboard=False, log_to_driver=True,
                         logging_level=logging.WARNING)
            except ConnectionError as e:
                raise ConnectionError(
                    f"{e}. Is the cluster up (`ray status --address {config.ray_address}`)? A cluster with token "
                    "authentication (Ray's default since 2.52) needs RAY_AUTH_MODE=token and its token "
                    "(~/.ray/auth_token or RAY_AUTH_TOKEN) in this process.") from None
        self.num_workers = config.num_workers
        self.bundle = self._bundle()
        self._remove_group = remove_placement_group
        self.group = None
        self.actors: list[Any] = []
        self.nodes: list[dict[str, Any]] = []  # where each worker runs (RayWorkerWrapper.node)
        self._in_flight: dict[Any, int] = {}   # step ObjectRef -> worker
        self._restarting: dict[Any, int] = {}  # start() ObjectRef of a restarted actor -> worker
        self._pings: dict[Any, tuple[int, Any, float]] = {}  # heartbeat ObjectRef -> (worker, actor, sent at)
        self._alive: list[bool] = []
        try:
            _check_feasible(ray, self.bundle, self.num_workers)
            self.group = placement_group([dict(self.bundle)] * self.num_workers, strategy="PACK")
            ready, _ = ray.wait([self.group.ready()], timeout=config.ray_startup_timeout_s)
            if not ready:
                free = {k: round(v, 2) for k, v in ray.available_resources().items() if k in ("CPU", "GPU")}
                raise RuntimeError(f"Ray could not reserve {self.num_workers} worker(s) of {self.bundle} within "
                                   f"ray_startup_timeout_s={config.ray_startup_timeout_s}: "
                                   f"{_describe_cluster(ray)}; free now {free} (other workers or jobs hold "
                                   "the rest)")
            self._start_all()
        except BaseException:
            self.shutdown()
            raise

    # -- start-up --------------------------------------------------------------------
    def _bundle(self) -> dict[str, float]:
        gpus = self.config.worker_num_gpus
        if gpus is None:  # a GPU each when the cluster has GPUs
            gpus = 1.0 if self.ray.cluster_resources().get("GPU", 0) >= 1 else 0.0
        bundle = {"CPU": float(self.config.worker_num_cpus), "GPU": float(gpus)}
        return {k: v for k, v in bundle.items() if v > 0}

    def _new_actor(self, bundle_index: int) -> Any:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        cls = self.ray.remote(RayWorkerWrapper)
        return cls.options(
            num_cpus=self.bundle.get("CPU", 0), num_gpus=self.bundle.get("GPU", 0), max_restarts=0,
            scheduling_strategy=PlacementGroupSchedulingStrategy(self.group, placement_group_bundle_index=bundle_index),
        ).remote(self.config)

    def _start_all(self) -> None:
        ray = self.ray
        actors = [self._new_actor(i) for i in range(self.num_workers)]
        nodes = ray.get([a.node.remote() for a in actors], timeout=self.config.ray_startup_timeout_s)
        driver_ip = ray.util.get_node_ip_address()
        order = sorted(range(len(actors)), key=lambda i: (nodes[i]["node_ip"] != driver_ip, nodes[i]["node_ip"], i))
        self.actors = [actors[i] for i in order]
        self.nodes = [nodes[i] for i in order]
        self.bundle_index = list(order)
        starts = [a.start.remote() for a in self.actors]
        for index, ref in enumerate(starts):
            try:
                ray.get(ref)
            except Exception as e:  # noqa: BLE001 - the message must say where it failed
                raise RuntimeError(f"worker {index} on node {self.nodes[index]['node_ip']} "
                                   f"({self.nodes[index]['hostname']}, GPUs {self.nodes[index]['gpu_ids'] or 'none'}) "
                                   f"failed to start: {_cause(e)}") from None
        self._alive = [True] * self.num_workers

    # -- the executor interface --------------------------------------------------------
    def live_workers(self) -> list[int]:
        return [i for i, alive in enumerate(self._alive) if alive]

    def call(self, worker: int, method: str, *args: Any) -> Any:
        return self.ray.get(self.actors[worker].call.remote(method, *args))

    def submit(self, worker: int, scheduler_output: SchedulerOutput) -> None:
        self._in_flight[self.actors[worker].execute.remote(scheduler_output)] = worker

    def wait(self, timeout: float | None = None) -> dict[int, RunnerOutput | WorkerDied]:
        if not self._in_flight:
            return {}
        refs = list(self._in_flight)
        ready, rest = self.ray.wait(refs, num_returns=1, timeout=timeout)
        if rest and ready:  # whatever else is done already comes along
            ready += self.ray.wait(rest, num_returns=len(rest), timeout=0)[0]
        done: dict[int, RunnerOutput | WorkerDied] = {}
        ready_refs, behind = set(ready), set()
        for ref, worker in list(self._in_flight.items()):  # submission order: a worker's oldest step first
            if worker in done or worker in behind:
                continue  # one step per worker a call, in order (async scheduling queues two)
            if ref not in ready_refs:
                behind.add(worker)
                continue
            del self._in_flight[ref]
            try:
                done[worker] = self.ray.get(ref)
            except Exception as e:  # noqa: BLE001 - actor died, node lost, OOM-killed, or raised
                done[worker] = WorkerDied(worker, _cause(e))
                self._bury(worker)
        return done

    def _bury(self, worker: int) -> None:
        self._alive[worker] = False
        for ref in [ref for ref, w in self._in_flight.items() if w == worker]:  # a step queued behind: gone too
            del self._in_flight[ref]
        try:
            self.ray.kill(self.actors[worker], no_restart=True)  # it may be alive but broken
        except Exception:  # noqa: BLE001 - already gone
            pass

    def restart(self, worker: int) -> None:
        self._bury(worker)
        self.actors[worker] = self._new_actor(self.bundle_index[worker])
        self._restarting[self.actors[worker].start.remote()] = worker

    def poll_restarts(self) -> dict[int, str | None]:
        if not self._restarting:
            return {}
        ready, _ = self.ray.wait(list(self._restarting), num_returns=len(self._restarting), timeout=0)
        settled: dict[int, str | None] = {}
        for ref in ready:
            worker = self._restarting.pop(ref)
            try:
                self.ray.get(ref)
                self.nodes[worker] = self.ray.get(self.actors[worker].node.remote())
                self._alive[worker] = True
                settled[worker] = None
            except Exception as e:  # noqa: BLE001
                settled[worker] = _cause(e)
        return settled

    @property
    def heartbeat_interval(self) -> float | None:
        return self.config.worker_heartbeat_s

    def check_health(self) -> dict[int, str]:
        """Pings each live worker with no step or ping in flight (an actor answers in order, so an idle one
        answers at once); a ping that fails, or goes unanswered for worker_heartbeat_timeout_s, is a death."""
        now, ray = time.monotonic(), self.ray
        busy = set(self._in_flight.values()) | {worker for worker, _, _ in self._pings.values()}
        for worker in self.live_workers():
            if worker not in busy:
                actor = self.actors[worker]
                self._pings[actor.node.remote()] = (worker, actor, now)
        ready, _ = ray.wait(list(self._pings), num_returns=len(self._pings), timeout=0)
        dead: dict[int, str] = {}
        for ref in ready:
            worker, actor, _ = self._pings.pop(ref)
            try:
                ray.get(ref)
            except Exception as e:  # noqa: BLE001 - actor died, node lost
                if actor is self.actors[worker] and self._alive[worker]:  # not a ping to a replaced actor
                    dead[worker] = _cause(e)
        for ref, (worker, actor, sent) in list(self._pings.items()):
            if now - sent > self.config.worker_heartbeat_timeout_s and actor is self.actors[worker]:
                del self._pings[ref]
                dead[worker] = f"no heartbeat for {self.config.worker_heartbeat_timeout_s:g} s"
        for worker in dead:
            self._bury(worker)
        return dead

    def describe(self, worker: int) -> dict[str, Any]:
        node = self.nodes[worker]
        return {"node_ip": node["node_ip"], "gpu_ids": node["gpu_ids"]}

    def shutdown(self) -> None:
        for actor in self.actors:
            try:
                self.ray.kill(actor, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass
        self.actors = []
        if self.group is not None:
            try:
                self._remove_group(self.group)
            except Exception:  # noqa: BLE001 - the cluster may be gone
                pass
            self.group = None
        if self._started_ray and self.ray.is_initialized():
            self.ray.shutdown()
            self._started_ray = False


def _check_feasible(ray: Any, bundle: dict[str, float], count: int) -> None:
    """Fails fast, naming what is missing, when no placement of `count` bundles exists on the cluster
    as it is (Ray itself would wait for ever for resources that never come)."""
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    fits = sum(min((int(n["Resources"].get(k, 0) // v) for k, v in bundle.items()), default=count) for n in nodes)
    if fits >= count:
        return
    totals = {k: sum(n["Resources"].get(k, 0) for n in nodes) for k in bundle}
    short = [f"{k} (asked {v * count:g} in all, {v:g} per worker; the cluster has {totals[k]:g})"
             for k, v in bundle.items() if totals[k] < v * count]
    what = ", ".join(short) or f"no node holds a whole worker's {bundle}"
    raise RuntimeError(f"the Ray cluster cannot host {count} worker(s) of {bundle}: missing {what}. "
                       f"{_describe_cluster(ray)}. Lower num_workers, worker_num_gpus or worker_num_cpus, "
                       "or add nodes.")


def _describe_cluster(ray: Any) -> str:
    parts = []
    for n in ray.nodes():
        if n.get("Alive"):
            res = n["Resources"]
            parts.append(f"node {n.get('NodeManagerAddress')}: CPU {res.get('CPU', 0):g}, GPU {res.get('GPU', 0):g}")
    return "cluster: " + ("; ".join(parts) or "no live nodes")


def _cause(error: BaseException) -> str:
    """The worker's own exception when there is one, else Ray's first line."""
    cause = getattr(error, "cause", None)
    if isinstance(cause, BaseException):
        return f"{type(cause).__name__}: {cause}"
    return f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
