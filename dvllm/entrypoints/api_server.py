"""`dvllm serve`: a FastAPI app speaking the OpenAI Images API in front of an AsyncDiffusionEngine.

Routes: POST /v1/images/generations, GET /v1/images/{id}, GET /v1/models[/{model}], GET /health,
GET /metrics, GET /version. Errors always in OpenAI's shape. With an API key, every /v1 route
needs `Authorization: Bearer <key>` except GET /v1/images/{id}, whose random id is the credential
(so image URLs work in a browser, as OpenAI's signed URLs do); /health, /metrics and /version stay
open for probes and scrapers.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import secrets
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from importlib import resources
from types import FrameType

import uvicorn
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response

import dvllm
from dvllm.engine.async_engine import AsyncDiffusionEngine
from dvllm.entrypoints.image_store import ImageStore
from dvllm.entrypoints.metrics import ServerMetrics
from dvllm.entrypoints.protocol import APIError, ModelCard, ModelList
from dvllm.entrypoints.serving_edits import create_edit
from dvllm.entrypoints.serving_images import ServerContext, create_images

logger = logging.getLogger(__name__)
_HTTP_ERROR_CODES = {400: "invalid_request", 404: "not_found", 405: "method_not_allowed",
                 413: "request_too_large", 415: "unsupported_media_type"}


def build_app(engine: AsyncDiffusionEngine, args: argparse.Namespace) -> FastAPI:
    """The app for one engine. Reads served_model_name, api_key, max_queue_len, request_timeout,
    max_body_mb, image_store_size and shutdown_grace from args (missing ones take defaults)."""
    ctx = ServerContext(
        engine=engine,
        model_name=getattr(args, "served_model_name", None) or engine.model_info.name,
        metrics=ServerMetrics(engine.stats, lambda: ctx.in_flight),  # called on the loop thread
        images=ImageStore(getattr(args, "image_store_size", 64)),
        api_key=getattr(args, "api_key", None) or None,
        max_in_flight=getattr(args, "max_queue_len", None),
        request_timeout=getattr(args, "request_timeout", None),
        max_body_bytes=int(getattr(args, "max_body_mb", 1.0) * (1 << 20)),
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
    _add_error_handlers(app)
    app.include_router(_v1_routes(ctx))
    app.include_router(_open_routes(ctx))
    return app


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


def _v1_routes(ctx: ServerContext) -> APIRouter:
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
        return ModelList(data=[ModelCard(id=ctx.model_name, created=ctx.created)]).model_dump()

    @guarded.get("/v1/models/{model:path}")
    async def get_model(model: str) -> dict:
        if model != ctx.model_name:
            raise APIError(404, f"The model '{model}' does not exist.", param="model", code="model_not_found")
        return ModelCard(id=ctx.model_name, created=ctx.created).model_dump()

    @router.get("/v1/images/{image_id}")
    async def get_image(image_id: str) -> Response:
        if image_id == "generations":  # this path shadows the POST route's; answer as its wrong method
            raise APIError(405, "Method GET is not allowed on /v1/images/generations.", code="method_not_allowed",
                           headers={"Allow": "POST"})
        item = ctx.images.get(image_id)
        if item is None:
            raise APIError(404, f"No image '{image_id}': it never existed or was evicted from the store.",
                           param="image_id", code="not_found")
        return Response(item[0], media_type=item[1])

    router.include_router(guarded)
    return router


def _open_routes(ctx: ServerContext) -> APIRouter:
    router = APIRouter()

    @router.get("/health")
    async def health() -> Response:
        if ctx.draining or not ctx.engine.is_running:
            raise APIError(503, "The server is shutting down or its engine loop is not running.",
                           code="service_unavailable")
        stats = ctx.engine.stats()
        alive, total = stats["num_workers_alive"], stats["num_workers"]
        if alive == 0:
            raise APIError(503, f"No worker is alive (0 of {total}); requests wait for a restart.",
                           code="service_unavailable")
        # Degraded still serves (200): fewer workers, requests moved to the survivors.
        return JSONResponse({"status": "ok" if alive == total else "degraded",
                             "workers": total, "workers_alive": alive})

    @router.get("/metrics")
    async def metrics() -> Response:
        return PlainTextResponse(ctx.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @router.get("/version")
    async def version() -> dict:
        return {"version": dvllm.__version__}

    # The playground: one static page, open like /health; its API calls carry the key when one is set.
    page = (resources.files("dvllm.entrypoints") / "static" / "playground.html").read_text()

    @router.get("/")
    async def playground() -> Response:
        return HTMLResponse(page)

    return router


def _error_response(error: APIError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return _error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = {404: f"No route {request.method} {request.url.path}.",
                   405: f"Method {request.method} is not allowed on {request.url.path}."}.get(exc.status_code,
                                                                                              str(exc.detail))
        return _error_response(APIError(exc.status_code, message, code=_HTTP_ERROR_CODES.get(exc.status_code),
                                        headers=dict(exc.headers or {})))

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        param = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
        return _error_response(APIError(400, f"Invalid value for '{param}': {first.get('msg', 'invalid')}.",
                                        param=param, code="invalid_value"))

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        request_id = f"err-{uuid.uuid4().hex}"
        logger.error("%s: internal error on %s %s", request_id, request.method, request.url.path, exc_info=exc)
        return _error_response(APIError(500, f"The server had an error (request id {request_id}).",
                                        code="internal_error"))


# -- running it ------------------------------------------------------------------------------

def run_server(args: argparse.Namespace) -> None:
    """Loads the model, serves until SIGTERM/SIGINT, drains, returns (so the process exits 0)."""
    from dvllm.entrypoints.cli_args import engine_kwargs

    _log_to_stderr(getattr(args, "log_level", "info"))
    engine = AsyncDiffusionEngine(**engine_kwargs(args))
    app = build_app(engine, args)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=getattr(args, "log_level", "info"),
                            timeout_graceful_shutdown=10, lifespan="on")
    GracefulServer(config, lambda: drain(app.state.ctx, args.shutdown_grace)).run()


def _log_to_stderr(level: str) -> None:
    """uvicorn configures only its own loggers; dvllm's (drain, aborts, faults) need a handler too."""
    root = logging.getLogger("dvllm")
    if not root.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s %(name)s: %(message)s"))
        root.addHandler(handler)
    root.setLevel(level.upper())


class GracefulServer(uvicorn.Server):
    """On the first SIGTERM/SIGINT: drain (new requests get 503, running ones finish within the grace
    period), then let uvicorn close. A second signal stops at once."""

    def __init__(self, config: uvicorn.Config, drain_fn: Callable[[], Awaitable[None]]) -> None:
        super().__init__(config)
        self._drain_fn = drain_fn
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Task | None = None
        self._signalled = False

    async def startup(self, sockets: list | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Not recorded in _captured_signals as uvicorn does: it re-raises those at exit, so the
        # process would die by the signal instead of exiting 0 after a clean drain.
        if self._signalled or self._loop is None:
            self.should_exit = True
            self.force_exit = self._signalled
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

