"""`dvllm bench serve`: an async HTTP load generator for POST /v1/images/generations (and, with
--workload edit, multipart POST /v1/images/edits with generated input images).

Sends a workload (fixed parameters, a seeded random mix, or a JSONL trace) to any server that speaks
dvllm's API (dvllm serve, or the baselines in dvllm/benchmarks/baselines/) at Poisson or gamma arrivals
(--request-rate, --burstiness) or closed loop (--max-concurrency), then reports completed/failed,
images/s, denoising steps/s, latency percentiles, queue time (from the server's /metrics when it
has dvllm_request_queue_time_seconds), SLO attainment and goodput, and writes JSON with every
request's record.

    dvllm bench serve --base-url http://127.0.0.1:8000 --num-requests 64 --request-rate 8
    dvllm bench serve --workload mix --max-concurrency 8 --output-json mix.json
    dvllm bench serve --workload trace --trace requests.jsonl --slo 5
    dvllm bench serve --workload edit --size 64x64 --edit-images 1,2 --mix-steps 2,4 --mix-guidance 1.0,4.0
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import time
from dataclasses import asdict
from typing import Any

from dvllm.benchmarks.report import RequestRecord, format_table, json_safe, summarize
from dvllm.benchmarks.server_usage import server_usage
from dvllm.benchmarks.workloads import (
    RequestSpec,
    arrival_times,
    edit_workload,
    fixed_workload,
    mix_workload,
    split_list,
    trace_workload,
)

ENDPOINT = "/v1/images/generations"


def add_cli_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="The server (default: %(default)s).")
    p.add_argument("--label", help="Engine name in the table, JSON and plots (default: the base URL).")
    p.add_argument("--api-key", help="Sent as 'Authorization: Bearer KEY' (default: $DVLLM_API_KEY).")
    p.add_argument("--num-requests", type=int, help="Timed requests (default: 32; a trace: all its lines).")
    p.add_argument("--request-rate", type=float, default=math.inf,
                   help="Mean arrivals per second; inf sends all at once (default: inf).")
    p.add_argument("--burstiness", type=float, default=1.0,
                   help="Shape of the gamma inter-arrival gaps: 1.0 Poisson, <1 burstier, >1 more even.")
    p.add_argument("--max-concurrency", type=int,
                   help="Requests in flight at most; with rate inf this is a closed loop (default: no cap).")
    p.add_argument("--warmup", type=int, default=2, help="Untimed requests sent first, all at once (default: 2).")
    p.add_argument("--seed", type=int, default=0, help="Seeds arrivals, the mix and image seeds (default: 0).")
    p.add_argument("--workload", choices=["fixed", "mix", "trace", "edit"], default="fixed",
                   help="edit: multipart POST /v1/images/edits with seeded generated input images, output --size, "
                        "steps from --mix-steps, guidance from --mix-guidance (> 1: with a negative prompt).")
    p.add_argument("--size", default="16x16", help="fixed workload (and trace default): WxH (default: 16x16).")
    p.add_argument("--steps", type=int, default=20, help="fixed workload: num_inference_steps (default: 20).")
    p.add_argument("--guidance", type=float, default=7.5, help="fixed workload: guidance_scale (default: 7.5).")
    p.add_argument("--sampler", help="fixed workload: sampler name (default: the model's).")
    p.add_argument("-n", type=int, default=1, help="fixed workload: images per request (default: 1).")
    p.add_argument("--mix-sizes", default="16x16,32x32", help="mix: sizes to draw from (default: %(default)s).")
    p.add_argument("--mix-steps", default="10,20,30", help="mix: step counts (default: %(default)s).")
    p.add_argument("--mix-guidance", default="1.0,7.5",
                   help="mix: guidance scales; <= 1 means no CFG (default: %(default)s).")
    p.add_argument("--mix-samplers", default="none,euler,euler_a,dpmpp_2m",
                   help="mix: samplers, 'none' for the model's (default: %(default)s).")
    p.add_argument("--edit-image-sizes", default="48x64,64x64,80x48",
                   help="edit: input image sizes to draw from, WxH (default: %(default)s).")
    p.add_argument("--edit-images", default="1",
                   help="edit: input images per request to draw from, e.g. 1,2 (several only for models that "
                        "take several, such as Qwen-Image-Edit Plus) (default: %(default)s).")
    p.add_argument("--trace", help="trace: JSONL, one request a line: prompt, size, steps, guidance, sampler, "
                                   "and optionally seed, n, negative_prompt, slo (s), arrival (s from start).")
    p.add_argument("--slo", type=float, help="Latency SLO in seconds for requests without their own.")
    p.add_argument("--timeout", type=float, default=600.0, help="Per-request HTTP timeout, s (default: 600).")
    p.add_argument("--output-json", help="Write the summary and every request's record here.")


def build_workload(args: argparse.Namespace) -> tuple[list[RequestSpec], list[RequestSpec], list[float], str]:
    """(timed specs, warm-up specs, send offsets, one-line description); ValueError for bad arguments."""
    if args.num_requests is not None and args.num_requests < 1:
        raise ValueError(f"--num-requests must be >= 1, got {args.num_requests}")
    if args.warmup < 0:
        raise ValueError(f"--warmup must be >= 0, got {args.warmup}")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError(f"--max-concurrency must be >= 1, got {args.max_concurrency}")
    if args.slo is not None and not args.slo > 0:
        raise ValueError(f"--slo must be > 0 seconds, got {args.slo}")
    num = args.num_requests or 32
    fixed = dict(size=args.size, steps=args.steps, guidance=args.guidance, sampler=args.sampler)
    if args.workload == "trace":
        if not args.trace:
            raise ValueError("--workload trace needs --trace FILE.jsonl")
        specs = trace_workload(args.trace, seed=args.seed, slo=args.slo, **fixed)
        if any(s.frames is not None for s in specs):  # the Videos API is asynchronous: jobs, not answers
            raise ValueError(f"{args.trace}: a video trace (frames): replay it in process with `dvllm bench run`")
        specs = specs[:args.num_requests] if args.num_requests else specs
        warm = [RequestSpec(**{**asdict(s), "prompt": "warmup: " + s.prompt}) for s in specs[:args.warmup]]
        desc = f"trace {args.trace} ({len(specs)} requests)"
    elif args.workload == "edit":
        edit = dict(size=args.size, image_sizes=split_list(args.edit_image_sizes, str, "--edit-image-sizes"),
                    images_per_request=split_list(args.edit_images, int, "--edit-images"),
                    steps=split_list(args.mix_steps, int, "--mix-steps"),
                    guidances=split_list(args.mix_guidance, float, "--mix-guidance"))
        specs = edit_workload(num, seed=args.seed, slo=args.slo, **edit)
        warm = edit_workload(args.warmup, seed=args.seed + 1, prefix="warmup: ", **edit)
        desc = (f"edit output {args.size}, input images {args.edit_images} of {args.edit_image_sizes}, "
                f"steps={args.mix_steps} guidance={args.mix_guidance}")
    elif args.workload == "mix":
        mix = dict(sizes=split_list(args.mix_sizes, str, "--mix-sizes"),
                   steps=split_list(args.mix_steps, int, "--mix-steps"),
                   guidances=split_list(args.mix_guidance, float, "--mix-guidance"),
                   samplers=split_list(args.mix_samplers, str, "--mix-samplers", allow_none=True))
        specs = mix_workload(num, seed=args.seed, slo=args.slo, **mix)
        warm = mix_workload(args.warmup, seed=args.seed + 1, prefix="warmup: ", **mix)
        desc = (f"mix sizes={args.mix_sizes} steps={args.mix_steps} guidance={args.mix_guidance} "
                f"samplers={args.mix_samplers}")
    else:
        if args.n < 1 or args.steps < 1:
            raise ValueError(f"-n and --steps must be >= 1, got {args.n} and {args.steps}")
        specs = fixed_workload(num, n=args.n, seed=args.seed, slo=args.slo, **fixed)
        warm = fixed_workload(args.warmup, n=args.n, seed=args.seed + 1, prefix="warmup: ", **fixed)
        desc = (f"fixed {args.size}, {args.steps} steps, guidance {args.guidance}, "
                f"sampler {args.sampler or 'model default'}, n={args.n}")
    if specs[0].arrival is not None:  # a trace with its own arrival times
        arrivals = [s.arrival for s in specs]
    else:
        arrivals = arrival_times(len(specs), args.request_rate, args.burstiness, seed=args.seed)
    return specs, warm, arrivals, desc


def _httpx() -> Any:
    try:
        import httpx
    except ModuleNotFoundError:  # not a dependency of the engine itself
        raise ValueError("the serving benchmark needs httpx: pip install 'dvllm[bench]' (or pip install httpx)") \
            from None
    return httpx


async def send_one(client: Any, spec: RequestSpec, index: int, arrival: float, start: float) -> RequestRecord:
    httpx = _httpx()
    sent = time.perf_counter()
    status = seeds = latency = error = None
    try:
        if spec.images is None:
            response = await client.post(ENDPOINT, json=spec.body())
        else:
            response = await client.post(spec.endpoint, data=spec.form(), files=spec.files())
        latency = time.perf_counter() - sent
        status = response.status_code
        if status != 200:
            error = f"HTTP {status}: {_error_message(response)}"
        else:
            data = response.json().get("data", [])
            seeds = [item.get("seed") for item in data]
            if len(data) != spec.n:
                error = f"asked for {spec.n} image(s), got {len(data)}"
    except httpx.HTTPError as e:
        error = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
    ok = error is None
    return RequestRecord(index=index, arrival=arrival, sent=sent - start, latency=latency if ok else None, ok=ok,
                         status=status, error=error, steps=spec.steps, n=spec.n, size=spec.size,
                         guidance=spec.guidance, sampler=spec.sampler, slo=spec.slo, seeds=seeds)


def _error_message(response: Any) -> str:
    try:
        return str(response.json()["error"]["message"])[:300]
    except (ValueError, KeyError, TypeError):
        return response.text[:300]


async def _scrape(client: Any) -> str | None:
    try:
        response = await client.get("/metrics")
    except Exception:  # noqa: BLE001 - the server's figures are optional: no /metrics means n/a
        return None
    return response.text if response.status_code == 200 else None


async def run_benchmark(base_url: str, specs: list[RequestSpec], arrivals: list[float], *,
                        warmup: list[RequestSpec] = (), max_concurrency: int | None = None,
                        api_key: str | None = None, timeout: float = 600.0) -> tuple[list[RequestRecord], float,
                                                                                     dict[str, Any]]:
    """Sends the warm-up, then the timed requests at their offsets; (records, duration s, what the server's
    /metrics say of the run: server_usage)."""
    httpx = _httpx()

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=base_url, headers=headers, timeout=timeout, limits=limits) as client:
        try:
            health = await client.get("/health", timeout=10)
        except httpx.HTTPError as e:
            raise ConnectionError(f"no server at {base_url}: {type(e).__name__}: {e}") from None
        if health.status_code != 200:
            raise ConnectionError(f"{base_url}/health answered {health.status_code}: {health.text[:200]}")
        if warmup:
            now = time.perf_counter()
            warm = await asyncio.gather(*(send_one(client, s, i, 0.0, now) for i, s in enumerate(warmup)))
            for r in warm:
                if not r.ok:
                    print(f"warning: warm-up request failed: {r.error}")
        for spec in specs:  # the input images' PNGs made (and cached) before the clock starts
            spec.files()
        before = await _scrape(client)
        gate = asyncio.Semaphore(max_concurrency) if max_concurrency else None

        async def timed(spec: RequestSpec, index: int, arrival: float) -> RequestRecord:
            if gate is None:
                return await send_one(client, spec, index, arrival, start)
            async with gate:
                return await send_one(client, spec, index, arrival, start)

        start = time.perf_counter()
        tasks = []
        for index, (spec, arrival) in enumerate(zip(specs, arrivals)):
            delay = start + arrival - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(timed(spec, index, arrival)))
        records = list(await asyncio.gather(*tasks))
        duration = time.perf_counter() - start
        after = await _scrape(client)
    return records, duration, server_usage(before, after, duration)


def main(args: argparse.Namespace) -> int:
    specs, warm, arrivals, workload = build_workload(args)
    api_key = args.api_key or os.environ.get("DVLLM_API_KEY") or None
    label = args.label or args.base_url
    load = ("all at once" if math.isinf(args.request_rate) and specs[0].arrival is None else
            "trace arrivals" if specs[0].arrival is not None else
            f"{args.request_rate:g} req/s, burstiness {args.burstiness:g}")
    load += f", max concurrency {args.max_concurrency or 'none'}, {args.warmup} warm-up"
    records, duration, usage = asyncio.run(run_benchmark(
        args.base_url, specs, arrivals, warmup=warm, max_concurrency=args.max_concurrency, api_key=api_key,
        timeout=args.timeout))
    summary = summarize(records, duration, usage["queue_time_mean_s"], open_loop=args.max_concurrency is None,
                        stages=usage["stages"])
    print(format_table(label, workload, load, summary))
    if args.output_json:
        folder = os.path.dirname(args.output_json)
        if folder:
            os.makedirs(folder, exist_ok=True)
        result = {"label": label, "base_url": args.base_url, "workload": workload, "load": load,
                  "request_rate": args.request_rate, "max_concurrency": args.max_concurrency,
                  "date": time.strftime("%Y-%m-%d %H:%M:%S"), "args": vars(args), "summary": summary,
                  "requests": [asdict(r) for r in records]}
        with open(args.output_json, "w") as f:
            json.dump(json_safe(result), f, indent=1)
    return 0


def cli(argv: list[str] | None = None) -> int:
    """Entry point of benchmarks/benchmark_serving.py (`dvllm bench serve` reaches main through cli.py)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_cli_args(parser)
    args = parser.parse_args(argv)
    try:
        return main(args)
    except (ValueError, ConnectionError, OSError) as e:
        parser.exit(2, f"benchmark_serving: error: {e}\n")
