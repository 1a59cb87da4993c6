"""Data parallel over Ray actors: each hosts a Worker (model and state pool) on its own device.

The driver keeps the schedulers; only each step's SchedulerOutput goes to a worker and
its small RunnerOutput comes back (images once, at the end). Workers sit in one
placement group, one bundle each, and are numbered with the driver's node first, then
by node address: that policy is this module's. Each worker is a remote of dvllm's runtime
(runtime/ray_backend.py: calls, pending answers waited on together, errors, idle pings,
restart in its bundle). A worker that dies is reported by `wait` and restarted in its
bundle when the cluster allows.
"""
from __future__ import annotations

import logging
from typing import Any

from dvllm.config import EngineConfig
from dvllm.core.scheduler_output import RunnerOutput, SchedulerOutput
from dvllm.executor.base import Executor, WorkerDied
from dvllm.runtime.errors import ProcessLost, RemoteError
from dvllm.runtime.liveness import IdlePings
from dvllm.runtime.pending import Pending, wait
from dvllm.runtime.ray_backend import SETUP, WHERE, RayRemote

logger = logging.getLogger(__name__)

_TARGET = "dvllm.executor.ray_worker:RayWorkerWrapper"


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
        self.remotes: list[RayRemote] = []  # by worker
        self._in_flight: dict[Pending, int] = {}  # step -> worker, in submission order
        self._restarting: dict[Pending, tuple[int, Pending]] = {}  # a restarted worker's start -> (worker, WHERE)
        self._pings = IdlePings(config.worker_heartbeat_timeout_s)
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

    @property
    def actors(self) -> list[Any]:
        """Each worker's Ray actor handle."""
        return [remote.actor for remote in self.remotes]

    @property
    def nodes(self) -> list[dict[str, Any]]:
        """Where each worker runs: node_ip, node_id, hostname, pid, gpu_ids."""
        return [remote.node for remote in self.remotes]

    # -- start-up --------------------------------------------------------------------
    def _bundle(self) -> dict[str, float]:
        gpus = self.config.worker_num_gpus
        if gpus is None:  # a GPU each when the cluster has GPUs
            gpus = 1.0 if self.ray.cluster_resources().get("GPU", 0) >= 1 else 0.0
        bundle = {"CPU": float(self.config.worker_num_cpus), "GPU": float(gpus)}
        return {k: v for k, v in bundle.items() if v > 0}

    def _new_remote(self, bundle_index: int) -> RayRemote:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        options = dict(num_cpus=self.bundle.get("CPU", 0), num_gpus=self.bundle.get("GPU", 0), max_restarts=0,
                       scheduling_strategy=PlacementGroupSchedulingStrategy(
                           self.group, placement_group_bundle_index=bundle_index))
        return RayRemote(f"the worker of bundle {bundle_index}", _TARGET, (self.config,), options)

    def _start_all(self) -> None:
        remotes = [self._new_remote(i) for i in range(self.num_workers)]
        self.remotes = remotes  # (shutdown ends them if what follows fails)
        wheres = [r.submit(WHERE, None, bound=self.config.ray_startup_timeout_s) for r in remotes]
        nodes = [where.result() for where in wheres]
        driver_ip = self.ray.util.get_node_ip_address()
        order = sorted(range(len(remotes)), key=lambda i: (nodes[i]["node_ip"] != driver_ip, nodes[i]["node_ip"], i))
        self.remotes = [remotes[i] for i in order]
        for index, remote in enumerate(self.remotes):
            remote.label = f"worker {index}"
        starts = [r.submit(SETUP, None) for r in self.remotes]
        for index, start in enumerate(starts):
            try:
                start.result()
            except (RemoteError, ProcessLost) as e:  # the message must say where it failed
                node = self.nodes[index]
                raise RuntimeError(f"worker {index} on node {node['node_ip']} ({node['hostname']}, GPUs "
                                   f"{node['gpu_ids'] or 'none'}) failed to start: {_cause(e)}") from None
        self._alive = [True] * self.num_workers

    # -- the executor interface --------------------------------------------------------
    def live_workers(self) -> list[int]:
        return [i for i, alive in enumerate(self._alive) if alive]

    def call(self, worker: int, method: str, *args: Any) -> Any:
        return self.remotes[worker].call("call", (method, args))

    def submit(self, worker: int, scheduler_output: SchedulerOutput) -> None:
        self._in_flight[self.remotes[worker].submit("execute", scheduler_output)] = worker

    def wait(self, timeout: float | None = None) -> dict[int, RunnerOutput | WorkerDied]:
        if not self._in_flight:
            return {}
        ready = set(wait(self._in_flight, timeout))
        done: dict[int, RunnerOutput | WorkerDied] = {}
        behind = set()
        for step, worker in list(self._in_flight.items()):  # submission order: a worker's oldest step first
            if worker in done or worker in behind:
                continue  # one step per worker a call, in order (async scheduling queues two)
            if step not in ready:
                behind.add(worker)
                continue
            del self._in_flight[step]
            try:
                done[worker] = step.result()
            except Exception as e:  # noqa: BLE001 - died, node lost, OOM-killed, or the step raised
                done[worker] = WorkerDied(worker, _cause(e))
                self._bury(worker, f"failed a step ({_cause(e)})")
        return done

    def _bury(self, worker: int, why: str) -> None:
        self._alive[worker] = False
        for step in [step for step, w in self._in_flight.items() if w == worker]:  # queued behind: gone too
            del self._in_flight[step]
        self.remotes[worker].kill(why)  # it may be alive but broken

    def restart(self, worker: int) -> None:
        self._bury(worker, "is given up")
        remote = self.remotes[worker]
        remote.restart()  # in its bundle
        where = remote.submit(WHERE, None)
        self._restarting[remote.submit(SETUP, None)] = (worker, where)

    def poll_restarts(self) -> dict[int, str | None]:
        settled: dict[int, str | None] = {}
        for start in wait(self._restarting, timeout=0):
            worker, where = self._restarting.pop(start)
            try:
                start.result()
                where.result()
                self._alive[worker] = True
                settled[worker] = None
            except Exception as e:  # noqa: BLE001 - as wait's
                settled[worker] = _cause(e)
        return settled

    @property
    def heartbeat_interval(self) -> float | None:
        return self.config.worker_heartbeat_s

    def check_health(self) -> dict[int, str]:
        """Pings each live worker with no step in flight (runtime.liveness.IdlePings: an actor answers in order,
        so an idle one answers at once); a ping that fails, or goes unanswered for worker_heartbeat_timeout_s, is
        a death. A worker with steps in flight that is found lost is left to `wait`, which reports its step."""
        busy = set(self._in_flight.values())
        lost = self._pings.check({w: self.remotes[w] for w in self.live_workers()}, busy)
        dead = {worker: why for worker, why in lost.items() if worker not in busy}
        for worker, why in dead.items():
            self._bury(worker, why)
        return dead

    def describe(self, worker: int) -> dict[str, Any]:
        node = self.nodes[worker]
        return {"node_ip": node["node_ip"], "gpu_ids": node["gpu_ids"]}

    def shutdown(self) -> None:
        for remote in self.remotes:
            remote.close()
        self.remotes = []
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
    """What a worker's failure says: the runtime's errors as they are ("Type: message" for the worker's own,
    which worker and how it was lost for a loss), anything else as "Type: message"."""
    if isinstance(error, (RemoteError, ProcessLost)):
        return str(error)
    return f"{type(error).__name__}: {error}"
