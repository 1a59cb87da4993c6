"""What most people deploy today, behind dvllm's HTTP API, so one client measures all three engines.

    python -m dvllm.benchmarks.baselines.server --mode serial --model tiny-sd --port 8001
    python -m dvllm.benchmarks.baselines.server --mode static --model tiny-sd --port 8002 --max-batch-size 8

`serial`: the diffusers pipeline, one request at a time. `static`: request-level dynamic batching
(what Triton's dynamic batcher and request-batching servers do): compatible requests collected for
--batch-window-ms after the oldest arrived, up to --max-batch-size, in one pipeline call.

Also POST /v1/images/edits (multipart: `image`, or several `image[]`, plus the generation fields) for edit
models, run by the model's diffusers edit pipeline (runner.py says what `static` can batch there: for
QwenImageEditPlusPipeline nothing, so its static baseline is serial). No mask (answered 400).

Same routes, fields, validation and response shape (per-image seed) as `dvllm serve`; the model
is loaded by dvllm's own loader, so weights (presets: dummy weights of --dummy-weight-seed) are
identical. Also GET /health and GET /metrics, with the queue-time and latency histograms under
dvllm's names. Not supported (answered 400): stream, response_format=url.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager

import uvicorn
from fastapi import FastAPI, Request
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from starlette.responses import JSONResponse, PlainTextResponse, Response

from dvllm.benchmarks.baselines.runner import Batcher, Job, PipelineRunner, load_on_worker
from dvllm.entrypoints.form_fields import typed_form
from dvllm.entrypoints.image_store import encode_b64
from dvllm.entrypoints.protocol import (
    APIError,
    ImageData,
    ImageEditRequest,
    ImageGenerationRequest,
    ImagesResponse,
    engine_value_error,
)
from dvllm.entrypoints.request_body import BodyLimits, read_json_body
from dvllm.entrypoints.serving_edits import open_image

logger = logging.getLogger("baseline")
_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 120, 300, 600)


class _Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("dvllm_requests", "Image generation requests by outcome.", ["outcome"],
                                registry=self.registry)
        self.queue_time = Histogram("dvllm_request_queue_time_seconds", "Arrival to the start of its pipeline call.",
                                    buckets=_BUCKETS, registry=self.registry)
        self.latency = Histogram("dvllm_request_latency_seconds", "Arrival to final images (successful requests).",
                                 buckets=_BUCKETS, registry=self.registry)
        self.batch_size = Histogram("baseline_batch_requests", "Requests per pipeline call.",
                                    buckets=(1, 2, 4, 8, 16, 32, 64), registry=self.registry)


def build_app(runner: PipelineRunner, worker: ThreadPoolExecutor, mode: str, max_batch_size: int = 8,
              batch_window_ms: float = 20.0, model_name: str | None = None, max_body_mb: float = 1.0) -> FastAPI:
    """The app of one baseline; `worker` is the single thread the runner was loaded on."""
    if mode not in ("serial", "static"):
        raise ValueError(f"--mode must be 'serial' or 'static', got {mode!r}")
    if mode == "serial":
        max_batch_size, batch_window_ms = 1, 0.0
    metrics = _Metrics()
    batcher = Batcher(runner, worker, max_batch_size=max_batch_size, window_s=batch_window_ms / 1000,
                      on_batch=metrics.batch_size.observe)
    name = model_name or runner.name
    max_body = int(max_body_mb * (1 << 20))
    body_limits = BodyLimits(max_bytes=max_body)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        batcher.start()
        yield
        await batcher.stop()

    app = FastAPI(title=f"dvllm baseline ({mode})", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        metrics.requests.labels("bad_request" if exc.status < 500 else "error").inc()
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.post("/v1/images/generations")
    async def generations(request: Request) -> Response:
        return await serve(ImageGenerationRequest.parse(await read_json_body(request, body_limits)))

    @app.post("/v1/images/edits")
    async def edits(request: Request) -> Response:
        if not runner.info.images.required and not runner.info.images.img2img:
            raise APIError(400, f"{name} does not edit images.", param="image")
        if int(request.headers.get("content-length") or 0) > max_body:
            raise APIError(413, f"The request body is over {max_body} bytes.", code="request_too_large")
        try:
            form = await request.form(max_files=runner.info.images.max_images + 1, max_fields=64)
        except Exception as e:  # noqa: BLE001 - a malformed multipart body, or too many files
            raise APIError(400, f"The request body is not a valid multipart form: {e}.", code="invalid_form") \
                from None
        if form.getlist("mask"):
            raise APIError(400, f"mask is not supported by the {mode} baseline.", param="mask")
        files = [v for k, v in form.multi_items() if k in ("image", "image[]")]
        if not files or len(files) > runner.info.images.max_images or any(isinstance(f, str) for f in files):
            raise APIError(400, f"Send 1 to {runner.info.images.max_images} image files as 'image' or 'image[]'.",
                           param="image")
        req = ImageEditRequest.parse(typed_form({k: v for k, v in form.multi_items() if k not in ("image", "image[]")},
                                                  ImageEditRequest))
        max_pixels = runner.config.pixel_limit(runner.info)
        opened = [open_image(await f.read(), max_pixels) for f in files]
        req.image = opened[0] if len(opened) == 1 else opened
        return await serve(req)

    async def serve(req: ImageGenerationRequest) -> Response:
        if req.stream:
            raise APIError(400, f"stream is not supported by the {mode} baseline.", param="stream")
        if req.response_format == "url":
            raise APIError(400, f"response_format 'url' is not supported by the {mode} baseline; use 'b64_json'.",
                           param="response_format")
        if req.model is not None and req.model != name:
            raise APIError(404, f"The model '{req.model}' does not exist; this server serves '{name}'.",
                           param="model", code="model_not_found")
        try:
            params = runner.resolve(req.sampling_params())
        except ValueError as e:
            raise engine_value_error(e) from None
        job = Job(req.prompt, params, asyncio.get_running_loop().create_future(), batch_tag=runner.batch_tag(params))
        batcher.submit(job)
        try:
            images = await job.future
        except Exception:
            logger.exception("pipeline call failed")
            raise APIError(500, "The server had an error while generating the image.", code="internal_error") \
                from None
        fmt, compression = req.format, req.output_compression
        data = await asyncio.to_thread(
            lambda: [ImageData(b64_json=encode_b64(im, fmt, compression), seed=params.seed, index=i)
                     for i, im in enumerate(images)])
        done = time.monotonic()
        metrics.requests.labels("success").inc()
        metrics.queue_time.observe(job.started - job.arrival)
        metrics.latency.observe(done - job.arrival)
        body = ImagesResponse(created=int(time.time()), data=data, output_format=fmt,
                              size=f"{images[0].width}x{images[0].height}")
        return JSONResponse(body.model_dump(exclude_none=True))

    @app.get("/health")
    async def health() -> Response:
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def prometheus() -> Response:
        return PlainTextResponse(generate_latest(metrics.registry), media_type="text/plain; version=0.0.4")

    return app


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", required=True, choices=["serial", "static"])
    p.add_argument("--model", default="tiny-sd", help="Preset, diffusers folder or Hub id (default: tiny-sd).")
    p.add_argument("--load-format", default="auto", choices=["auto", "dummy"])
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--dummy-weight-seed", type=int, default=0, help="As dvllm's (default: 0).")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8001)
    p.add_argument("--served-model-name", help="Model id requests' `model` must match (default: the model's).")
    p.add_argument("--max-batch-size", type=int, default=8,
                   help="static: requests per pipeline call (default: 8, i.e. 16 denoiser rows with CFG, "
                        "dvllm's default --max-batch-size).")
    p.add_argument("--batch-window-ms", type=float, default=20.0,
                   help="static: how long the oldest request waits for company (default: 20).")
    p.add_argument("--max-body-mb", type=float, default=1.0)
    p.add_argument("--log-level", default="warning", choices=["critical", "error", "warning", "info", "debug"])
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(asctime)s %(name)s: %(message)s")
    runner, worker = load_on_worker(model=args.model, load_format=args.load_format, device=args.device,
                                    dtype=args.dtype, dummy_weight_seed=args.dummy_weight_seed)
    app = build_app(runner, worker, args.mode, args.max_batch_size, args.batch_window_ms, args.served_model_name,
                    args.max_body_mb)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, timeout_graceful_shutdown=10)


if __name__ == "__main__":
    main()
