"""Request bodies as every route reads them: bounded in bytes, in the time they take to arrive, and in how many
may be arriving at once; JSON only as application/json."""
from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any

from starlette.requests import ClientDisconnect, Request

from dvllm.entrypoints.protocol import APIError

RETRY_AFTER_SECONDS = "1"
BODY_STARTED = "dvllm.body_started"  # set in a request's scope once read_body has begun receiving its body


@dataclass
class BodyLimits:
    """How one app's request bodies may arrive (read_body), and how many are arriving now."""

    max_bytes: int = 1 << 20
    timeout: float = 30.0  # s to receive a whole body: a slow sender would hold its connection and task forever
    max_receiving: int = 32  # bodies arriving at once; more are refused at once, unread
    receiving: int = 0


async def read_json_body(request: Request, limits: BodyLimits) -> dict[str, Any]:
    """The body as a JSON object; 415 unless the Content-Type is application/json, 400 for anything not a
    JSON object (and read_body's refusals)."""
    content_type = request.headers.get("content-type")
    # No Content-Type is refused too: a web page can send a body without one, and without a CORS
    # preflight (fetch in no-cors mode with a Blob), to a server on the visitor's own machine.
    if content_type is None or content_type.split(";")[0].strip().lower() != "application/json":
        got = "none" if content_type is None else repr(content_type)
        raise APIError(415, f"Content-Type must be application/json, got {got}.", code="unsupported_media_type")
    raw = await read_body(request, limits)
    if not raw.strip():
        raise APIError(400, "The request body is empty; send a JSON object.", code="invalid_json")
    try:
        body = json.loads(raw, parse_constant=_no_constants)
    except (ValueError, RecursionError) as e:
        raise APIError(400, f"The request body is not valid JSON: {e}.", code="invalid_json") from None
    if not isinstance(body, dict):
        raise APIError(400, f"The request body must be a JSON object, got a JSON {type(body).__name__}.",
                       code="invalid_json")
    return body


async def read_body(request: Request, limits: BodyLimits) -> bytes:
    """The raw body; 413 past max_bytes, by Content-Length and by what actually arrives (so chunked
    bodies are bounded too); 408 unless all of it arrives within limits.timeout; 429, unread, while
    limits.max_receiving other bodies are arriving."""
    max_bytes = limits.max_bytes
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise APIError(413, f"The request body is {declared} bytes; the limit is {max_bytes}.",
                       code="request_too_large")
    # A flood of unread bodies is refused with the connection closed: otherwise each could go on trickling.
    if limits.receiving >= limits.max_receiving:
        raise APIError(429, f"{limits.receiving} request bodies are still arriving (--max-pending-bodies "
                            f"{limits.max_receiving}); retry later.", type="rate_limit_error",
                       code="rate_limit_exceeded", headers={"Retry-After": RETRY_AFTER_SECONDS, "Connection": "close"})
    request.scope[BODY_STARTED] = True
    limits.receiving += 1
    chunks, size = [], 0
    loop, stream = asyncio.get_running_loop(), request.stream()
    deadline = loop.time() + limits.timeout
    try:
        while True:
            try:  # (asyncio.timeout would read better, but Python 3.10 lacks it)
                chunk = await asyncio.wait_for(anext(stream), max(deadline - loop.time(), 0.0))
            except StopAsyncIteration:
                break
            except asyncio.TimeoutError:
                raise APIError(408, f"The request body did not arrive within {limits.timeout:g} s (--body-timeout).",
                               code="request_timeout", headers={"Connection": "close"}) from None
            size += len(chunk)
            if size > max_bytes:
                raise APIError(413, f"The request body is over the limit of {max_bytes} bytes.",
                               code="request_too_large")
            chunks.append(chunk)
    except ClientDisconnect:  # not a server error: nobody reads the answer, it only counts as disconnected
        raise APIError(499, "The client closed the connection while sending the request body.",
                       code="client_disconnected") from None
    finally:
        limits.receiving -= 1
    return b"".join(chunks)


async def discard_unread_body(request: Request, limits: BodyLimits) -> bool:
    """For a request refused before its body was read (401, 404, 413 by Content-Length, 415): receives and
    drops the body, so that the refusal can be answered on a connection that stays open (closing it with
    bytes unread would reset it, and the client could lose the answer). True if that worked; False when the
    connection must close: a body over twice max_bytes, slower than limits.timeout (a sender trickling it
    for ever), or one too many arriving at once."""
    headers = request.headers
    declared = headers.get("content-length", "")
    if request.scope.get(BODY_STARTED) or (declared in ("", "0") and "transfer-encoding" not in headers):
        return True  # read_body owns it (uvicorn drops the rest of a body refused midway), or there is none
    cap = 2 * limits.max_bytes
    if (declared.isdigit() and int(declared) > cap) or limits.receiving >= limits.max_receiving:
        return False
    limits.receiving += 1
    try:
        await asyncio.wait_for(_discard(request, cap), limits.timeout)
        return True
    except (asyncio.TimeoutError, ClientDisconnect, _TooLarge):
        return False
    finally:
        limits.receiving -= 1


class _TooLarge(Exception):
    pass


async def _discard(request: Request, cap: int) -> None:
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > cap:
            raise _TooLarge


def _no_constants(name: str) -> None:
    raise ValueError(f"{name} is not valid JSON")
