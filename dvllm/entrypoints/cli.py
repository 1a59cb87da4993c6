"""The `dvllm` command: `dvllm generate` (offline batches), `dvllm serve` (the OpenAI-compatible server)
and `dvllm bench` (benchmarks). Every argument is checked before the model loads, and before torch and
diffusers are imported: `--help`, `--version` or a typo answer in a fraction of a second."""
from __future__ import annotations

import argparse
import difflib
import json
import logging
import os
import re
import ssl
import sys
import threading
import time
from typing import TYPE_CHECKING, Any

import dvllm
from dvllm.child_process import Terminated, terminate_on_sigterm
from dvllm.config import EngineConfig
from dvllm.config_flags import add_engine_args, engine_kwargs
from dvllm.engine.start_checks import check_at_start
from dvllm.entrypoints.generate_jobs import Job, check_lora_names, process, read_jobs
from dvllm.entrypoints.generate_output import MANIFEST, ImageWriter, OutputThread, image_paths
from dvllm.entrypoints.generate_progress import StepProgress, run_requests, stop_on_sigint
from dvllm.entrypoints.server_socket import bind_socket
from dvllm.logging_setup import LOG_LEVELS, STARTUP_LOGGER, set_third_party_verbosity, setup_logging
from dvllm.models.model_names import check_model_name, hub_offline
from dvllm.outputs import RequestOutput
from dvllm.sampler_names import SHORT_NAMES

if TYPE_CHECKING:
    from dvllm.core.request import Request
    from dvllm.engine.engine import DiffusionEngine

EXIT_INTERRUPTED = 130  # 128 + SIGINT, as shells report a Ctrl-C
EXIT_TERMINATED = 143  # 128 + SIGTERM
_startup = logging.getLogger(STARTUP_LOGGER)


def main(argv: list[str] | None = None) -> int:
    # allow_abbrev=False on every parser (as vLLM): a prefix such as --max-batch must not pass for --max-batch-size
    parser = argparse.ArgumentParser(prog="dvllm", description="Serve and run diffusion image models.",
                                     allow_abbrev=False)
    parser.add_argument("--version", action="version", version=dvllm.__version__)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = _leaf(sub, "generate", help="Generate images offline.")
    _add_generate_args(gen)
    serve = _leaf(sub, "serve", help="Serve a model over the OpenAI Images API.")
    _add_serve_args(serve)
    bench = sub.add_parser("bench", help="Benchmark the engine against the pipeline on a trace (run), a server "
                                         "(serve), or under MLPerf LoadGen (loadgen).",
                           allow_abbrev=False)
    argv = sys.argv[1:] if argv is None else argv
    if "bench" in argv:  # its flags come from the benchmark modules, which import torch: only when asked for
        # the libraries quiet before they import (torchao's optional kernels, torch's deprecations), as for serve;
        # DVLLM_BENCH_LOG_LEVEL=debug keeps them talking
        setup_logging(os.environ.get("DVLLM_BENCH_LOG_LEVEL", "warning"))
        _add_bench_args(bench)
    args, unknown = parser.parse_known_args(argv)
    command_parser = args.__dict__.pop("_parser", parser)
    if unknown:  # the command's own usage and the flag meant, not the top-level usage
        command_parser.error(f"unrecognized arguments: {' '.join(unknown)}{_did_you_mean(command_parser, unknown)}")
    run = {"serve": run_serve, "generate": run_generate, "bench": run_bench}[args.command]
    try:
        with terminate_on_sigterm():  # SIGTERM while loading: children stopped, exit 143 (child_process.py)
            return run(args)
    except (ValueError, ConnectionError) as e:
        parser.exit(2, f"dvllm {args.command}: error: {e}\n")
    except KeyboardInterrupt:  # e.g. Ctrl-C while the model loads: one line, no traceback
        print(f"dvllm {args.command}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Terminated:
        print(f"dvllm {args.command}: terminated", file=sys.stderr)
        return EXIT_TERMINATED


def _leaf(sub: argparse._SubParsersAction, name: str, **kwargs: Any) -> argparse.ArgumentParser:
    """A command's parser, which its namespace names (`_parser`) so that an unknown flag is reported with its usage."""
    parser = sub.add_parser(name, allow_abbrev=False, **kwargs)
    parser.set_defaults(_parser=parser)
    return parser


def _did_you_mean(parser: argparse.ArgumentParser, unknown: list[str]) -> str:
    # compared without the dashes, which every flag shares and which would make any two flags look alike
    flags = {flag.lstrip("-"): flag for action in parser._actions for flag in action.option_strings}
    for arg in unknown:
        if arg.startswith("-"):
            close = difflib.get_close_matches(arg.split("=", 1)[0].lstrip("-"), list(flags), n=1, cutoff=0.7)
            if close:
                return f" (did you mean {flags[close[0]]}?)"
    return ""


def _add_generate_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("prompt", nargs="?", help="The prompt (or use --prompts-file).")
    p.add_argument("-o", "--output", help="Output PNG (a video model's: MP4) for a single prompt "
                                          "(default: dvllm-<seed>.png or .mp4).")
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
    p.add_argument("--cache", help="Step cache for these requests: first_block:threshold=0.08, "
                                   "taylorseer:cache_interval=4,max_order=1, mag:mag_ratios=flux, or none "
                                   "(none given: the engine's default_cache).")
    p.add_argument("--lora", action="append", metavar="NAME[=WEIGHT]",
                   help="Apply the LoRA adapter NAME (loaded with --lora-modules NAME=PATH) to every prompt at "
                        "WEIGHT (1.0 when left out); repeat for several. A JSONL line's \"loras\" replaces these.")
    p.add_argument("--image", action="append", metavar="PATH",
                   help="Start image: image-to-image, or inpainting with --mask; repeat for models that take "
                        "several. A JSONL line's \"image\" (a path or a list) replaces it.")
    p.add_argument("--mask", metavar="PATH",
                   help="Inpainting mask of the image's size, as OpenAI's edits take it: pixels with alpha < 128 "
                        "(transparent) are repainted, opaque ones kept; a mask without alpha is grey, white = "
                        "repaint (diffusers'). A JSONL line's \"mask\" replaces it.")
    p.add_argument("--aesthetic-score", type=float,
                   help="For SDXL models trained with one (the refiner): the score its prompt conditions on "
                        "(default: the pipeline's 6.0).")
    p.add_argument("--negative-aesthetic-score", type=float,
                   help="The score the negative rows condition on (default: the pipeline's 2.5).")
    p.add_argument("--strength", type=float, help="How much of the schedule an image request runs, in (0, 1] "
                                                  "(default: the model's, for img2img or for inpainting).")
    p.add_argument("--num-frames", type=int, help="A video model's frames per video; num_frames - 1 a multiple of "
                                                  "the model's (4 for Wan) (default: the model's).")
    p.add_argument("--fps", type=float, help="A video model's frames per second, for its MP4s (default: the model's).")
    p.add_argument("--save-frames", action="store_true",
                   help="A video model: also write each video's frames as PNGs, into <video>-frames/ beside it.")
    p.add_argument("--no-progress", action="store_true", help="No progress bar.")
    p.add_argument("--log-level", default="warning", choices=LOG_LEVELS,
                   help="dvllm's log level; debug also shows the libraries' warnings and loading bars "
                        "(default: warning).")
    add_engine_args(p, skip=("engine_core_process",))  # generate steps its engine in its own process


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
                        help="Seconds, counted from when its body has arrived, after which a request is aborted "
                             "and answered 504 (default: none).")
    server.add_argument("--max-body-mb", type=float, default=1.0, help="Largest request body, in MiB (default: 1).")
    server.add_argument("--body-timeout", type=float, default=30.0,
                        help="Seconds a request's whole body may take to arrive; a slower one is answered 408 and "
                             "its connection closed (default: 30).")
    server.add_argument("--max-pending-bodies", type=int, default=32,
                        help="Requests whose body may be arriving at once; further ones are answered 429 at once, "
                             "unread (default: 32).")
    server.add_argument("--shutdown-grace", type=float, default=30.0,
                        help="On SIGTERM/SIGINT, seconds running requests get to finish before they are aborted; "
                             "further signals meanwhile are ignored (default: 30).")
    server.add_argument("--image-store-size", type=int, default=64,
                        help="Images kept for response_format=url (least recently used out first; 0 turns url "
                             "off; default: 64).")
    server.add_argument("--image-store-mb", type=float, default=256.0,
                        help="Bytes of encoded images the url store keeps, in MiB (default: 256).")
    server.add_argument("--video-store-size", type=int, default=64,
                        help="Video models: jobs /v1/videos keeps, finished or not; finished ones go oldest first, "
                             "and while all are unfinished a new job is answered 429 (default: 64).")
    server.add_argument("--video-store-mb", type=float, default=1024.0,
                        help="Video models: bytes of MP4s the job store keeps, in MiB; finished jobs go oldest "
                             "first (default: 1024).")
    server.add_argument("--public-url",
                        help="Where clients reach this server, e.g. https://images.example.com: image URLs start "
                             "with it (default: the address bound, never the request's Host header).")
    server.add_argument("--allow-client-priority", action="store_true",
                        help="Honour requests' `priority` and, with --group-policy elastic (where it moves a "
                             "request ahead), `deadline` (otherwise a non-zero priority, or such a deadline, is a "
                             "400; a deadline that is only reported is always taken).")
    server.add_argument("--allow-runtime-lora-updating", action="store_true",
                        help="Serve vLLM's POST /v1/load_lora_adapter and /v1/unload_lora_adapter, with which "
                             "any client (holding the API key, when one is set) makes the server read LoRA "
                             "adapters at paths on its disk. Needs --enable-lora or --lora-modules.")
    server.add_argument("--show-lora-paths", action="store_true",
                        help="Show each LoRA adapter's path on the server's disk in /v1/models (as `root`); by "
                             "default only its name and base model.")
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


# `dvllm bench` COMMAND -> its help line. Each command's module in dvllm.benchmarks (_bench_modules) defines its
# flags and runs it (main(args)).
_BENCH_HELP = {
    "serve": "Load-test a server speaking the Images API (dvllm serve or another).",
    "loadgen": "MLPerf LoadGen (Offline, Server, SingleStream) driving the engine.",
    "trace": "Write a production-shaped request trace (JSONL) for `bench serve` and `bench run`.",
    "run": "Replay a trace against dvllm, its request-level policy and the pipeline.",
}


def _bench_modules() -> dict[str, Any]:
    # imported when `bench` is asked for: they import torch and httpx
    from dvllm.benchmarks import harness, loadgen, serving, traces

    return {"serve": serving, "loadgen": loadgen, "trace": traces, "run": harness}


def _add_bench_args(p: argparse.ArgumentParser) -> None:
    # Argument definitions only: the model loads when a benchmark runs.
    sub = p.add_subparsers(dest="bench_command", required=True)
    for name, module in _bench_modules().items():
        leaf = _leaf(sub, name, help=_BENCH_HELP[name], description=module.__doc__,
                     formatter_class=argparse.RawDescriptionHelpFormatter)
        (module.add_cli_args if name == "serve" else module.add_arguments)(leaf)


def run_bench(args: argparse.Namespace) -> int:
    return _bench_modules()[args.bench_command].main(args)


# -- checks before anything loads -----------------------------------------------------------------

def check_engine_args(args: argparse.Namespace) -> EngineConfig:
    """The engine flags, as EngineConfig checks them, and the model name: before the model loads."""
    config = EngineConfig.from_kwargs(**engine_kwargs(args))
    # a typo'd name, a missing path, a Hub id an offline machine lacks: answered now, before torch (model_names.py)
    offline = config.local_files_only or hub_offline()
    check_model_name(config.model, offline, config.revision, config.download_dir)
    if config.attention_backend is not None:  # (diffusers knows the names: imported for this flag only)
        from dvllm.models.attention_backend import check_backend_name

        check_backend_name(config.attention_backend)
    check_at_start(config)
    return config


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
    for flag, value in (("--request-timeout", args.request_timeout), ("--max-body-mb", args.max_body_mb),
                        ("--body-timeout", args.body_timeout)):
        if value is not None and not value > 0:
            raise ValueError(f"{flag} must be > 0, got {value}")
    if args.max_pending_bodies < 1:
        raise ValueError(f"--max-pending-bodies must be >= 1, got {args.max_pending_bodies}")
    if not args.shutdown_grace >= 0:
        raise ValueError(f"--shutdown-grace must be >= 0, got {args.shutdown_grace}")
    if args.image_store_size < 0:
        raise ValueError(f"--image-store-size must be >= 0, got {args.image_store_size}")
    if not args.image_store_mb >= 0:
        raise ValueError(f"--image-store-mb must be >= 0, got {args.image_store_mb}")
    if args.video_store_size < 1:
        raise ValueError(f"--video-store-size must be >= 1, got {args.video_store_size}")
    if not args.video_store_mb > 0:
        raise ValueError(f"--video-store-mb must be > 0, got {args.video_store_mb}")
    if args.public_url is not None and not re.fullmatch(r"https?://[^/\s]+(/\S*)?", args.public_url):
        raise ValueError(f"--public-url must be an http:// or https:// URL, got {args.public_url!r}")
    _check_cors_args(args)
    _check_tls_args(args)
    _check_lora_serve_args(args, check_engine_args(args))


def _check_cors_args(args: argparse.Namespace) -> None:
    if not args.allowed_origins:
        given = [flag for flag, value in (("--allowed-methods", args.allowed_methods),
                                          ("--allowed-headers", args.allowed_headers),
                                          ("--allow-credentials", args.allow_credentials)) if value]
        if given:
            raise ValueError(f"{', '.join(given)} without --allowed-origins would do nothing: give the origins too")
        return
    from dvllm.entrypoints.api_server import check_cors  # the app's own rule, checked before the model loads

    check_cors(args.allowed_origins, args.allow_credentials)
    if args.allowed_methods is not None:
        args.allowed_methods = [method.upper() for method in args.allowed_methods]  # browsers send them so


def _check_lora_serve_args(args: argparse.Namespace, config: EngineConfig) -> None:
    if args.allow_runtime_lora_updating and not config.enable_lora:
        raise ValueError("--allow-runtime-lora-updating without --enable-lora (or --lora-modules) would do nothing: "
                         "give --enable-lora too")
    if args.served_model_name in config.lora_modules:  # requests' `model` would name the base model, not it
        raise ValueError(f"--lora-modules: {args.served_model_name!r} is the --served-model-name; name the adapter "
                         "otherwise")


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
    setup_logging(args.log_level, libraries=False)  # the libraries' own logs: set once the flags are checked
    check_serve_args(args)
    sock = bind_socket(args.host, args.port)  # a taken port fails now, before torch and the model load
    try:
        _startup.info("loading torch and diffusers ...")  # tens of seconds that would pass without a line
        set_third_party_verbosity(verbose=args.log_level == "debug")  # before the model code makes them talk
        from dvllm.entrypoints.api_server import run_server  # fastapi and uvicorn only when serving

        run_server(args, sock)
    finally:
        sock.close()
    return 0


# -- generate: running ----------------------------------------------------------------------------

def run_generate(args: argparse.Namespace) -> int:
    setup_logging(args.log_level, libraries=False)
    jobs = read_jobs(args)
    check_lora_names(args, jobs, check_engine_args(args).lora_modules)
    _startup.info("loading torch and diffusers ...")
    set_third_party_verbosity(verbose=args.log_level == "debug")
    from dvllm.engine.engine import DiffusionEngine

    engine = DiffusionEngine(**engine_kwargs(args))
    try:
        return _generate(engine, jobs, process(jobs, engine), args)
    finally:
        engine.shutdown()  # Ray workers, when there are any


def _generate(engine: DiffusionEngine, jobs: list[Job], requests: list[Request],
              args: argparse.Namespace) -> int:
    batch_mode = args.prompts_file is not None
    info = engine.model_info
    writer = ImageWriter(args.output_dir, manifest=batch_mode, model=engine.loaded_model.name,
                         sampler=info.defaults.sampler or info.schedule.config["_class_name"],
                         frame_pngs=args.save_frames)
    suffix, noun = (".png", "images") if info.video is None else (".mp4", "videos")
    index_of = {request.request_id: i for i, request in enumerate(requests)}
    progress = StepProgress(requests, enabled=not args.no_progress, noun=noun)
    outputs = OutputThread()  # PNG and MP4 encodes off the engine loop
    failed = 0
    cache_steps = [0, 0]  # steps the step cache skipped, of the steps of requests that had one

    def on_finished(out: RequestOutput) -> None:
        nonlocal failed
        index = index_of[out.request_id]
        job = jobs[index]
        if out.error is not None:
            failed += 1
            progress.print(f"error: request {index} ({job.prompt!r}): {out.error}", file=sys.stderr)
            return
        paths = image_paths(index if batch_mode else None, out.seed, len(out.images), job.output, args.output_dir,
                            suffix)

        skipped = out.metrics.cached_steps  # None: no step cache
        cached = "" if skipped is None else f", {skipped} skipped by the step cache"
        if skipped is not None:
            cache_steps[0] += skipped * len(out.images)
            cache_steps[1] += out.num_inference_steps * len(out.images)

        def write() -> None:
            writer.write(job.prompt, requests[index].params, out.seed, out.images, paths, job.inputs, skipped)
            for path in paths:
                progress.print(f"{path}  (seed {out.seed}, {out.num_inference_steps} steps{cached})")
        outputs.submit(write)

    stop = threading.Event()
    start = time.perf_counter()
    try:
        with stop_on_sigint(stop):
            completed = run_requests(engine, requests, on_finished, progress, stop)
    except KeyboardInterrupt:  # a second Ctrl-C: stop now, mid-step
        completed = False
    finally:
        try:
            outputs.close()  # the finished outputs are written, even after a Ctrl-C
        finally:
            progress.close()
    elapsed = time.perf_counter() - start
    if not completed:
        total = sum(job.params.n for job in jobs)
        print(f"interrupted: {writer.written} of {total} {noun} written", file=sys.stderr)
        return EXIT_INTERRUPTED
    written = f"{writer.written} {noun.removesuffix('s') if writer.written == 1 else noun}"  # "1 video", "2 videos"
    cache = f"; the step cache skipped {cache_steps[0]} of {cache_steps[1]} steps" if cache_steps[1] else ""
    print(f"{written} in {elapsed:.2f} s ({writer.written / elapsed:.2f} {noun}/s); {failed} failed{cache}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
