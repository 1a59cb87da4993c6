"""The `dvllm` command: `dvllm generate` (offline batches), `dvllm serve` (the OpenAI-compatible server)
and `dvllm bench` (benchmarks). Every argument is checked before the model loads: a typo costs
a second, not a model load."""
from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import os
import re
import ssl
import sys
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from PIL import Image

import dvllm
from dvllm.config import EngineConfig
from dvllm.entrypoints.cli_args import add_engine_args, engine_kwargs
from dvllm.entrypoints.generate_output import MANIFEST, ImageWriter, image_paths
from dvllm.entrypoints.generate_progress import EngineRequest, StepProgress, run_requests, stop_on_sigint
from dvllm.entrypoints.logging_setup import LOG_LEVELS, setup_logging
from dvllm.samplers.registry import SHORT_NAMES, scheduler_class
from dvllm.outputs import RequestOutput
from dvllm.sampling_params import SEED_LIMIT, SamplingParams

if TYPE_CHECKING:
    from dvllm.engine.engine import DiffusionEngine

# JSONL keys accepted in --prompts-file, besides "prompt" and "output"
_JSONL_KEYS = {"num_inference_steps", "steps", "guidance_scale", "guidance", "negative_prompt", "seed", "size",
               "height", "width", "n", "sampler"}
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as shells report a Ctrl-C


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dvllm", description="Serve and run diffusion image models.")
    parser.add_argument("--version", action="version", version=dvllm.__version__)
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
    except KeyboardInterrupt:  # e.g. Ctrl-C while the model loads: one line, no traceback
        print(f"dvllm {args.command}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


def _add_generate_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("prompt", nargs="?", help="The prompt (or use --prompts-file).")
    p.add_argument("-o", "--output", help="Output PNG for a single prompt (default: dvllm-<seed>.png).")
    p.add_argument("--prompts-file", help="One prompt per line, or JSONL with per-line parameters.")
    p.add_argument("--output-dir", default=".",
                   help=f"Where images of --prompts-file and their {MANIFEST} go (default: .).")
    p.add_argument("--steps", type=int, help="num_inference_steps (default: the model's).")
    p.add_argument("--guidance", type=float, help="guidance_scale (default: the model's).")
    p.add_argument("--negative-prompt")
    p.add_argument("--seed", type=int, help="Seed (default: random, printed).")
    p.add_argument("--size", help="WIDTHxHEIGHT, e.g. 512x512 (default: the model's).")
    p.add_argument("--sampler", help=f"{', '.join(SHORT_NAMES)} or the class name of a diffusers scheduler "
                                     "(default: the model's).")
    p.add_argument("-n", type=int, default=1, help="Images per prompt (default: 1).")
    p.add_argument("--no-progress", action="store_true", help="No progress bar.")
    p.add_argument("--log-level", default="warning", choices=LOG_LEVELS,
                   help="dvllm's log level; debug also shows the libraries' warnings and loading bars "
                        "(default: warning).")
    add_engine_args(p)


def _add_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model_tag", nargs="?", metavar="MODEL",
                   help="Diffusers folder, Hub id or preset (same as --model; default: the built-in tiny-shapes).")
    server = p.add_argument_group("server")
    server.add_argument("--host", default="127.0.0.1", help="Address to bind (default: 127.0.0.1).")
    server.add_argument("--port", type=int, default=8000, help="Port to bind (default: 8000).")
    server.add_argument("--served-model-name",
                        help="Model id in /v1/models and requests' `model` (default: the model's).")
    server.add_argument("--api-key",
                        help="Require 'Authorization: Bearer KEY' on /v1 routes (default: $DVLLM_API_KEY).")
    server.add_argument("--max-queue-len", type=int,
                        help="Requests in flight at the server beyond which new ones get 429 (default: no limit "
                             "beyond the engine's max_num_waiting).")
    server.add_argument("--request-timeout", type=float,
                        help="Seconds after which a request is aborted and answered 504 (default: none).")
    server.add_argument("--max-body-mb", type=float, default=1.0, help="Largest request body, in MiB (default: 1).")
    server.add_argument("--shutdown-grace", type=float, default=30.0,
                        help="On SIGTERM/SIGINT, seconds running requests get to finish before they are aborted; "
                             "further signals meanwhile are ignored (default: 30).")
    server.add_argument("--image-store-size", type=int, default=64,
                        help="Images kept for response_format=url (least recently used out first; 0 turns url "
                             "off; default: 64).")
    server.add_argument("--image-store-mb", type=float, default=256.0,
                        help="Bytes of encoded images the url store keeps, in MiB (default: 256).")
    server.add_argument("--public-url",
                        help="Where clients reach this server, e.g. https://images.example.com: image URLs start "
                             "with it (default: the address bound, never the request's Host header).")
    server.add_argument("--allow-client-priority", action="store_true",
                        help="Honour requests' `priority` (otherwise a non-zero priority is a 400).")
    server.add_argument("--allowed-origins", type=_str_list,
                        help="CORS: origins browsers may call from, as a JSON list or comma-separated "
                             "('*' for any) (default: none, no CORS headers).")
    server.add_argument("--allowed-methods", type=_str_list,
                        help="CORS: allowed methods (default: all, when --allowed-origins is given).")
    server.add_argument("--allowed-headers", type=_str_list,
                        help="CORS: allowed request headers (default: all, when --allowed-origins is given).")
    server.add_argument("--allow-credentials", action="store_true",
                        help="CORS: allow credentials (cookies, Authorization) in cross-origin requests.")
    server.add_argument("--ssl-keyfile", help="TLS private key (PEM); with --ssl-certfile the server speaks https.")
    server.add_argument("--ssl-certfile", help="TLS certificate chain (PEM); with --ssl-keyfile.")
    server.add_argument("--log-level", default="info", choices=LOG_LEVELS,
                        help="Server and dvllm log level; debug also shows the libraries' warnings and loading "
                             "bars (default: info).")
    add_engine_args(p)


def _str_list(value: str) -> list[str]:
    """A JSON list of strings (as vLLM takes these flags) or comma-separated values."""
    text = value.strip()
    if not text.startswith("["):
        return [item.strip() for item in text.split(",") if item.strip()]
    try:
        items = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not a JSON list: {e}") from None
    if not isinstance(items, list) or not all(isinstance(item, str) for item in items):
        raise argparse.ArgumentTypeError(f"must be a JSON list of strings, got {value!r}")
    return items


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


# -- checks before anything loads -----------------------------------------------------------------

def check_engine_args(args: argparse.Namespace) -> None:
    """The engine flags, as EngineConfig checks them, and the model name: before the model loads."""
    EngineConfig.from_kwargs(**engine_kwargs(args))
    check_model_name(args.model)


def check_model_name(model: str | None) -> None:
    """A bare name that is no preset, no built-in model and no existing path can only be a typo (a Hub
    id has a '/'): say so now, with the nearest names, instead of failing inside the loader."""
    if model is None or "/" in model or os.path.exists(os.path.expanduser(model)):
        return
    from dvllm.models.loader import preset_names  # the model code: imported only for a bare name

    known = sorted(set(preset_names()) | set(_builtin_names()))
    if model in known:
        return
    close = difflib.get_close_matches(model, known, n=3, cutoff=0.5)
    hint = f"; did you mean {' or '.join(repr(name) for name in close)}?" if close else ""
    raise ValueError(f"model {model!r} is not a built-in model or preset ({', '.join(known)}), nor a local "
                     f"folder or a Hub id (owner/name){hint}")


def _builtin_names() -> list[str]:
    """The models shipped with weights in the package (dvllm/models/builtin)."""
    from importlib import resources

    from dvllm.models.loader import builtin_folder

    folder = resources.files("dvllm.models") / "builtin"
    return [p.name for p in folder.iterdir() if builtin_folder(p.name) is not None] if folder.is_dir() else []


def check_sampler(name: object) -> None:
    """A short name or a diffusers scheduler class: which one the model gets is decided later, but a
    name that is neither can be refused now."""
    if isinstance(name, str) and (name in SHORT_NAMES or scheduler_class(name) is not None):
        return
    close = difflib.get_close_matches(str(name), list(SHORT_NAMES), n=2, cutoff=0.6)
    hint = f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
    raise ValueError(f"sampler must be one of {sorted(SHORT_NAMES)} or the class name of a diffusers scheduler, "
                     f"got {name!r}{hint}")


def check_serve_args(args: argparse.Namespace) -> None:
    """Resolves MODEL vs --model and the API key, and checks the server and engine flags."""
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
    if not args.image_store_mb >= 0:
        raise ValueError(f"--image-store-mb must be >= 0, got {args.image_store_mb}")
    if args.public_url is not None and not re.fullmatch(r"https?://[^/\s]+(/\S*)?", args.public_url):
        raise ValueError(f"--public-url must be an http:// or https:// URL, got {args.public_url!r}")
    _check_cors_args(args)
    _check_tls_args(args)
    check_engine_args(args)


def _check_cors_args(args: argparse.Namespace) -> None:
    if not args.allowed_origins:
        given = [flag for flag, value in (("--allowed-methods", args.allowed_methods),
                                          ("--allowed-headers", args.allowed_headers),
                                          ("--allow-credentials", args.allow_credentials)) if value]
        if given:
            raise ValueError(f"{', '.join(given)} without --allowed-origins would do nothing: give the origins too")
        return
    if args.allowed_methods is not None:
        args.allowed_methods = [method.upper() for method in args.allowed_methods]  # browsers send them so


def _check_tls_args(args: argparse.Namespace) -> None:
    """Both files or neither, and they must load: found now, not after the model."""
    if (args.ssl_keyfile is None) != (args.ssl_certfile is None):
        raise ValueError("--ssl-keyfile and --ssl-certfile go together: give both (https) or neither (http)")
    if args.ssl_keyfile is None:
        return
    try:
        ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(args.ssl_certfile, args.ssl_keyfile)
    except (OSError, ssl.SSLError) as e:
        raise ValueError(f"cannot load the TLS certificate {args.ssl_certfile!r} with key {args.ssl_keyfile!r}: "
                         f"{e}") from None


def run_serve(args: argparse.Namespace) -> int:
    setup_logging(args.log_level)  # first: importing the model code already makes the libraries talk
    check_serve_args(args)
    from dvllm.entrypoints.api_server import run_server  # fastapi and uvicorn only when serving

    run_server(args)
    return 0


# -- generate: reading the requests ---------------------------------------------------------------

_SIZE = re.compile(r"([0-9]+)x([0-9]+)")  # ASCII digits only: str.isdigit() would take "６４"


def parse_size(size: object) -> tuple[int, int]:
    """'WxH' -> (height, width); exactly digits, a lowercase x, digits."""
    match = _SIZE.fullmatch(size) if isinstance(size, str) else None
    if match is None:
        raise ValueError(f"size must look like WIDTHxHEIGHT (e.g. 512x512), got {size!r}")
    return int(match.group(2)), int(match.group(1))


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
    """Checked as far as possible without the model. Both sides are normalized first, so a line's
    "num_inference_steps" beats the CLI's --steps."""
    params = SamplingParams(**{**_long_names(defaults), **_long_names(fields)})
    params.validate()
    if params.sampler is not None:
        check_sampler(params.sampler)
    return params


def _output_path(value: object, where: str, output_dir: str) -> str:
    if not isinstance(value, str) or not value:
        raise ValueError(f"{where}: 'output' must be a file name, got {value!r}")
    if os.path.splitext(value)[1].lower() not in Image.registered_extensions():
        raise ValueError(f"{where}: 'output' needs an image extension such as .png, got {value!r}")
    return os.path.join(output_dir, value)  # relative names go under --output-dir


@dataclass(frozen=True)
class Job:
    """One request of the command line or of a --prompts-file line."""

    prompt: str
    params: SamplingParams
    output: str | None  # the file asked for, or None for the default name
    where: str          # for messages: "command line" or "file:line"


def check_generate_flags(args: argparse.Namespace) -> None:
    """The request flags, named as the user typed them."""
    if args.steps is not None and args.steps < 1:
        raise ValueError(f"--steps must be >= 1, got {args.steps}")
    if args.n < 1:
        raise ValueError(f"-n must be >= 1, got {args.n}")
    if args.seed is not None and not 0 <= args.seed < SEED_LIMIT:
        raise ValueError(f"--seed must be in [0, 2**63), got {args.seed}")
    if args.guidance is not None and not 0 <= args.guidance < float("inf"):
        raise ValueError(f"--guidance must be a finite number >= 0, got {args.guidance}")
    if args.size is not None:
        try:
            parse_size(args.size)
        except ValueError as e:
            raise ValueError(f"--size: {e}") from None
    if args.sampler is not None:
        try:
            check_sampler(args.sampler)
        except ValueError as e:
            raise ValueError(f"--sampler: {e}") from None


def read_jobs(args: argparse.Namespace) -> list[Job]:
    """Every image request on the command line or in the file, checked as far as the model allows."""
    check_generate_flags(args)
    defaults = {"steps": args.steps, "guidance": args.guidance, "negative_prompt": args.negative_prompt,
                "seed": args.seed, "size": args.size, "sampler": args.sampler, "n": args.n}
    defaults = {k: v for k, v in defaults.items() if v is not None}
    if args.prompts_file is None:
        if not args.prompt:
            raise ValueError("give a prompt or --prompts-file")
        return [Job(args.prompt, _params({}, defaults), args.output, "command line")]
    if args.prompt:
        raise ValueError("give either a prompt or --prompts-file, not both")
    plain = _params({}, defaults)  # one object for every plain line: they all ask the same
    jobs = []
    with open(args.prompts_file) as f:
        for number, line in enumerate(f, 1):
            line = line.strip()
            where = f"{args.prompts_file}:{number}"
            if line:
                jobs.append(Job(line, plain, None, where) if not line.startswith("{")
                            else _jsonl_job(line, where, defaults, args.output_dir))
    if not jobs:
        raise ValueError(f"{args.prompts_file} holds no prompts")
    return jobs


def _jsonl_job(line: str, where: str, defaults: dict[str, Any], output_dir: str) -> Job:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: not valid JSON: {e}") from None
    unknown = set(record) - _JSONL_KEYS - {"prompt", "output"}
    if unknown or not isinstance(record.get("prompt"), str):
        raise ValueError(f"{where}: needs a string 'prompt'; unknown keys {sorted(unknown)}; "
                         f"allowed {sorted(_JSONL_KEYS)}")
    try:
        params = _params({k: record[k] for k in _JSONL_KEYS & set(record)}, defaults)
    except (ValueError, TypeError) as e:
        raise ValueError(f"{where}: {e}") from None
    output = _output_path(record["output"], where, output_dir) if "output" in record else None
    return Job(record["prompt"], params, output, where)


def _resolve(jobs: list[Job], engine: DiffusionEngine) -> list[Job]:
    """Fills each request's defaults from the model and checks its limits, before any is queued: a bad
    line is a usage error, not a failure after an hour of others' images."""
    resolved = []
    for job in jobs:
        try:
            params = job.params.resolve(engine.model_info, engine.config)
        except ValueError as e:
            raise ValueError(str(e) if job.where == "command line" else f"{job.where}: {e}") from None
        resolved.append(dataclasses.replace(job, params=params))
    return resolved


# -- generate: running ----------------------------------------------------------------------------

def run_generate(args: argparse.Namespace) -> int:
    setup_logging(args.log_level)  # first: importing the model code already makes the libraries talk
    jobs = read_jobs(args)
    check_engine_args(args)
    from dvllm.engine.engine import DiffusionEngine

    engine = DiffusionEngine(**engine_kwargs(args))
    try:
        return _generate(engine, _resolve(jobs, engine), args)
    finally:
        engine.shutdown()  # Ray workers, when there are any


def _generate(engine: DiffusionEngine, jobs: list[Job], args: argparse.Namespace) -> int:
    batch_mode = args.prompts_file is not None
    writer = ImageWriter(args.output_dir, manifest=batch_mode, model=engine.model_info.name)
    requests = [EngineRequest(f"cli-{i}", job.prompt, job.params) for i, job in enumerate(jobs)]
    index_of = {request.request_id: i for i, request in enumerate(requests)}
    progress = StepProgress(requests, enabled=not args.no_progress)
    failed = 0

    def on_finished(out: RequestOutput) -> None:
        nonlocal failed
        index = index_of[out.request_id]
        job = jobs[index]
        if out.error is not None:
            failed += 1
            progress.print(f"error: request {index} ({job.prompt!r}): {out.error}", file=sys.stderr)
            return
        paths = image_paths(index if batch_mode else None, out.seed, len(out.images), job.output, args.output_dir)
        writer.write(job.prompt, job.params, out.seed, out.images, paths)
        for path in paths:
            progress.print(f"{path}  (seed {out.seed}, {out.num_inference_steps} steps)")

    stop = threading.Event()
    start = time.perf_counter()
    try:
        with stop_on_sigint(stop):
            completed = run_requests(engine, requests, on_finished, progress, stop)
    except KeyboardInterrupt:  # a second Ctrl-C: stop now, mid-step
        completed = False
    finally:
        progress.close()
    elapsed = time.perf_counter() - start
    if not completed:
        total = sum(job.params.n for job in jobs)
        print(f"interrupted: {writer.written} of {total} images written", file=sys.stderr)
        return EXIT_INTERRUPTED
    print(f"{writer.written} images in {elapsed:.2f} s ({writer.written / elapsed:.2f} images/s); {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
