"""OpenAI's Videos API on a video model (Wan): jobs that answer at once and run in the background.

POST /v1/videos checks the request completely (the engine's input processor, in a thread) and answers the queued
job, or a 4xx as the image routes would; GET /v1/videos/{id} polls it (progress: the steps done, in percent, 99
until its MP4 is ready; step, num_steps and the engine's eta_seconds beside it), GET /v1/videos/{id}/events
streams it as server-sent events (`video.queued`, `video.in_progress` at each step, then `video.completed` or
`video.failed`; each carries the job; a job deleted meanwhile ends the stream with `video.deleted`), GET
/v1/videos/{id}/content downloads its MP4 once completed, DELETE /v1/videos/{id} cancels an unfinished job (its
engine request is aborted, its rows and blocks freed at the next step; the job stays, failed with code
"cancelled") or drops a finished one, GET /v1/videos lists the jobs.
The MP4 is encoded in a worker thread, off the event loop and the engine's step loop.
"""
from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any, Literal

from fastapi import APIRouter, Query
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from dvllm.entrypoints.byte_ranges import ranged_response
from dvllm.entrypoints.protocol import APIError, engine_value_error
from dvllm.entrypoints.request_body import RETRY_AFTER_SECONDS
from dvllm.entrypoints.serving_images import (
    EventStreamResponse,
    ServerContext,
    Slot,
    check_client_order,
    check_in_flight,
    engine_call,
    log_unknown_fields,
    outcome_of,
    requested_loras,
    timeout_error,
)
from dvllm.entrypoints.video_jobs import VideoJob, new_video_id
from dvllm.entrypoints.video_protocol import REFERENCE, VideoGenerationRequest, read_video_request
from dvllm.video.mp4 import DEFAULT_CRF, encode_mp4

if TYPE_CHECKING:
    from dvllm.core.request import Request as EngineRequest
    from dvllm.models.model_info import Video
    from dvllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


def video_routes(ctx: ServerContext) -> APIRouter:
    """The /v1/videos routes (the caller guards them with the API key)."""
    router = APIRouter()

    @router.post("/v1/videos")
    async def create(request: Request) -> Response:
        try:
            job = await _admit(request, ctx)
        except APIError as e:  # every refusal counts, as the image routes count theirs
            ctx.metrics.request_done(outcome_of(e.status))
            raise
        return JSONResponse(job.to_json(), headers={"X-Request-Id": job.id})

    @router.get("/v1/videos")
    async def list_videos(after: str | None = None, limit: int = Query(20, ge=1, le=100),
                          order: Literal["asc", "desc"] = "desc") -> dict:
        try:
            jobs, has_more = ctx.videos.page(after, limit, newest_first=order == "desc")
        except KeyError:
            raise APIError(400, f"Invalid value for 'after': no video '{after}' (it never existed or was evicted).",
                           param="after", code="invalid_value") from None
        data = [job.to_json() for job in jobs]
        return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
                "last_id": data[-1]["id"] if data else None, "has_more": has_more}

    @router.get("/v1/videos/{video_id}")
    async def retrieve(video_id: str) -> dict:
        return _job(ctx, video_id).to_json()

    @router.get("/v1/videos/{video_id}/content")
    async def content(video_id: str, request: Request, variant: str = "video") -> Response:
        job = _job(ctx, video_id)
        if variant != "video":
            raise APIError(400, f"Invalid value for 'variant': this server makes only the 'video' variant (the MP4), "
                                f"got {variant[:40]!r}.", param="variant", code="unsupported_value")
        if job.status == "failed":
            raise APIError(409, f"The video {video_id} failed: {job.error['message']}", code="video_failed")
        if job.status != "completed":
            raise APIError(409, f"The video {video_id} is {job.status} ({job.progress}%); its content is ready once "
                                "its status is 'completed'.", code="video_not_ready")
        return ranged_response(job.mp4, request.headers.get("range"), "video/mp4",
                               {"Content-Disposition": f'inline; filename="{job.id}.mp4"'})

    @router.get("/v1/videos/{video_id}/events")
    async def events(video_id: str) -> Response:
        job = _job(ctx, video_id)

        async def nothing_to_close() -> None:
            pass
        return EventStreamResponse(_job_events(ctx, job), nothing_to_close, headers={"X-Request-Id": job.id})

    @router.delete("/v1/videos/{video_id}")
    async def delete(video_id: str) -> dict:
        job = _job(ctx, video_id)
        if not job.finished:  # cancelled: the job stays, failed with code "cancelled", until deleted again
            if job.task is not None and not job.task.done():
                job.task.cancel()  # ends its engine stream, which aborts the engine request
                await asyncio.gather(job.task, return_exceptions=True)
            job.cancel()
            if job.cancelled:  # (else it finished meanwhile: dropped as a finished job is)
                return {"id": job.id, "object": "video.deleted", "deleted": False, "cancelled": True,
                        "video": job.to_json()}
        ctx.videos.remove(job.id)
        return {"id": job.id, "object": "video.deleted", "deleted": True}

    return router


def model_video(engine: Any) -> Video | None:
    """The served model's video facts; None for an image model (or a test's stub engine)."""
    return getattr(getattr(engine, "model_info", None), "video", None)


def _job(ctx: ServerContext, video_id: str) -> VideoJob:
    job = ctx.videos.get(video_id)
    if job is None:
        raise APIError(404, f"No video '{video_id[:80]}': it never existed, was deleted or was evicted from the "
                            "store.", param="video_id", code="not_found")
    return job


async def _admit(request: Request, ctx: ServerContext) -> VideoJob:
    """Checks the request completely, then stores its job and starts it."""
    if ctx.draining or not ctx.engine.is_running:
        raise APIError(503, "The server is shutting down or its engine is not running.", code="service_unavailable")
    video = model_video(ctx.engine)
    if video is None:
        raise APIError(400, f"The model '{ctx.model_name}' makes images, not videos: use POST "
                            "/v1/images/generations.", code="unsupported_value")
    req = await read_video_request(request, ctx.body_limits, ctx.engine.model_info.pixel_limit(ctx.engine.config.max_image_pixels))
    loop = asyncio.get_running_loop()
    deadline = None if ctx.request_timeout is None else loop.time() + ctx.request_timeout
    job_id = new_video_id()
    if req.model_extra:
        log_unknown_fields(list(req.model_extra), ctx, job_id)
    loras = requested_loras(req, ctx)
    check_client_order(req, ctx)
    params = req.sampling_params(video.fps, video.frame_multiple)
    params.loras = loras
    try:  # checked before the answer, so that a bad request is a 400 and no job; the engine takes it as processed
        processed = await asyncio.to_thread(ctx.engine.processor.process, job_id, req.prompt, params)
    except ValueError as e:
        raise _request_error(e, req, params, video) from None
    await check_in_flight(ctx)  # from here to the slot taken below nothing awaits: no other request slips in
    resolved = processed.params
    job = VideoJob(id=job_id, model=req.model or ctx.model_name, prompt=req.prompt, width=resolved.width,
                   height=resolved.height, num_frames=resolved.num_frames, fps=resolved.fps, seed=req.seed)
    if not ctx.videos.add(job):
        raise APIError(429, f"All {ctx.videos.capacity} video jobs the server keeps are unfinished "
                            "(--video-store-size); retry once one finishes, or delete one.", type="rate_limit_error",
                       code="rate_limit_exceeded", headers={"Retry-After": RETRY_AFTER_SECONDS})
    slot = Slot(ctx)  # held until the job ends: drains and --max-queue-len count it
    crf = DEFAULT_CRF if req.crf is None else req.crf
    job.task = asyncio.create_task(_run(ctx, job, processed, slot, deadline, crf), name=job_id)
    return job


def _request_error(error: ValueError, req: VideoGenerationRequest, params: SamplingParams, video: Video) -> APIError:
    """The engine's refusal, naming the field the client sent: input_reference for the image, seconds for
    the frames that seconds became."""
    refusal = engine_value_error(error)
    if refusal.param == "image":
        return APIError(400, f"Invalid value for '{REFERENCE}': {refusal.message}", param=REFERENCE,
                        code="invalid_value")
    if refusal.param == "num_frames" and req.seconds is not None:
        fps = req.fps or video.fps
        return APIError(400, f"Invalid value for 'seconds': {req.seconds:g} s at {fps:g} fps is {params.num_frames} "
                             f"frames, but {refusal.message}", param="seconds", code="invalid_value")
    return refusal


async def _run(ctx: ServerContext, job: VideoJob, processed: EngineRequest, slot: Slot, deadline: float | None,
               crf: int) -> None:
    """The job's engine request, then its MP4; whatever ends it (an error, a timeout, a shutdown) fails the job
    saying why. A DELETE cancels it: the engine stream closes, which aborts the engine request."""
    outcome, final = "error", None
    agen = ctx.engine.generate(job.prompt, processed.params, job.id, processed=processed)
    try:
        try:
            async with asyncio.timeout_at(deadline):
                while True:
                    out = await engine_call(anext(agen))
                    job.advance(out.num_steps_done, out.num_inference_steps, out.seed, out.eta_s, out.decode_tiled)
                    if out.finished:
                        break
        except TimeoutError:
            raise timeout_error() from None
        if out.error is not None:
            if ctx.draining:
                raise APIError(503, "The server shut down before the video finished.", code="service_unavailable")
            logger.error("%s: generation failed: %s", job.id, out.error)
            raise APIError(500, f"The server had an error while generating the video (id {job.id}).",
                           code="internal_error")
        mp4 = await asyncio.to_thread(encode_mp4, out.images[0], job.fps, crf)
        ctx.videos.complete(job, mp4)
        outcome, final = ("success", out) if job.status == "completed" else ("error", None)
    except APIError as e:
        outcome = outcome_of(e.status)
        job.fail(e.code or "error", e.message, e.param, e.type)
    except asyncio.CancelledError:
        outcome = "disconnected"
        logger.info("%s: cancelled (deleted); its request aborted", job.id)
        raise
    except Exception:
        logger.exception("%s: internal error", job.id)
        job.fail("internal_error", f"The server had an error while processing the video (id {job.id}).")
    finally:
        slot.release()
        await agen.aclose()  # aborts the engine request unless it finished
        ctx.metrics.request_done(outcome, final)


async def _job_events(ctx: ServerContext, job: VideoJob) -> AsyncIterator[bytes]:
    """The job now, then at each change, until it ends or is deleted."""
    sent = None
    while True:
        changed = job.changed
        if ctx.videos.get(job.id) is not job:
            yield _sse("video.deleted", {"id": job.id, "object": "video.deleted", "deleted": True})
            return
        state = (job.status, job.progress, job.step)
        if state != sent:
            sent = state
            yield _sse(f"video.{job.status}", job.to_json())
        if job.finished:
            return
        await changed.wait()


def _sse(event: str, data: dict[str, Any]) -> bytes:
    return f"event: {event}\ndata: {json.dumps({'type': event, **data})}\n\n".encode()
