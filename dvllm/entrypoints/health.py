"""GET /health: whether this server serves, for load balancers and orchestrators (Kubernetes probes).

503 while it shuts down or with its engine core gone, with no worker alive, with the engine core unresponsive (its
step loop has reported nothing for core_heartbeat_timeout_s: a frozen process, a step wedged), or with a stage
process stuck (its call in flight past twice its bound: the kill and restart its watchdog makes at the bound did
not take). 200 otherwise: "ok", or "degraded" with fewer workers alive than started. The body carries the
heartbeats: the engine core's age and bound, and each stage process's call in flight.
"""
from __future__ import annotations

from typing import Any

from starlette.responses import JSONResponse, Response

from dvllm.entrypoints.protocol import APIError
from dvllm.entrypoints.serving_images import ServerContext

# A stage process's call this many times past its bound is stuck: at 1x its watchdog kills it and it starts again
STUCK_FACTOR = 2.0


def health_response(ctx: ServerContext) -> Response:
    engine = ctx.engine
    if ctx.draining or not engine.is_running:
        raise APIError(503, "The server is shutting down or its engine loop is not running.",
                       code="service_unavailable")
    stats = engine.stats()
    alive, total = stats["num_workers_alive"], stats["num_workers"]
    if alive == 0:
        raise APIError(503, f"No worker is alive (0 of {total}); requests wait for a restart.",
                       code="service_unavailable")
    # (an engine that is no AsyncDiffusionEngine, a test's, has no heartbeats to tell)
    liveness: dict[str, Any] = engine.liveness() if hasattr(engine, "liveness") else {}
    core = liveness.get("engine_core")
    if core is not None and not core["responsive"]:
        return _unavailable(f"The engine core (pid {core['pid']}) has answered nothing for "
                            f"{core['heartbeat_age_s']:.1f} s (core_heartbeat_timeout_s {core['limit_s']:g}).",
                            liveness)
    stuck = [p for p in liveness.get("stage_processes", []) if is_stuck(p)]
    if stuck:
        p = stuck[0]
        return _unavailable(f"The {p['stage']} process {p['index']} of worker {p['worker']} (pid {p['pid']}) has "
                            f"been on a call for {p['call_age_s']:.1f} s, past its bound of {p['limit_s']:g} s, "
                            "and was not restarted.", liveness)
    # Degraded still serves (200): fewer workers, requests moved to the survivors.
    return JSONResponse({"status": "ok" if alive == total else "degraded", "workers": total, "workers_alive": alive,
                         **liveness})


def is_stuck(process: dict[str, Any]) -> bool:
    """Whether a stage process's call (StageProcess.health) outlived its bound long past the watchdog's kill."""
    age = process.get("call_age_s")
    return age is not None and age > STUCK_FACTOR * process["limit_s"]


def _unavailable(message: str, liveness: dict[str, Any]) -> JSONResponse:
    error = APIError(503, message, code="service_unavailable")
    return JSONResponse({**error.body(), **liveness}, status_code=503)
