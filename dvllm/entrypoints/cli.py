"""The `dvllm` command: `dvllm generate` (offline batches), `dvllm serve` (the OpenAI-compatible server)
and `dvllm bench` (benchmarks)."""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

from PIL import Image

from dvllm.entrypoints.cli_args import add_engine_args, engine_kwargs
from dvllm.sampling_params import SamplingParams

# JSONL keys accepted in --prompts-file, besides "prompt" and "output"
_JSONL_KEYS = {"num_inference_steps", "steps", "guidance_scale", "guidance", "negative_prompt", "seed", "size",
               "height", "width", "n", "sampler"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dvllm", description="Serve and run diffusion image models.")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="Generate images offline.")
    _add_generate_args(gen)
    serve = sub.add_parser("serve", help="Serve a model over the OpenAI Images API.")
    _add_serve_args(serve)
    _add_bench_args(sub.add_parser("bench", help="Benchmark a server (serve) or the engine offline (throughput)."))
    args = parser.parse_args(argv)
    run = {"serve": run_serve, "generate": run_generate, "bench": run_bench}[args.command]
    try:
        return run(args)
    except (ValueError, ConnectionError) as e:
        parser.exit(2, f"dvllm {args.command}: error: {e}\n")


def _add_generate_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("prompt", nargs="?", help="The prompt (or use --prompts-file).")
    p.add_argument("-o", "--output", help="Output PNG for a single prompt (default: dvllm-<seed>.png).")
    p.add_argument("--prompts-file", help="One prompt per line, or JSONL with per-line parameters.")
    p.add_argument("--output-dir", default=".", help="Where images of --prompts-file go (default: .).")
    p.add_argument("--steps", type=int, help="num_inference_steps (default: the model's).")
    p.add_argument("--guidance", type=float, help="guidance_scale (default: the model's).")
    p.add_argument("--negative-prompt")
    p.add_argument("--seed", type=int, help="Seed (default: random, printed).")
    p.add_argument("--size", help="WxH, e.g. 512x512 (default: the model's).")
    p.add_argument("--sampler", help="ddim, euler, euler_a, dpmpp_2m, dpmpp_2m_karras, lcm or a diffusers class.")
    p.add_argument("-n", type=int, default=1, help="Images per prompt.")
    p.add_argument("--no-progress", action="store_true", help="No progress bar.")
    add_engine_args(p)


def _add_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model_tag", nargs="?", metavar="MODEL",
                   help="Diffusers folder, Hub id or preset (same as --model; default: the built-in tiny-shapes).")
    p.add_argument("--host", default="127.0.0.1", help="Address to bind (default: 127.0.0.1).")
    p.add_argument("--port", type=int, default=8000, help="Port to bind (default: 8000).")
    p.add_argument("--served-model-name", help="Model id in /v1/models and requests' `model` (default: the model's).")
    p.add_argument("--api-key", help="Require 'Authorization: Bearer KEY' on /v1 routes (default: $DVLLM_API_KEY).")
    p.add_argument("--max-queue-len", type=int,
                   help="Requests in flight at the server beyond which new ones get 429 (default: no limit "
                        "beyond the engine's max_num_waiting).")
    p.add_argument("--request-timeout", type=float,
                   help="Seconds after which a request is aborted and answered 504 (default: none).")
    p.add_argument("--max-body-mb", type=float, default=1.0, help="Largest request body, in MiB (default: 1).")
    p.add_argument("--shutdown-grace", type=float, default=30.0,
                   help="On SIGTERM, seconds running requests get to finish before they are aborted (default: 30).")
    p.add_argument("--image-store-size", type=int, default=64,
                   help="Images kept for response_format=url (least recently used out first; 0 turns url off; "
                        "default: 64).")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    add_engine_args(p)


def _add_bench_args(p: argparse.ArgumentParser) -> None:
    # Argument definitions only: torch, httpx and the model load when a benchmark runs.
    from dvllm.benchmarks import serving, throughput

    sub = p.add_subparsers(dest="bench_command", required=True)
    serve = sub.add_parser("serve", help="Load-test a server speaking the Images API (dvllm serve or a baseline).",
                           description=serving.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    serving.add_cli_args(serve)
    offline = sub.add_parser("throughput", help="Offline: serial pipeline vs best static batch vs dvllm, one run.",
                             description=throughput.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    throughput.add_arguments(offline)


def run_bench(args: argparse.Namespace) -> int:
    from dvllm.benchmarks import serving, throughput

    if args.bench_command == "serve":
        return serving.main(args)
    result = throughput.run_and_report(args)  # what throughput.main does after parsing
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


def check_serve_args(args: argparse.Namespace) -> None:
    """Resolves MODEL vs --model and the API key, and checks the server flags."""
    if args.model_tag is not None:
        if args.model is not None:
            raise ValueError(f"give the model once: positional MODEL {args.model_tag!r} and --model {args.model!r}")
        args.model = args.model_tag
    args.api_key = args.api_key or os.environ.get("DVLLM_API_KEY") or None
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in [0, 65535], got {args.port}")
    if args.max_queue_len is not None and args.max_queue_len < 1:
        raise ValueError(f"--max-queue-len must be >= 1, got {args.max_queue_len}")
    for flag, value in (("--request-timeout", args.request_timeout), ("--max-body-mb", args.max_body_mb)):
        if value is not None and not value > 0:
            raise ValueError(f"{flag} must be > 0, got {value}")
    if not args.shutdown_grace >= 0:
        raise ValueError(f"--shutdown-grace must be >= 0, got {args.shutdown_grace}")
    if args.image_store_size < 0:
        raise ValueError(f"--image-store-size must be >= 0, got {args.image_store_size}")


def run_serve(args: argparse.Namespace) -> int:
    check_serve_args(args)
    from dvllm.entrypoints.api_server import run_server  # fastapi and uvicorn only when serving

    run_server(args)
    return 0


def parse_size(size: object) -> tuple[int, int]:
    """'WxH' -> (height, width)."""
    try:
        w, h = (int(v) for v in str(size).lower().split("x"))
    except ValueError:
        raise ValueError(f"size must look like WIDTHxHEIGHT (e.g. 512x512), got {size!r}") from None
    return h, w


# Short names (CLI flags, JSONL) -> SamplingParams fields
_ALIASES = {"steps": "num_inference_steps", "guidance": "guidance_scale"}


def _long_names(fields: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for key, value in fields.items():
        if value is None:
            continue
        if key == "size":
            out["height"], out["width"] = parse_size(value)
        else:
            out[_ALIASES.get(key, key)] = value
    return out


def _params(fields: dict[str, Any], defaults: dict[str, Any]) -> SamplingParams:
    # Both sides are normalized first, so a line's "num_inference_steps" beats the CLI's --steps.
    return SamplingParams(**{**_long_names(defaults), **_long_names(fields)})


def _output_path(value: object, where: str, output_dir: str) -> str:
    if not isinstance(value, str) or not value:
        raise ValueError(f"{where}: 'output' must be a file name, got {value!r}")
    if os.path.splitext(value)[1].lower() not in Image.registered_extensions():
        raise ValueError(f"{where}: 'output' needs an image extension such as .png, got {value!r}")
    return os.path.join(output_dir, value)  # relative names go under --output-dir


def read_jobs(args: argparse.Namespace) -> list[tuple[str, SamplingParams, str | None]]:
    """(prompt, params, output path or None) for every image request on the command line or in the file."""
    defaults = {"steps": args.steps, "guidance": args.guidance, "negative_prompt": args.negative_prompt,
                "seed": args.seed, "size": args.size, "sampler": args.sampler, "n": args.n}
    defaults = {k: v for k, v in defaults.items() if v is not None}
    if args.prompts_file is None:
        if not args.prompt:
            raise ValueError("give a prompt or --prompts-file")
        return [(args.prompt, _params({}, defaults), args.output)]
    if args.prompt:
        raise ValueError("give either a prompt or --prompts-file, not both")
    jobs = []
    with open(args.prompts_file) as f:
        for number, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            if not line.startswith("{"):
                jobs.append((line, _params({}, defaults), None))
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{args.prompts_file}:{number}: not valid JSON: {e}") from None
            unknown = set(record) - _JSONL_KEYS - {"prompt", "output"}
            if unknown or not isinstance(record.get("prompt"), str):
                raise ValueError(f"{args.prompts_file}:{number}: needs a string 'prompt'; "
                                 f"unknown keys {sorted(unknown)}; allowed {sorted(_JSONL_KEYS)}")
            where = f"{args.prompts_file}:{number}"
            try:
                params = _params({k: record[k] for k in _JSONL_KEYS & set(record)}, defaults)
                params.validate()
            except (ValueError, TypeError) as e:
                raise ValueError(f"{where}: {e}") from None
            output = _output_path(record["output"], where, args.output_dir) if "output" in record else None
            jobs.append((record["prompt"], params, output))
    if not jobs:
        raise ValueError(f"{args.prompts_file} holds no prompts")
    return jobs


def _paths(index: int | None, seed: int, count: int, output: str | None, output_dir: str) -> list[str]:
    if output is None:
        stem = f"{index:05d}-{seed}" if index is not None else f"dvllm-{seed}"
        output = os.path.join(output_dir, stem + ".png")
    if count == 1:
        return [output]
    root, ext = os.path.splitext(output)
    return [f"{root}-{k}{ext or '.png'}" for k in range(count)]


def run_generate(args: argparse.Namespace) -> int:
    from dvllm.engine.engine import DiffusionEngine

    jobs = read_jobs(args)
    engine = DiffusionEngine(**engine_kwargs(args))
    try:
        start = time.perf_counter()
        outputs = engine.generate([p for p, _, _ in jobs], [sp for _, sp, _ in jobs], use_tqdm=not args.no_progress)
        elapsed = time.perf_counter() - start
    finally:
        engine.shutdown()  # Ray workers, when there are any
    batch_mode = args.prompts_file is not None
    if batch_mode:
        os.makedirs(args.output_dir, exist_ok=True)
    failed = written = 0
    for index, ((prompt, _, output), out) in enumerate(zip(jobs, outputs)):
        if out.error is not None:
            failed += 1
            print(f"error: request {index} ({prompt!r}): {out.error}", file=sys.stderr)
            continue
        paths = _paths(index if batch_mode else None, out.seed, len(out.images), output, args.output_dir)
        for image, path in zip(out.images, paths):
            if os.path.dirname(path):
                os.makedirs(os.path.dirname(path), exist_ok=True)
            image.save(path)
            written += 1
            print(f"{path}  (seed {out.seed}, {out.num_inference_steps} steps)")
    print(f"{written} images in {elapsed:.2f} s ({written / elapsed:.2f} images/s); {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
