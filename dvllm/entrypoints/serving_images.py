"""POST /v1/images/generations: one engine request per HTTP request, plain JSON or server-sent events.

Every accepted request ends in exactly one answer: its images, or an OpenAI-shaped error. A client
that leaves, a timeout or a shutdown aborts the engine request, which frees its state.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from dvllm.engine.async_engine import (
    AsyncDiffusionEngine,
    EngineDeadError,
    EngineShuttingDownError,
    EngineUnresponsiveError,
)
from dvllm.entrypoints.control_uploads import open_controls
from dvllm.entrypoints.image_prompt_upload import open_image_prompt
from dvllm.entrypoints.image_store import ImageStore, encode_b64, encode_image
from dvllm.entrypoints.metrics import ServerMetrics
from dvllm.entrypoints.protocol import (
    APIError,
    CompletedEvent,
    ImageData,
    ImageGenerationRequest,
    ImagesResponse,
    PartialImageEvent,
    engine_value_error,
)
from dvllm.entrypoints.request_body import RETRY_AFTER_SECONDS, BodyLimits, read_json_body
from dvllm.entrypoints.video_jobs import VideoJobs
from dvllm.errors import NoWorkerError, QueueFullError
from dvllm.outputs import RequestOutput

logger = logging.getLogger(__name__)
_STATUS_OUTCOME = {429: "rejected", 499: "disconnected", 503: "unavailable", 504: "timeout"}


@dataclass
class ServerContext:
    """Everything one app's routes share: no module-level mutable state."""

    engine: AsyncDiffusionEngine
    model_name: str
    metrics: ServerMetrics
    images: ImageStore
    api_key: str | None = None
    public_url: str = "http://127.0.0.1:8000"  # image URLs start with it (never with a client's Host header)
    allow_client_priority: bool = False
    # Whether a deadline moves a request ahead (an elastic group runs late requests first); elsewhere it is reported
    deadlines_reorder: bool = False
    max_in_flight: int | None = None
    request_timeout: float | None = None
    body_limits: BodyLimits = field(default_factory=BodyLimits)
    created: int = field(default_factory=lambda: int(time.time()))
    draining: bool = False
    in_flight: int = 0
    logged_fields: set[str] = field(default_factory=set)  # unknown field names already logged (bounded)
    model_facts: dict[str, Any] | None = None  # what /v1/models tells of the served model (model_facts.py)
    videos: VideoJobs = field(default_factory=lambda: VideoJobs(64, 1 << 30))  # /v1/videos' jobs (serving_videos.py)


class Slot:
    """One request's place against --max-queue-len. Given back once: as soon as its client is known
    to be gone (so the next request is not refused for a request nobody waits for), or when it ends."""

    def __init__(self, ctx: ServerContext) -> None:
        self.ctx, self.held = ctx, True
        ctx.in_flight += 1

    def release(self) -> None:
        if self.held:
            self.held = False
            self.ctx.in_flight -= 1


class ClientGone(Exception):
    """The client closed its connection before the answer was ready."""


def outcome_of(status: int) -> str:
    if status < 400:
        return "success"
    return _STATUS_OUTCOME.get(status, "bad_request" if status < 500 else "error")


async def create_images(request: Request, ctx: ServerContext) -> Response:
    """POST /v1/images/generations: a JSON body."""
    async def parse() -> ImageGenerationRequest:
        return ImageGenerationRequest.parse(await read_json_body(request, ctx.body_limits))

    return await serve_request(request, ctx, parse)


async def serve_request(request: Request, ctx: ServerContext,
                        parse: Callable[[], Awaitable[ImageGenerationRequest]]) -> Response:
    """One images request, generations or edits, whatever its body: parse it, then run it."""
    try:
        return await _serve(request, ctx, parse)
    except APIError as e:  # every refusal counts, whichever check made it
        ctx.metrics.request_done(outcome_of(e.status))
        raise


async def _serve(request: Request, ctx: ServerContext,
                 parse: Callable[[], Awaitable[ImageGenerationRequest]]) -> Response:
    request_id = f"img-{uuid.uuid4().hex}"
    if ctx.draining or not ctx.engine.is_running:
        raise APIError(503, "The server is shutting down or its engine is not running.", code="service_unavailable")
    if getattr(getattr(ctx.engine, "model_info", None), "video", None) is not None:
        raise APIError(400, f"The model '{ctx.model_name}' makes videos, not images: use POST /v1/videos.",
                       code="unsupported_value")
    req = await parse()
    # The clock starts once the body is in: a slow upload is --body-timeout's (408), not a 504 after it.
    loop = asyncio.get_running_loop()
    deadline = None if ctx.request_timeout is None else loop.time() + ctx.request_timeout
    if req.model_extra:
        log_unknown_fields(list(req.model_extra), ctx, request_id)
    loras = requested_loras(req, ctx)
    if req.stream and req.image_count > 1:
        raise APIError(400, "n must be 1 when stream is true (a stream carries one image); send n requests.",
                       param="n", code="invalid_value")
    if req.response_format == "url" and ctx.images.capacity == 0:
        raise APIError(400, "response_format 'url' is off on this server (--image-store-size 0); use 'b64_json'.",
                       param="response_format", code="invalid_value")
    check_client_order(req, ctx)
    params = req.sampling_params()
    params.loras = loras
    if req.controls is not None:
        info = ctx.engine.model_info
        params.controls = open_controls(req.controls, info.pixel_limit(ctx.engine.config.max_image_pixels))
    if req.ip_adapter_image is not None:
        info = ctx.engine.model_info
        params.ip_adapter_image = open_image_prompt(req.ip_adapter_image,
                                                    info.pixel_limit(ctx.engine.config.max_image_pixels))
    await check_in_flight(ctx)

    slot = Slot(ctx)
    handed_off = False
    agen = ctx.engine.generate(req.prompt, params, request_id)
    try:
        if req.stream:
            # Headers go out with the first step's output, so a refusal (bad input, full queue) can
            # still be a plain HTTP error rather than an error event.
            first = await _guard(engine_call(anext(agen)), request, deadline, slot)
            stream = _ImageEventStream(request_id, req, ctx, agen, first, deadline, slot)
            handed_off = True  # the stream's close() owns the cleanup from here
            return EventStreamResponse(stream.events(), stream.close, headers={"X-Request-Id": request_id},
                                       on_disconnect=slot.release)
        final = await _guard(engine_call(_last(agen)), request, deadline, slot)
        _raise_if_failed(final, request_id, ctx)
        data = await asyncio.to_thread(_encode_all, final, req, ctx)
        body = ImagesResponse(created=int(time.time()), data=data, output_format=req.format,
                              size=f"{final.images[0].width}x{final.images[0].height}",
                              cached_steps=final.metrics.cached_steps)
        ctx.metrics.request_done("success", final)
        return JSONResponse(body.model_dump(exclude_none=True), headers={"X-Request-Id": request_id})
    except ClientGone:
        logger.info("%s: client disconnected; request aborted", request_id)
        ctx.metrics.request_done("disconnected")
        return Response(status_code=499)  # nobody is listening
    except APIError:
        raise
    except Exception:
        logger.exception("%s: internal error", request_id)
        raise APIError(500, f"The server had an error while processing the request (request id {request_id}).",
                       code="internal_error") from None
    finally:
        if not handed_off:
            slot.release()
            await agen.aclose()  # the engine stream aborts its request if it did not finish (one abort)


async def check_in_flight(ctx: ServerContext) -> None:
    """429 when --max-queue-len requests are in flight."""
    if ctx.max_in_flight is not None and ctx.in_flight >= ctx.max_in_flight:
        await asyncio.sleep(0)  # one turn of the event loop: disconnects already received free their slots
    if ctx.max_in_flight is not None and ctx.in_flight >= ctx.max_in_flight:
        raise APIError(429, f"{ctx.in_flight} requests are in flight (--max-queue-len {ctx.max_in_flight}); "
                            "retry later.", type="rate_limit_error", code="rate_limit_exceeded",
                       headers={"Retry-After": RETRY_AFTER_SECONDS})


def check_client_order(req: Any, ctx: ServerContext) -> None:
    """A client's priority, and its deadline where deadlines move requests ahead, only where the server allows."""
    if req.priority and not ctx.allow_client_priority:
        raise APIError(400, "priority is set by the server on this deployment; start it with "
                            "--allow-client-priority to honour clients' priorities.", param="priority",
                       code="invalid_value")
    if req.deadline is not None and ctx.deadlines_reorder and not ctx.allow_client_priority:
        raise APIError(400, "deadline moves a request ahead on this deployment (--group-policy elastic), on its "
                            "terms only; start the server with --allow-client-priority to honour clients' "
                            "deadlines.", param="deadline", code="invalid_value")


def requested_loras(req: ImageGenerationRequest, ctx: ServerContext) -> dict[str, Any] | None:
    """The request's adapters. As in vLLM, `model` may name a loaded LoRA adapter: the request then uses it at
    weight 1.0, unless `loras` gives it a weight. Any other name but the served model's is a 404."""
    if req.model is None or req.model == ctx.model_name:
        return req.loras
    adapters = [lora["name"] for lora in ctx.engine.list_loras()]
    if req.model not in adapters:
        also = f" and the LoRA adapters {adapters}" if adapters else ""
        raise APIError(404, f"The model '{req.model}' does not exist; this server serves '{ctx.model_name}'{also}.",
                       param="model", code="model_not_found")
    return {req.model: 1.0, **(req.loras or {})}


async def engine_call(awaitable: Awaitable[Any]) -> Any:
    """The engine's exceptions, as HTTP errors."""
    try:
        return await awaitable
    except ValueError as e:
        raise engine_value_error(e) from None
    except QueueFullError as e:
        raise APIError(429, str(e), type="rate_limit_error", code="rate_limit_exceeded",
                       headers={"Retry-After": RETRY_AFTER_SECONDS}) from None
    except EngineShuttingDownError:
        raise APIError(503, "The server is shutting down.", code="service_unavailable") from None
    except EngineUnresponsiveError as e:  # (GET /health says so too)
        raise APIError(503, f"The engine is not responding: {e}.", code="service_unavailable") from None
    except EngineDeadError:
        raise APIError(503, "The engine loop is not running.", code="service_unavailable") from None
    except NoWorkerError as e:
        raise APIError(503, str(e), code="service_unavailable") from None


async def _last(agen: AsyncIterator[RequestOutput]) -> RequestOutput:
    async for out in agen:
        if out.finished:
            return out
    raise RuntimeError("the engine stream ended without a final output")


async def _guard(coro: Coroutine[Any, Any, Any], request: Request, deadline: float | None, slot: Slot) -> Any:
    """Awaits coro unless the client leaves (ClientGone) or the deadline passes (504) first; then coro is
    cancelled, which ends the engine stream and so aborts the request."""
    task = asyncio.ensure_future(coro)
    gone = asyncio.ensure_future(wait_disconnect(request.receive, slot.release))
    timeout = None if deadline is None else max(0.0, deadline - asyncio.get_running_loop().time())
    try:
        done, _ = await asyncio.wait({task, gone}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in (task, gone):
            t.cancel()
        await asyncio.gather(task, gone, return_exceptions=True)
    if task in done:
        return task.result()
    if gone in done:
        raise ClientGone()
    raise timeout_error()


async def wait_disconnect(receive: Receive, on_disconnect: Callable[[], None] | None = None) -> None:
    """Returns when the client disconnects (the body is read already: ASGI receive only waits for that),
    calling on_disconnect first, in the same turn of the event loop."""
    while (await receive())["type"] != "http.disconnect":
        pass
    if on_disconnect is not None:
        on_disconnect()


_MAX_LOGGED_FIELDS = 1024  # distinct unknown field names remembered, so each is logged once
_FIELDS_PER_LINE = 5


def log_unknown_fields(names: list[str], ctx: ServerContext, request_id: str) -> None:
    """Logs unknown field names the server has not logged before: a few per line, each cut short, so a
    body of 50k made-up fields costs one short line, not a 500 KB one."""
    fresh = [name for name in names if name not in ctx.logged_fields][:_FIELDS_PER_LINE]
    if not fresh:
        return
    if len(ctx.logged_fields) + len(fresh) <= _MAX_LOGGED_FIELDS:
        ctx.logged_fields.update(fresh)
    more = len(names) - len(fresh)
    logger.warning("%s: ignoring unknown field(s) %s%s", request_id, ", ".join(ascii(n[:64]) for n in fresh),
                   f" (and {more} more)" if more else "")


def timeout_error() -> APIError:
    return APIError(504, "The request took longer than the server's --request-timeout and was aborted.",
                    type="timeout_error", code="timeout")


def _raise_if_failed(final: RequestOutput, request_id: str, ctx: ServerContext) -> None:
    if final.error is None:
        return
    if ctx.draining:  # the engine aborted it when the shutdown grace period ran out
        raise APIError(503, "The server shut down before the request finished.", code="service_unavailable")
    logger.error("%s: generation failed: %s", request_id, final.error)
    raise APIError(500, f"The server had an error while generating the image (request id {request_id}).",
                   code="internal_error")


def _encode_all(final: RequestOutput, req: ImageGenerationRequest, ctx: ServerContext) -> list[ImageData]:
    """Runs in a worker thread: image encoding would otherwise stall the event loop."""
    fmt, compression, data = req.format, req.output_compression, []
    for index, image in enumerate(final.images):
        if req.response_format == "url":
            image_id = ctx.images.put(encode_image(image, fmt, compression), fmt)
            data.append(ImageData(url=f"{ctx.public_url}/v1/images/{image_id}", seed=final.seed, index=index))
        else:
            data.append(ImageData(b64_json=encode_b64(image, fmt, compression), seed=final.seed, index=index))
    return data


def _sse(event: Any) -> bytes:
    return f"event: {event.type}\ndata: {event.model_dump_json(exclude_none=True)}\n\n".encode()


def _sse_error(error: APIError) -> bytes:
    return f"event: error\ndata: {json.dumps({'type': 'error', **error.body()})}\n\n".encode()


class _ImageEventStream:
    """The events of one streamed request: partial images as the engine decodes them, then the image."""

    def __init__(self, request_id: str, req: ImageGenerationRequest, ctx: ServerContext,
                 agen: AsyncIterator[RequestOutput], first: RequestOutput, deadline: float | None, slot: Slot) -> None:
        self.request_id, self.req, self.ctx, self.agen, self.slot = request_id, req, ctx, agen, slot
        self.first, self.deadline = first, deadline
        self.outcome = "disconnected"  # until the stream says otherwise
        self.final: RequestOutput | None = None

    async def events(self) -> AsyncIterator[bytes]:
        try:
            async for frame in self._frames():
                yield frame
        except APIError as e:
            self.outcome = outcome_of(e.status)
            yield _sse_error(e)
        except Exception:
            logger.exception("%s: internal error while streaming", self.request_id)
            self.outcome = "error"
            yield _sse_error(APIError(500, "The server had an error while processing the request "
                                           f"(request id {self.request_id}).", code="internal_error"))

    async def _frames(self) -> AsyncIterator[bytes]:
        fmt, compression = self.req.format, self.req.output_compression
        out, index = self.first, 0
        while True:
            for preview in out.previews[:1]:  # n is 1 when streaming
                b64 = await asyncio.to_thread(encode_b64, preview, fmt, compression)
                yield _sse(PartialImageEvent(type=f"{self.req.event_prefix}.partial_image", b64_json=b64,
                                         created_at=int(time.time()), output_format=fmt,
                                         size=f"{preview.width}x{preview.height}", partial_image_index=index,
                                         step=out.num_steps_done, num_steps=out.num_inference_steps,
                                         eta_seconds=out.eta_s))
                index += 1
            if out.finished:
                break
            try:
                async with asyncio.timeout_at(self.deadline):
                    out = await engine_call(anext(self.agen))
            except TimeoutError:
                raise timeout_error() from None
        _raise_if_failed(out, self.request_id, self.ctx)
        for image in out.images:
            b64 = await asyncio.to_thread(encode_b64, image, fmt, compression)
            yield _sse(CompletedEvent(type=f"{self.req.event_prefix}.completed", b64_json=b64,
                                      created_at=int(time.time()), output_format=fmt,
                                      size=f"{image.width}x{image.height}", seed=out.seed,
                                      cached_steps=out.metrics.cached_steps))
        self.outcome, self.final = "success", out

    async def close(self) -> None:
        try:
            await self.agen.aclose()  # aborts the engine request unless it finished
        finally:
            self.slot.release()
            self.ctx.metrics.request_done(self.outcome, self.final)
            if self.outcome == "disconnected":
                logger.info("%s: client disconnected; request aborted", self.request_id)


class EventStreamResponse(StreamingResponse):
    """Server-sent events that stop (and clean up) as soon as the client disconnects, even while
    waiting for the engine, and whose cleanup runs however the response ends."""

    def __init__(self, events: AsyncIterator[bytes], on_close: Callable[[], Awaitable[None]],
                 headers: dict[str, str], on_disconnect: Callable[[], None] | None = None) -> None:
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", **headers})
        self._on_close, self._on_disconnect = on_close, on_disconnect

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        streamer = asyncio.ensure_future(self._send_all(send))
        gone = asyncio.ensure_future(wait_disconnect(receive, self._on_disconnect))
        try:
            await asyncio.wait({streamer, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in (streamer, gone):
                t.cancel()
            await asyncio.gather(streamer, gone, return_exceptions=True)
            await self._on_close()

    async def _send_all(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        try:
            async for frame in self.body_iterator:
                await send({"type": "http.response.body", "body": frame, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except OSError:  # the client went away mid-write
            pass
