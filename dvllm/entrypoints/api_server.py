"""`dvllm serve`: a FastAPI app speaking the OpenAI Images API in front of an AsyncDiffusionEngine.

Routes: POST /v1/images/generations, POST /v1/images/edits, GET /v1/images/{id}, GET /v1/models[/{model}]
(the base model and each loaded LoRA adapter), GET /health, GET /metrics, GET /version; for video models
OpenAI's Videos API: POST/GET /v1/videos, GET/DELETE /v1/videos/{id}, GET /v1/videos/{id}/content and
/v1/videos/{id}/events (serving_videos.py); with
--allow-runtime-lora-updating also vLLM's POST /v1/load_lora_adapter and /v1/unload_lora_adapter. Errors
always in OpenAI's shape. With an API key, every /v1 route needs `Authorization: Bearer <key>` except
GET /v1/images/{id}, whose random id is the credential (so image URLs work in a browser, as OpenAI's
signed URLs do); /health, /metrics and /version stay open for probes and scrapers.
"""
from __future__ import annotations

import argparse
import asyncio
import base64
import hashlib
import logging
import re
import secrets
import signal
import socket
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from importlib import resources
from types import FrameType
from typing import Any

import uvicorn
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response

import dvllm
from dvllm.engine.async_engine import AsyncDiffusionEngine
from dvllm.entrypoints.health import health_response
from dvllm.entrypoints.image_store import ImageStore
from dvllm.entrypoints.metrics import ServerMetrics
from dvllm.entrypoints.model_facts import model_facts
from dvllm.entrypoints.protocol import APIError, LoadLoraAdapterRequest, ModelCard, ModelList, UnloadLoraAdapterRequest
from dvllm.entrypoints.request_body import BodyLimits, discard_unread_body, read_json_body
from dvllm.entrypoints.serving_edits import create_edit
from dvllm.entrypoints.serving_images import ServerContext, create_images
from dvllm.entrypoints.serving_videos import video_routes
from dvllm.entrypoints.video_jobs import VideoJobs
from dvllm.lora.files import LoraPathError

logger = logging.getLogger(__name__)
_HTTP_ERROR_CODES = {400: "invalid_request", 404: "not_found", 405: "method_not_allowed",
                 413: "request_too_large", 415: "unsupported_media_type"}


def build_app(engine: AsyncDiffusionEngine, args: argparse.Namespace) -> FastAPI:
    """The app for one engine. Reads served_model_name, api_key, max_queue_len, request_timeout,
    max_body_mb, body_timeout, max_pending_bodies, image_store_size, video_store_size/mb, shutdown_grace,
    allow_runtime_lora_updating and the CORS flags from args (missing ones take defaults)."""
    check_cors(getattr(args, "allowed_origins", None), getattr(args, "allow_credentials", False))
    ctx = ServerContext(
        engine=engine,
        model_name=getattr(args, "served_model_name", None) or engine.loaded_model.name,
        metrics=ServerMetrics(engine.stats, lambda: ctx.in_flight,  # called on the loop thread
                              getattr(engine, "liveness", None),  # (a test's engine may have none)
                              getattr(getattr(engine, "loaded_model", None), "custom_ops", None)),
        images=ImageStore(getattr(args, "image_store_size", 64),
                          int(getattr(args, "image_store_mb", 256.0) * (1 << 20))),
        api_key=getattr(args, "api_key", None) or None,
        public_url=public_url(args),
        allow_client_priority=getattr(args, "allow_client_priority", False),
        # (an engine that is no DiffusionEngine, a test's, has no config: as _served_model_facts)
        deadlines_reorder=getattr(getattr(engine, "config", None), "group_policy", "static") == "elastic",
        max_in_flight=getattr(args, "max_queue_len", None),
        request_timeout=getattr(args, "request_timeout", None),
        body_limits=BodyLimits(max_bytes=int(getattr(args, "max_body_mb", 1.0) * (1 << 20)),
                               timeout=getattr(args, "body_timeout", 30.0),
                               max_receiving=getattr(args, "max_pending_bodies", 32)),
        model_facts=_served_model_facts(engine),
        videos=VideoJobs(getattr(args, "video_store_size", 64),
                         int(getattr(args, "video_store_mb", 1024.0) * (1 << 20))),
    )
    grace = getattr(args, "shutdown_grace", 30.0)
    engine.step_listeners.append(ctx.metrics.on_step)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine.start()
        yield
        await drain(ctx, grace)

    app = FastAPI(title="dvllm", version=dvllm.__version__, lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.ctx = ctx
    origins = getattr(args, "allowed_origins", None)
    if origins:  # CORS only when asked for: without it browsers on other origins get no access
        app.add_middleware(_CORSMiddleware, allow_origins=origins,
                           allow_methods=getattr(args, "allowed_methods", None) or ["*"],
                           allow_headers=getattr(args, "allowed_headers", None) or ["*"],
                           allow_credentials=getattr(args, "allow_credentials", False))
    _add_error_handlers(app)
    app.include_router(_v1_routes(ctx, getattr(args, "allow_runtime_lora_updating", False),
                                  show_lora_paths=getattr(args, "show_lora_paths", False),
                                  detailed_lora_errors=getattr(args, "log_level", "info") == "debug"))
    app.include_router(_open_routes(ctx))
    return app


def public_url(args: argparse.Namespace) -> str:
    """Where clients reach this server, for image URLs: --public-url, else the address it binds (a
    wildcard bind names this host). Never the request's Host header, which any client can set."""
    url = getattr(args, "public_url", None)
    if url:
        return url.rstrip("/")
    host = getattr(args, "host", "127.0.0.1")
    if host in ("", "0.0.0.0", "::"):
        host = socket.gethostname()
    if ":" in host:
        host = f"[{host}]"  # an IPv6 literal
    scheme = "https" if getattr(args, "ssl_certfile", None) else "http"
    return f"{scheme}://{host}:{getattr(args, 'port', 8000)}"


def check_cors(allowed_origins: list[str] | None, allow_credentials: bool) -> None:
    """Refuses '*' with credentials: Starlette then echoes any Origin back with Allow-Credentials, so every
    web page could call the server with its visitors' cookies or auth and read the answers."""
    if allow_credentials and allowed_origins and "*" in allowed_origins:
        raise ValueError("--allowed-origins '*' with --allow-credentials would let any web page send credentialed "
                         "requests and read the answers: list the origins that may")


class _CORSMiddleware(CORSMiddleware):
    """Starlette's CORS, with a refused preflight answered in OpenAI's error shape (Starlette answers it in
    plain text), its CORS headers kept."""

    def preflight_response(self, request_headers: Headers) -> Response:
        response = super().preflight_response(request_headers)
        if response.status_code < 400:
            return response
        refused = bytes(response.body).decode().removeprefix("Disallowed CORS ")  # e.g. "origin, headers"
        headers = {k: v for k, v in response.headers.items() if k not in ("content-length", "content-type")}
        return _error_response(APIError(response.status_code, f"CORS preflight refused: disallowed {refused}.",
                                        code="cors_not_allowed", headers=headers))


async def drain(ctx: ServerContext, grace: float) -> None:
    """Stop taking requests (503), let running ones finish for up to `grace` seconds, abort the rest
    (they are answered 503), then wait briefly for every handler to write its answer."""
    if not ctx.draining:
        ctx.draining = True
        logger.info("shutting down: %d request(s) in flight, grace period %.1f s", ctx.in_flight, grace)
    await ctx.engine.shutdown(grace)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 10.0
    while ctx.in_flight and loop.time() < deadline:
        await asyncio.sleep(0.02)


def _v1_routes(ctx: ServerContext, lora_updates: bool = False, show_lora_paths: bool = False,
               detailed_lora_errors: bool = False) -> APIRouter:
    async def require_api_key(request: Request) -> None:
        if ctx.api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(), ctx.api_key.encode()):
            raise APIError(401, "Incorrect or missing API key: send 'Authorization: Bearer <key>'.",
                           code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})

    router = APIRouter()
    guarded = APIRouter(dependencies=[Depends(require_api_key)])

    @guarded.post("/v1/images/generations")
    async def images_generations(request: Request) -> Response:
        return await create_images(request, ctx)

    @guarded.post("/v1/images/edits")
    async def images_edits(request: Request) -> Response:
        return await create_edit(request, ctx)

    @guarded.get("/v1/models")
    async def list_models() -> dict:
        return ModelList(data=_model_cards(ctx, show_lora_paths)).model_dump(exclude_none=True)

    @guarded.get("/v1/models/{model:path}")
    async def get_model(model: str) -> dict:
        for card in _model_cards(ctx, show_lora_paths):
            if card.id == model:
                return card.model_dump(exclude_none=True)
        raise APIError(404, f"The model '{model}' does not exist.", param="model", code="model_not_found")

    if lora_updates:  # off by default: it lets clients make the server read files at paths they name
        guarded.include_router(_lora_routes(ctx, detailed_lora_errors))
    guarded.include_router(video_routes(ctx))

    @router.get("/v1/images/{image_id}")
    async def get_image(image_id: str) -> Response:
        if image_id in ("generations", "edits"):  # these paths shadow the POST routes: answer as a wrong method
            raise APIError(405, f"Method GET is not allowed on /v1/images/{image_id}.", code="method_not_allowed",
                           headers={"Allow": "POST"})
        item = ctx.images.get(image_id)
        if item is None:
            raise APIError(404, f"No image '{image_id}': it never existed or was evicted from the store.",
                           param="image_id", code="not_found")
        return Response(item[0], media_type=item[1])

    router.include_router(guarded)
    return router


def _served_model_facts(engine: AsyncDiffusionEngine) -> dict[str, Any] | None:
    """What /v1/models tells of the model (None for an engine that is no DiffusionEngine, e.g. a test's)."""
    config = getattr(engine, "config", None)
    if config is None:
        return None
    info = engine.model_info
    facts = model_facts(info, info.pixel_limit(config.max_image_pixels),
                        engine.valid_samplers(), engine.loaded_model, max_num_frames=config.max_num_frames)
    facts = {**facts, "controlnets": sorted(config.controlnets)} if config.controlnets else facts
    facts = {**facts, "control_modes": dict(info.control_modes)} if info.control_modes else facts  # union ones'
    return {**facts, "ip_adapter": True} if config.ip_adapter else facts


def _model_cards(ctx: ServerContext, show_lora_paths: bool) -> list[ModelCard]:
    """The served model, then each loaded LoRA adapter with the base model (vLLM's shape), its own request
    defaults where it has any (lora/adapter_defaults.py), and its path as `root` only where the operator chose to
    show the server's paths (--show-lora-paths)."""
    adapters = [ModelCard(id=lora["name"], created=ctx.created, root=lora["path"] if show_lora_paths else None,
                          parent=ctx.model_name, dvllm=lora.get("defaults") or None)
                for lora in ctx.engine.list_loras()]
    return [ModelCard(id=ctx.model_name, created=ctx.created, dvllm=ctx.model_facts), *adapters]


def _lora_routes(ctx: ServerContext, detailed_errors: bool) -> APIRouter:
    """vLLM's runtime adapter updates. Reading an adapter runs in a worker thread (AsyncDiffusionEngine),
    so running requests keep stepping and streaming meanwhile. A path that names no loadable file is answered
    alike whatever the reason (missing, a folder, unreadable...), so that clients cannot map the server's disk;
    the reason is logged, and answered too on a server run with --log-level debug."""
    router = APIRouter()

    @router.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request) -> Response:
        req = LoadLoraAdapterRequest.parse(await read_json_body(request, ctx.body_limits))
        if req.lora_name == ctx.model_name:  # `model` would name the base model, never the adapter
            raise APIError(400, f"The LoRA name '{req.lora_name}' is the served model's name; choose another.",
                           param="lora_name", code="invalid_value")
        try:
            await ctx.engine.load_lora(req.lora_name, req.lora_path)
        except ValueError as e:
            logger.warning("LoRA adapter %r from %r not loaded: %s", req.lora_name, req.lora_path, e)
            if isinstance(e, LoraPathError) and not detailed_errors:
                e = ValueError(e.public_message)
            raise _lora_error(e, "lora_path") from None
        logger.info("loaded LoRA adapter %r from %r", req.lora_name, req.lora_path)
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' added successfully.")

    @router.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request) -> Response:
        req = UnloadLoraAdapterRequest.parse(await read_json_body(request, ctx.body_limits))
        try:
            await ctx.engine.unload_lora(req.lora_name)
        except ValueError as e:
            raise _lora_error(e, "lora_name") from None
        logger.info("unloaded LoRA adapter %r", req.lora_name)
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' removed successfully.")

    return router


# The engine's load/unload messages that are about the adapter's name (the others are about its path).
_LORA_NAME_ERRORS = ("LoRA name", "a LoRA adapter named", "no LoRA adapter named")


def _lora_error(error: ValueError, param: str) -> APIError:
    message = str(error)
    if message.startswith("this engine serves no LoRA adapters"):
        return APIError(400, "This server serves no LoRA adapters: start it with --enable-lora or --lora-modules.",
                        code="lora_not_enabled")
    if message.startswith(_LORA_NAME_ERRORS):
        param = "lora_name"
    return APIError(400, message, param=param, code="invalid_value")


def _open_routes(ctx: ServerContext) -> APIRouter:
    router = APIRouter()

    @router.get("/health")
    async def health() -> Response:
        return health_response(ctx)

    @router.get("/metrics")
    async def metrics() -> Response:
        return PlainTextResponse(ctx.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @router.get("/version")
    async def version() -> dict:
        return {"version": dvllm.__version__}

    # The playground: one static page, open like /health; its API calls carry the key when one is set.
    page = (resources.files("dvllm.entrypoints") / "static" / "playground.html").read_text()
    # Its inline <script> and <style> are allowed by their hashes, taken once here, so an injected
    # script or style (an XSS) does not run; images are data: URLs or this server's /v1/images/..., videos blob:
    # URLs of what the page fetched from /v1/videos/{id}/content (with its API key)
    def sources(tag: str) -> str:
        bodies = re.findall(rf"<{tag}>(.*?)</{tag}>", page, re.DOTALL)
        return " ".join(f"'sha256-{base64.b64encode(hashlib.sha256(b.encode()).digest()).decode()}'" for b in bodies)
    page_headers = {
        "Content-Security-Policy": (
            f"default-src 'none'; script-src {sources('script')}; style-src {sources('style')}; "
            "img-src 'self' data:; media-src blob:; connect-src 'self'; base-uri 'none'; form-action 'none'; "
            "frame-ancestors 'none'"),
        "X-Content-Type-Options": "nosniff",
        "Referrer-Policy": "no-referrer",
    }

    @router.get("/")
    async def playground() -> Response:
        return HTMLResponse(page, headers=page_headers)

    return router


def _error_response(error: APIError, close: bool = False) -> JSONResponse:
    headers = {**error.headers, **({"Connection": "close"} if close else {})}
    return JSONResponse(error.body(), status_code=error.status, headers=headers)


async def _refusal(request: Request, error: APIError) -> JSONResponse:
    """An error answer. A body the refusal left unread is received and dropped first, within bounds; past
    them the connection closes, so that its sender cannot go on trickling it for ever."""
    ctx = getattr(request.app.state, "ctx", None)
    close = error.headers.get("Connection") == "close"
    if not close and ctx is not None:
        close = not await discard_unread_body(request, ctx.body_limits)
    return _error_response(error, close)


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return await _refusal(request, exc)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = {404: f"No route {request.method} {request.url.path}.",
                   405: f"Method {request.method} is not allowed on {request.url.path}."}.get(exc.status_code,
                                                                                              str(exc.detail))
        return await _refusal(request, APIError(exc.status_code, message,
                                                code=_HTTP_ERROR_CODES.get(exc.status_code),
                                                headers=dict(exc.headers or {})))

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        param = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
        return await _refusal(request, APIError(400, f"Invalid value for '{param}': {first.get('msg', 'invalid')}.",
                                                param=param, code="invalid_value"))

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        request_id = f"err-{uuid.uuid4().hex}"
        logger.error("%s: internal error on %s %s", request_id, request.method, request.url.path, exc_info=exc)
        return await _refusal(request, APIError(500, f"The server had an error (request id {request_id}).",
                                                code="internal_error"))


# -- running it ------------------------------------------------------------------------------

def run_server(args: argparse.Namespace, sock: socket.socket | None = None) -> None:
    """Binds host:port unless given the socket bound (a taken port fails at once, not after the model
    loads), loads the model, serves (https with ssl_keyfile/ssl_certfile) until SIGTERM/SIGINT, drains,
    returns (so the process exits 0)."""
    from dvllm.config_flags import engine_kwargs
    from dvllm.entrypoints.server_socket import bind_socket

    log_level = getattr(args, "log_level", "info")
    _log_to_stderr(log_level)
    sock = sock or bind_socket(args.host, args.port)
    try:
        kwargs = engine_kwargs(args)
        if kwargs.get("engine_core_process") is None:  # the server's default: the core in a process of its own
            kwargs["engine_core_process"] = True
        engine = AsyncDiffusionEngine(**kwargs)
        app = build_app(engine, args)
        url = public_url(argparse.Namespace(**{**vars(args), "port": sock.getsockname()[1]}))  # (port 0: the one bound)
        logger.info("the OpenAI Images API at %s/v1 (model %r), the playground at %s/", url, app.state.ctx.model_name,
                    url)
        config = uvicorn.Config(app, host=args.host, port=args.port, log_level=log_level,
                                timeout_graceful_shutdown=10, lifespan="on",
                                ssl_keyfile=getattr(args, "ssl_keyfile", None),
                                ssl_certfile=getattr(args, "ssl_certfile", None))
        GracefulServer(config, lambda: drain(app.state.ctx, args.shutdown_grace)).run(sockets=[sock])
    finally:
        sock.close()


def _log_to_stderr(level: str) -> None:
    """uvicorn configures only its own loggers; dvllm's (drain, aborts, faults) need a handler too.
    Third-party start-up chatter (advice, loading bars) stays off unless the level is debug."""
    from dvllm.logging_setup import setup_logging

    setup_logging(level)


class GracefulServer(uvicorn.Server):
    """On the first SIGTERM/SIGINT: drain (new requests get 503, running ones finish within the grace
    period), then let uvicorn close. Later signals are logged and ignored: the drain has its own deadline,
    and cutting it short would drop accepted requests."""

    def __init__(self, config: uvicorn.Config, drain_fn: Callable[[], Awaitable[None]]) -> None:
        super().__init__(config)
        self._drain_fn = drain_fn
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Task | None = None
        self._signalled = False

    async def startup(self, sockets: list | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets)
        if sockets is not None and self.started:  # uvicorn leaves the "running on" line to whoever bound them
            self._log_started_message(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Not recorded in _captured_signals as uvicorn does: it re-raises those at exit, so the
        # process would die by the signal instead of exiting 0 after a clean drain.
        if self._loop is None:  # not started yet: nothing to drain, just do not start
            self.should_exit = True
            return
        if self._signalled:
            # A second signal used to force the exit: the process aborted mid-drain and clients got
            # plain-text 500s or dropped connections. The drain already ends within the grace period.
            # (Logged from the loop, not from inside the signal handler.)
            self._loop.call_soon_threadsafe(logger.warning, "signal %s while shutting down: ignored, the drain "
                                            "ends within the shutdown grace period", signal.Signals(sig).name)
            return
        self._signalled = True
        self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        self._drain_task = asyncio.ensure_future(self._drain_then_exit())

    async def _drain_then_exit(self) -> None:
        try:
            await self._drain_fn()
        except Exception:
            logger.exception("draining failed")
        finally:
            self.should_exit = True

