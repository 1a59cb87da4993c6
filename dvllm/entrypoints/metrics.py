"""Prometheus metrics of one server, in a registry of its own (no global state)."""
from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from dvllm.core.stage_stats import STAGES
from dvllm.engine.engine import StepStats
from dvllm.outputs import RequestOutput

logger = logging.getLogger(__name__)

OUTCOMES = ("success", "bad_request", "rejected", "unavailable", "timeout", "disconnected", "error")
_LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 120, 300, 600)
_STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)
_ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class ServerMetrics:
    """Request outcomes and latencies (event loop), step stats (engine loop thread), engine gauges."""

    def __init__(self, engine_stats: Callable[[], dict], in_flight: Callable[[], int],
                 liveness: Callable[[], dict] | None = None, custom_ops: dict | None = None) -> None:
        self.registry = CollectorRegistry()  # collectors without describe() are not called at registration
        r = self.registry
        self.requests = Counter("dvllm_requests", "Image generation requests by outcome.", ["outcome"], registry=r)
        for outcome in OUTCOMES:
            self.requests.labels(outcome)  # present at 0 from the start
        self.queue_time = Histogram("dvllm_request_queue_time_seconds", "Arrival to first denoising step.",
                                    buckets=_LATENCY_BUCKETS, registry=r)
        self.latency = Histogram("dvllm_request_latency_seconds", "Arrival to final images (successful requests).",
                                 buckets=_LATENCY_BUCKETS, registry=r)
        self.step_time = Histogram("dvllm_step_time_seconds", "Wall time of one engine step.",
                                   buckets=_STEP_BUCKETS, registry=r)
        self.batch_rows = Histogram("dvllm_batch_rows", "Denoiser rows in one step's forward.",
                                    buckets=_ROW_BUCKETS, registry=r)
        self._engine_stats = engine_stats
        self._snapshot = engine_stats()  # replaced from the loop thread after every step
        self._lock = threading.Lock()
        r.register(_EngineCollector(self.snapshot, in_flight))
        if liveness is not None:  # the engine core's heartbeat, read at scrape time (AsyncDiffusionEngine.liveness)
            r.register(_CoreCollector(liveness))
        if custom_ops is not None:  # the workers' kernels (LoadedModel.custom_ops): fixed at start
            Gauge("dvllm_custom_ops_info", "dvllm's kernels in the workers: the device types they serve (none: the "
                  "pure-torch reference ops) and where they came from (package, jit, none).", ["kernels", "source"],
                  registry=r).labels(",".join(custom_ops["kernels"]) or "none", custom_ops["source"]).set(1)

    def snapshot(self) -> dict:
        with self._lock:
            return dict(self._snapshot)

    def on_step(self, stats: StepStats, outputs: list[RequestOutput]) -> None:
        """An engine step listener. Runs on the engine's loop thread, where its stats are consistent;
        it must never raise, or it would take the engine loop down with it."""
        try:
            if stats.num_rows:
                self.step_time.observe(stats.seconds)
                self.batch_rows.observe(stats.num_rows)
            snapshot = self._engine_stats()
            with self._lock:
                self._snapshot = snapshot
        except Exception:  # noqa: BLE001 - metrics must not kill the engine
            logger.exception("metrics step listener failed")

    def request_done(self, outcome: str, output: RequestOutput | None = None) -> None:
        self.requests.labels(outcome).inc()
        if outcome == "success" and output is not None:
            if output.metrics.queue_time is not None:
                self.queue_time.observe(output.metrics.queue_time)
            if output.metrics.latency is not None:
                self.latency.observe(output.metrics.latency)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _EngineCollector(Collector):
    """Scheduler, state-pool and prompt-cache counters from the latest snapshot, read at scrape time."""

    def __init__(self, snapshot: Callable[[], dict], in_flight: Callable[[], int]) -> None:
        self._snapshot = snapshot
        self._in_flight = in_flight

    def collect(self) -> Iterator[Metric]:
        s = self._snapshot()
        gauges = {
            "dvllm_num_requests_running": ("Requests holding state and taking steps.", s["num_running"]),
            "dvllm_num_requests_waiting": ("Requests waiting for admission.", s["num_waiting"]),
            "dvllm_num_requests_decoding": ("Requests whose last step is done, in the workers' decode stages.",
                                            s.get("num_decoding", 0)),
            "dvllm_pool_used_blocks": ("State-pool blocks held by live requests.", s["pool_used_blocks"]),
            "dvllm_pool_cached_blocks": ("State-pool blocks held only by the prompt cache.",
                                         s["pool_cached_blocks"]),
            "dvllm_pool_total_blocks": ("State-pool blocks in all.", s["pool_total_blocks"]),
            "dvllm_prompt_cache_hit_rate": ("Prompt-cache hits / queries since start.",
                                            s["prompt_cache_hits"] / max(1, s["prompt_cache_queries"])),
            "dvllm_server_requests_in_flight": ("Generation requests accepted by the server and not yet answered.",
                                                self._in_flight()),
            "dvllm_num_workers": ("Workers (each with its own model and state pool).", s["num_workers"]),
            "dvllm_num_workers_alive": ("Workers alive; fewer than dvllm_num_workers means degraded.",
                                        s["num_workers_alive"]),
            "dvllm_loras_resident": ("LoRA adapters in the workers' slots.", s["loras_resident"]),
            "dvllm_result_cache_bytes": ("Host bytes of images held by the exact result cache.",
                                         s.get("result_cache_bytes", 0)),
            "dvllm_result_cache_entries": ("Requests' results held by the exact result cache.",
                                           s.get("result_cache_entries", 0)),
        }
        for name, (doc, value) in gauges.items():
            yield GaugeMetricFamily(name, doc, value=value)
        yield from _stage_metrics(s)
        per_worker = {
            "dvllm_worker_alive": ("1 when the worker is alive.", lambda w: float(w["alive"])),
            "dvllm_worker_rows_per_step": ("Mean denoiser rows per step on the worker.", lambda w: w["rows_per_step"]),
            "dvllm_worker_steps_per_second": ("Steps per second while the worker was busy.",
                                              lambda w: w["steps_per_s"]),
            "dvllm_worker_pool_used_blocks": ("State-pool blocks in use on the worker.",
                                              lambda w: w["pool_used_blocks"]),
            "dvllm_worker_restarts": ("Times the worker was restarted after dying.", lambda w: w["restarts"]),
        }
        for name, (doc, read) in per_worker.items():
            family = GaugeMetricFamily(name, doc, labels=["worker"])
            for w in s.get("workers", []):
                family.add_metric([str(w["worker"])], read(w))
            yield family
        calls = GaugeMetricFamily("dvllm_stage_process_call_age_seconds", "How long a stage process's call in flight "
                                  "(an encode or decode worker's batch, a group member's forward) has waited, as of "
                                  "its worker's latest step (0: idle); past its bound the process is killed and "
                                  "started again.", labels=["worker", "stage", "index"])
        for w in s.get("workers", []):
            for p in w.get("stage_processes", []):
                calls.add_metric([str(w["worker"]), p["stage"], str(p["index"])], p["call_age_s"] or 0.0)
        yield calls
        yield CounterMetricFamily("dvllm_preemptions", "Requests preempted (state swapped out).",
                                  value=s["num_preemptions"])
        deadlines = CounterMetricFamily("dvllm_deadlines", "Finished requests that had a deadline, by whether "
                                        "their images were done by it.", labels=["met"])
        deadlines.add_metric(["true"], s.get("deadlines_met", 0))
        deadlines.add_metric(["false"], s.get("deadlines_missed", 0))
        yield deadlines
        yield CounterMetricFamily("dvllm_late_steps", "Steps the elastic group policy ran for requests about to "
                                  "miss their deadline, ahead of the rest.", value=s.get("late_steps", 0))
        yield CounterMetricFamily("dvllm_prompt_cache_queries", "Prompt-cache lookups.",
                                  value=s["prompt_cache_queries"])
        yield CounterMetricFamily("dvllm_prompt_cache_hits", "Prompt-cache hits.", value=s["prompt_cache_hits"])
        yield CounterMetricFamily("dvllm_step_cache_skipped_rows", "Denoiser rows whose blocks (or attention) "
                                  "step caching skipped or predicted.", value=s["cache_skipped_rows"])
        yield CounterMetricFamily("dvllm_step_cache_computed_rows", "Denoiser rows of caching requests that "
                                  "computed every block.", value=s["cache_computed_rows"])
        yield CounterMetricFamily("dvllm_lora_slot_loads", "LoRA adapters copied into a worker's slots (a miss: "
                                  "the adapter was not resident).", value=s["lora_slot_loads"])
        yield CounterMetricFamily("dvllm_result_cache_queries", "Seeded requests looked up in the exact result "
                                  "cache.", value=s.get("result_cache_queries", 0))
        yield CounterMetricFamily("dvllm_result_cache_hits", "Requests answered from the exact result cache "
                                  "(no step ran).", value=s.get("result_cache_hits", 0))


# What waits for each stage: new requests are encoded at admission, running ones take denoising steps,
# finished ones wait in the decode stage (the loop's own decodes have no queue).
_STAGE_QUEUES = {"encode": "num_waiting", "encode_stage": "num_encoding", "denoise": "num_running",
                 "decode_stage": "num_decoding"}


def _stage_metrics(s: dict) -> Iterator[Metric]:
    """Per stage: its queue, and its busy seconds and items (rate(busy) is the stage's occupancy)."""
    seconds, items = s.get("stage_seconds", {}), s.get("stage_items", {})
    queue = GaugeMetricFamily("dvllm_stage_queue", "Requests waiting for or in a stage (encode: waiting for "
                              "admission; encode_stage: texts queued or ready in the encode stage; denoise: running; "
                              "decode_stage: in the decode stage).", labels=["stage"])
    busy = CounterMetricFamily("dvllm_stage_busy_seconds", "Seconds a stage worked, summed over workers: encode "
                               "and decode are the work the denoise loop ran itself, encode_stage and decode_stage "
                               "the stage threads'.",
                               labels=["stage"])
    done = CounterMetricFamily("dvllm_stage_items", "Items a stage processed: requests admitted (encode), texts "
                               "encoded ahead (encode_stage), denoiser rows, images decoded.", labels=["stage"])
    for stage in STAGES:
        if stage in _STAGE_QUEUES:
            queue.add_metric([stage], s.get(_STAGE_QUEUES[stage], 0))
        busy.add_metric([stage], seconds.get(stage, 0.0))
        done.add_metric([stage], items.get(stage, 0))
    restarts = CounterMetricFamily("dvllm_stage_restarts", "Parts of a stage that died and were started again: its "
                                   "thread, or one of its decode or encode worker processes, or a worker group's "
                                   "members (the work they held was done anew: nothing is lost).",
                                   labels=["stage", "part"])
    for key, count in s.get("stage_restarts", {}).items():
        restarts.add_metric(key.split("."), count)
    timeouts = CounterMetricFamily("dvllm_stage_timeouts", "Of dvllm_stage_restarts, the stage processes that "
                                   "left a call unanswered past its bound (stopped, wedged) and were killed.",
                                   labels=["stage", "part"])
    for key, count in s.get("stage_timeouts", {}).items():
        timeouts.add_metric(key.split("."), count)
    forwards = CounterMetricFamily("dvllm_group_forwards", "A worker group's denoiser forwards, by how they ran: "
                                   "every row's tokens split, the rows split, or on the worker alone (forwards with "
                                   "step-cached rows).", labels=["split"])
    for split, count in s.get("group_forwards", {}).items():
        forwards.add_metric([split], count)
    yield from (queue, busy, done, restarts, timeouts, forwards)


class _CoreCollector(Collector):
    """The engine core's heartbeat: the age of its loop's latest report, and the times it passed its bound."""

    def __init__(self, liveness: Callable[[], dict]) -> None:
        self._liveness = liveness

    def collect(self) -> Iterator[Metric]:
        core = self._liveness()["engine_core"]
        yield GaugeMetricFamily("dvllm_engine_core_heartbeat_age_seconds", "Seconds since the engine core's step "
                                "loop last reported (it answers a ping between two steps); past "
                                "core_heartbeat_timeout_s /health answers 503.", value=core["heartbeat_age_s"])
        yield CounterMetricFamily("dvllm_engine_core_stalls", "Times the engine core answered nothing for longer "
                                  "than core_heartbeat_timeout_s.", value=core["stalls"])
