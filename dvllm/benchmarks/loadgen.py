"""`dvllm bench loadgen`: MLPerf LoadGen drives the engine, in the Offline, Server and SingleStream scenarios.

LoadGen (`mlcommons-loadgen`, the harness every MLPerf Inference submission runs) decides when each query is
sent and judges the run; the system under test here is an AsyncDiffusionEngine in this process. The defaults
are MLPerf's text-to-image (SDXL) benchmark's: 1024x1024, 20 Euler steps, guidance 8.0, and each sample's
starting latents fixed (MLPerf ships them; here each sample index has its own seed), p99 <= 20 s in Server.

An unofficial run, and the summary says so: the prompts are a caption set made here with COCO's lengths
(captions.py), no accuracy is checked (FID and CLIP scores need the real weights and COCO's images), and the
durations and query counts may be cut from MLPerf's to fit a CI run. VALID means the run met the settings it
ran with (its duration and query count, the Server latency bound, LoadGen's early stopping).

    dvllm bench loadgen --model sdxl --load-format dummy --scenario Offline --offline-expected-qps 2
    dvllm bench loadgen --model sdxl --load-format dummy --scenario Server --server-target-qps 2
    dvllm bench loadgen --model tiny-sd --load-format dummy --size 64x64 --steps 4 --scenario all --min-duration-s 5

Published, for scale: MLPerf Inference v5.0, 8x H200 with TensorRT, SDXL Offline 18.99 samples/s (2.37 a GPU),
Server 18.30 queries/s (2.29 a GPU) under p99 <= 20 s.
"""
from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dvllm.benchmarks.captions import captions
from dvllm.benchmarks.workloads import check_size

SCENARIOS = ("Offline", "Server", "SingleStream")
MLPERF_SDXL = {"size": "1024x1024", "steps": 20, "guidance": 8.0, "sampler": "euler", "samples": 5000,
               "target_latency_s": 20.0, "min_duration_s": 600.0}
UNOFFICIAL = ("unofficial: generated captions with COCO's lengths, no accuracy check, durations and counts as "
              "given (not MLPerf's)")


def add_arguments(p: argparse.ArgumentParser) -> None:
    from dvllm.config_flags import add_engine_args

    run = p.add_argument_group("loadgen")
    run.add_argument("--scenario", default="Offline",
                     help="Offline, Server or SingleStream, several as a comma list (run in turn on one engine), or "
                          "all (default: Offline).")
    run.add_argument("--size", default=MLPERF_SDXL["size"], help="WxH (default: MLPerf SDXL's 1024x1024).")
    run.add_argument("--steps", type=int, default=MLPERF_SDXL["steps"], help="Denoising steps (default: 20).")
    run.add_argument("--guidance", type=float, default=MLPERF_SDXL["guidance"], help="guidance_scale (default: 8.0).")
    run.add_argument("--sampler", default=MLPERF_SDXL["sampler"], help="Sampler (default: euler, MLPerf's).")
    run.add_argument("--num-samples", type=int, default=MLPERF_SDXL["samples"],
                     help="Captions in the sample library (default: 5000, as MLPerf's COCO subset).")
    run.add_argument("--caption-seed", type=int, default=0, help="Seed of the generated captions (default: 0).")
    run.add_argument("--min-duration-s", type=float, default=MLPERF_SDXL["min_duration_s"],
                     help="Shortest run LoadGen accepts (default: MLPerf's 600 s).")
    run.add_argument("--min-query-count", type=int, default=None, help="Fewest queries (default: LoadGen's).")
    run.add_argument("--server-min-query-count", type=int, default=None,
                     help="Server's fewest queries instead (default: --min-query-count). LoadGen's early stopping "
                          "wants 459 at least, every one in bound, to vouch for a p99.")
    run.add_argument("--offline-expected-qps", type=float, default=1.0,
                     help="Offline: samples/s expected; LoadGen sends enough for the duration (default: 1).")
    run.add_argument("--server-target-qps", type=float, default=1.0,
                     help="Server: Poisson arrival rate, queries/s (default: 1).")
    run.add_argument("--server-target-latency-s", type=float, default=MLPERF_SDXL["target_latency_s"],
                     help="Server: the latency bound (default: 20 s).")
    run.add_argument("--server-latency-percentile", type=float, default=0.99,
                     help="Server: the share of queries that must meet the bound (default: 0.99).")
    run.add_argument("--single-stream-expected-latency-s", type=float, default=1.0,
                     help="SingleStream: a first guess of one query's latency (default: 1 s).")
    run.add_argument("--output-dir", default="loadgen-logs",
                     help="LoadGen's logs, a folder per scenario (default: ./loadgen-logs).")
    run.add_argument("--output-json", help="Also write the results here.")
    add_engine_args(p)


@dataclass
class Settings:
    """What one scenario runs with: LoadGen's TestSettings, in seconds and plain names."""

    scenario: str
    min_duration_s: float
    min_query_count: int | None = None
    offline_expected_qps: float = 1.0
    server_target_qps: float = 1.0
    server_target_latency_s: float = 20.0
    server_latency_percentile: float = 0.99
    single_stream_expected_latency_s: float = 1.0

    def __post_init__(self) -> None:
        if self.scenario not in SCENARIOS:
            raise ValueError(f"scenario must be one of {list(SCENARIOS)}, got {self.scenario!r}")
        positive = {"min_duration_s": self.min_duration_s, "offline_expected_qps": self.offline_expected_qps,
                    "server_target_qps": self.server_target_qps,
                    "server_target_latency_s": self.server_target_latency_s,
                    "single_stream_expected_latency_s": self.single_stream_expected_latency_s}
        for name, value in positive.items():
            if not value > 0:
                raise ValueError(f"{name} must be positive, got {value}")
        if not 0 < self.server_latency_percentile < 1:
            raise ValueError(f"server_latency_percentile must be in (0, 1), got {self.server_latency_percentile}")
        if self.min_query_count is not None and self.min_query_count < 1:
            raise ValueError(f"min_query_count must be at least 1, got {self.min_query_count}")

    def test_settings(self) -> Any:
        import mlperf_loadgen as lg

        s = lg.TestSettings()
        s.scenario = getattr(lg.TestScenario, self.scenario)
        s.mode = lg.TestMode.PerformanceOnly
        s.min_duration_ms = int(self.min_duration_s * 1000)
        if self.min_query_count is not None:
            s.min_query_count = self.min_query_count
        s.offline_expected_qps = self.offline_expected_qps
        s.server_target_qps = self.server_target_qps
        s.server_target_latency_ns = int(self.server_target_latency_s * 1e9)
        s.server_target_latency_percentile = self.server_latency_percentile
        s.single_stream_expected_latency_ns = int(self.single_stream_expected_latency_s * 1e9)
        return s


@dataclass
class Request:
    """The generation LoadGen's sample index stands for: its caption, and a seed of its own."""

    size: str
    steps: int
    guidance: float
    sampler: str | None
    prompts: list[str] = field(default_factory=list)

    def params(self, index: int) -> Any:
        from dvllm.sampling_params import SamplingParams

        width, height = (int(v) for v in self.size.split("x"))
        return SamplingParams(num_inference_steps=self.steps, guidance_scale=self.guidance, sampler=self.sampler,
                              height=height, width=width, seed=index, output_type="np")


class EngineSUT:
    """LoadGen's system under test: each query sample becomes a request of an AsyncDiffusionEngine that runs on
    an event loop of its own thread. LoadGen calls issue_queries from its threads; a sample is reported done
    when its image is (a failed request too, counted, so that LoadGen never waits on it)."""

    def __init__(self, engine: Any, request: Request) -> None:
        self.engine, self.request = engine, request
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="dvllm-loadgen-sut", daemon=True)
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self.loop).result()
        self._lock = threading.Lock()
        self.completed = 0
        self.errors: list[str] = []

    async def _start(self) -> None:
        self.engine.start()

    def issue_queries(self, samples: list[Any]) -> None:
        for sample in samples:
            asyncio.run_coroutine_threadsafe(self._run(sample.id, sample.index), self.loop)

    def flush_queries(self) -> None:
        pass

    async def _run(self, query_id: int, index: int) -> None:
        import mlperf_loadgen as lg

        error = None
        try:
            final = None
            async for out in self.engine.generate(self.request.prompts[index], self.request.params(index),
                                                  request_id=f"q{query_id}"):
                final = out
            if final is None or final.error is not None:
                error = final.error if final is not None else "no output"
        except Exception as e:  # noqa: BLE001 - counted and reported; LoadGen must still hear of the sample
            error = f"{type(e).__name__}: {e}"
        with self._lock:
            self.completed += 1
            if error is not None:
                self.errors.append(error)
        lg.QuerySamplesComplete([lg.QuerySampleResponse(query_id, 0, 0)])  # performance mode: no data kept

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.engine.shutdown(5), self.loop).result()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)


def run_scenario(sut: EngineSUT, settings: Settings, out_dir: Path) -> dict[str, Any]:
    """One LoadGen test; its logs in out_dir; the results LoadGen logged, in plain names."""
    import mlperf_loadgen as lg

    out_dir.mkdir(parents=True, exist_ok=True)
    log_output = lg.LogOutputSettings()
    log_output.outdir = str(out_dir)
    log_output.copy_summary_to_stdout = False
    log_settings = lg.LogSettings()
    log_settings.log_output = log_output
    count = len(sut.request.prompts)
    completed_before, errors_before = sut.completed, len(sut.errors)
    handle = lg.ConstructSUT(sut.issue_queries, sut.flush_queries)
    library = lg.ConstructQSL(count, count, lambda _: None, lambda _: None)  # captions are in memory
    try:
        lg.StartTestWithLogSettings(handle, library, settings.test_settings(), log_settings)
    finally:
        lg.DestroyQSL(library)
        lg.DestroySUT(handle)
    logged = read_detail_log(out_dir / "mlperf_log_detail.txt")
    errors = sut.errors[errors_before:]
    return {"scenario": settings.scenario, "valid": logged.get("result_validity") == "VALID" and not errors,
            "validity": logged.get("result_validity"), "invalid_reason": why_invalid(logged),
            "samples": sut.completed - completed_before, "errors": len(errors), "first_error": errors[0] if errors else None,
            **_metrics(settings.scenario, logged), "summary": str(out_dir / "mlperf_log_summary.txt")}


def read_detail_log(path: Path) -> dict[str, Any]:
    """The key -> value of LoadGen's detail log (`:::MLLOG {json}` lines; a key logged twice keeps its last)."""
    values: dict[str, Any] = {}
    for line in path.read_text().splitlines():
        if line.startswith(":::MLLOG "):
            record = json.loads(line[len(":::MLLOG "):])
            values[record["key"]] = record["value"]
    return values


def why_invalid(logged: dict[str, Any]) -> str | None:
    """What LoadGen found short of its settings, in a line (None for a VALID run)."""
    if logged.get("result_validity") == "VALID":
        return None
    reasons = [text for key, text in (("result_min_duration_met", "shorter than --min-duration-s"),
                                      ("result_min_queries_met", "fewer queries than --min-query-count"),
                                      ("result_perf_constraints_met", "the latency bound was missed"))
               if logged.get(key) is False]
    if logged.get("early_stopping_met") is False:
        said = " ".join(str(logged.get("early_stopping_result", "")).replace("*", " ").split())
        reasons.append(f"early stopping: {said}")
    if logged.get("result_invalid_reason"):
        reasons.append(str(logged["result_invalid_reason"]))
    return "; ".join(reasons) or "LoadGen gave no reason"


def _metrics(scenario: str, logged: dict[str, Any]) -> dict[str, Any]:
    seconds = {f"p{p}_latency_s": logged.get(f"result_{p}.00_percentile_latency_ns")
               for p in (50, 90, 99)}
    seconds = {k: (v / 1e9 if v is not None else None) for k, v in seconds.items()}
    if scenario == "Offline":
        metric = {"samples_per_s": logged.get("result_samples_per_second")}
    elif scenario == "Server":
        metric = {"completed_queries_per_s": logged.get("result_completed_samples_per_sec"),
                  "scheduled_queries_per_s": logged.get("result_scheduled_samples_per_sec")}
    else:
        metric = {}
    return {**metric, **seconds, "mean_latency_s": (logged["result_mean_latency_ns"] / 1e9
                                                     if "result_mean_latency_ns" in logged else None)}


def scenario_settings(args: argparse.Namespace) -> list[Settings]:
    names = SCENARIOS if args.scenario == "all" else tuple(n.strip() for n in args.scenario.split(","))
    if len(set(names)) != len(names):
        raise ValueError(f"--scenario names a scenario twice: {args.scenario!r}")
    counts = {"Server": args.server_min_query_count or args.min_query_count}
    return [Settings(name, args.min_duration_s, counts.get(name, args.min_query_count), args.offline_expected_qps,
                     args.server_target_qps, args.server_target_latency_s, args.server_latency_percentile,
                     args.single_stream_expected_latency_s) for name in names]


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Checks every flag, starts the engine once, runs the scenarios in turn."""
    if importlib.util.find_spec("mlperf_loadgen") is None:
        raise ValueError("dvllm bench loadgen needs MLPerf LoadGen: pip install mlcommons-loadgen "
                         "(it comes with dvllm's `.[test]` extra)")
    check_size(args.size, "--size")
    if args.steps < 1 or args.num_samples < 1:
        raise ValueError("--steps and --num-samples must be at least 1")
    settings = scenario_settings(args)
    from dvllm.engine.async_engine import AsyncDiffusionEngine
    from dvllm.config_flags import engine_kwargs

    request = Request(args.size, args.steps, args.guidance, args.sampler, captions(args.num_samples, args.caption_seed))
    engine = AsyncDiffusionEngine(**engine_kwargs(args))
    try:  # a size, step count or sampler the model refuses: said now, not by every query
        engine.processor.process("loadgen-check", request.prompts[0], request.params(0))
    except ValueError:
        asyncio.run(engine.shutdown(0))
        raise
    sut = EngineSUT(engine, request)
    results = []
    try:
        for s in settings:
            results.append(run_scenario(sut, s, Path(args.output_dir) / s.scenario))
    finally:
        sut.close()
    return {"model": args.model, "size": args.size, "steps": args.steps, "guidance": args.guidance,
            "sampler": args.sampler, "samples": args.num_samples, "note": UNOFFICIAL, "scenarios": results}


def format_results(result: dict[str, Any]) -> str:
    lines = [f"LoadGen on {result['model']}: {result['size']}, {result['steps']} steps, guidance {result['guidance']}, "
             f"sampler {result['sampler']} ({result['note']})"]
    for r in result["scenarios"]:
        shown = {k: v for k, v in r.items() if k not in ("scenario", "validity", "summary") and v is not None}
        text = ", ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}" for k, v in shown.items())
        lines.append(f"  {r['scenario']:<12} {r['validity']:<8} {text}")
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    result = run(args)
    print(format_results(result))
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(result, indent=2) + "\n")
    return 0 if all(r["valid"] for r in result["scenarios"]) else 1


if __name__ == "__main__":  # python -m dvllm.benchmarks.loadgen ...
    parser = argparse.ArgumentParser(prog="dvllm bench loadgen", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    add_arguments(parser)
    raise SystemExit(main(parser.parse_args()))
