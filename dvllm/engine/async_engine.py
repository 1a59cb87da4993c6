"""AsyncDiffusionEngine: one async stream per request over an engine core that steps elsewhere.

The core (a DiffusionEngine driven by a CoreLoop) runs either on a thread of this process or, with
engine_core_process (dvllm serve's default), in a process of its own, so that this process's HTTP,
JSON, base64 and PIL never hold its GIL. Either way requests are checked here, off the event loop
(the input processor, LoRA files), reach the core as commands applied between steps, and come back
as reports that the event loop gets through call_soon_threadsafe.
"""
from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import os
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from dvllm.config import EngineConfig
from dvllm.core.request import Request
from dvllm.engine.core_loop import CoreLoop
from dvllm.engine.engine import DiffusionEngine, StepStats
from dvllm.engine.input_processor import InputProcessor
from dvllm.engine.start_checks import check_at_start
from dvllm.lora.registry import registry_for, require_registry
from dvllm.outputs import RequestOutput
from dvllm.runtime.liveness import Heartbeat
from dvllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine loop stopped; no request can finish."""


class EngineShuttingDownError(RuntimeError):
    """The engine no longer accepts requests."""


class EngineUnresponsiveError(EngineDeadError):
    """The engine core has answered nothing for longer than core_heartbeat_timeout_s (frozen, or wedged in a
    step): new requests are refused until it answers again."""


class AsyncDiffusionEngine:
    def __init__(self, model: str | None = None, **engine_args: Any) -> None:
        self.step_listeners: list[Callable[[StepStats, list[RequestOutput]], None]] = []  # run off the event loop
        self._streams: dict[str, asyncio.Queue] = {}  # touched only on the event loop
        self._adds: dict[str, asyncio.Future] = {}    # requests sent to the core, not yet accepted
        self._ids = itertools.count()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._started = threading.Event()
        self._accepting = True
        self._stats: dict = {}
        self.dead: BaseException | None = None
        config = EngineConfig.from_kwargs(model=model, **engine_args)  # bad arguments fail before anything starts
        check_at_start(config)
        self.heartbeat = Heartbeat(lambda: self._send("ping"), config.core_heartbeat_timeout_s, "the engine core",
                                   "core_heartbeat_timeout_s",
                                   ": /health answers 503 and new requests are refused until it does",
                                   thread_name="dvllm-core-heartbeat")
        self.core_process = None
        if config.engine_core_process:
            self._start_process(config, {**engine_args, "model": model, "engine_core_process": False})
        else:
            self._start_thread(model, engine_args)

    def _start_thread(self, model: str | None, engine_args: dict[str, Any]) -> None:
        # The model is loaded on the loop thread that will run it: torch's CPU thread pool belongs to
        # the thread that first used it, and running on another thread was measured 2x slower.
        loaded = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(model, engine_args, loaded), name="dvllm-engine-loop",
                                        daemon=True)
        self._thread.start()
        loaded.wait()
        if self.dead is not None:
            raise self.dead
        engine = self.engine
        self.model_info, self.loaded_model, self.config = engine.model_info, engine.loaded_model, engine.config
        self.processor, self.loras = engine.processor, engine.loras

    def _start_process(self, config: EngineConfig, engine_args: dict[str, Any]) -> None:
        from dvllm.engine.core_process import CoreProcess

        # The adapters are read here, where requests are checked: requests carry their weights to the core.
        lora_modules, engine_args["lora_modules"] = config.lora_modules, None
        if lora_modules:
            engine_args["enable_lora"] = True
        dvllm_logger = logging.getLogger("dvllm")
        log_level = logging.getLevelName(dvllm_logger.getEffectiveLevel()).lower() if dvllm_logger.handlers else None
        self.core_process = CoreProcess(engine_args, self._on_report, self._on_core_exit, log_level)
        info = self.core_process.info
        self.config = dataclasses.replace(info.config, engine_core_process=True, lora_modules=lora_modules)
        self.model_info, self.loaded_model = info.model_info, info.loaded_model
        self.loras = registry_for(self.config, self.loaded_model.name)
        try:
            for name, path in lora_modules.items():
                self.loras.load(name, path)
            self.processor = InputProcessor(self.config, self.model_info, info.block_numel, info.pool_blocks,
                                            self.loras, model_key=info.model_key, valid_samplers=info.valid_samplers,
                                            decode_budget=info.decode_budget)
        except BaseException:
            self.core_process.close()
            raise

    # -- lifecycle ---------------------------------------------------------------
    def start(self) -> None:
        """Lets the core serve; call from the event loop that will consume the streams."""
        if not self._started.is_set():
            self._loop = asyncio.get_running_loop()
            self._started.set()
            self.heartbeat.start()

    @property
    def is_running(self) -> bool:
        if not self._started.is_set() or self.dead is not None:
            return False
        return self.core_process.is_alive() if self.core_process is not None else self._thread.is_alive()

    async def shutdown(self, grace_seconds: float = 30.0) -> None:
        """Stops accepting; lets running requests finish for up to grace_seconds; aborts the rest."""
        self._accepting = False
        self.heartbeat.stop()
        deadline = time.monotonic() + grace_seconds
        while self._streams and self.is_running and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for request_id in list(self._streams):
            self._send("abort", request_id, "server shutting down")
        while self._streams and self.is_running and time.monotonic() < deadline + 5:
            await asyncio.sleep(0.02)
        if self.core_process is not None:
            await asyncio.to_thread(self.core_process.close)
        else:
            self._core.stop()
            self._started.set()  # a loop never started must still see the stop
            await asyncio.to_thread(self._thread.join, 10)
        self._fail_all(EngineShuttingDownError("the engine shut down before this request finished"))

    # -- requests ------------------------------------------------------------------
    async def generate(self, prompt: str, params: SamplingParams | None = None, request_id: str | None = None,
                       processed: Request | None = None) -> AsyncIterator[RequestOutput]:
        """Progress outputs (step k of n, previews when asked), then the final output.

        Bad input raises ValueError and a full queue QueueFullError before anything is
        yielded. Leaving the iteration early (a client gone, a timeout) aborts the request.
        `processed`: the request as `self.processor.process` returned it to a caller that checked it before
        answering its client (the video API), so that it is not processed twice; its id and prompt are these.
        """
        if processed is not None and (processed.request_id, processed.prompt) != (request_id, prompt):
            raise ValueError(f"processed is request {processed.request_id!r}, not {request_id!r} with this prompt")
        if not self._accepting:
            raise EngineShuttingDownError("the engine is shutting down")
        if not self.is_running:
            raise EngineDeadError(f"the engine loop is not running: {self.dead!r}")
        if not self.heartbeat.responsive:  # it would only queue behind a loop that does not come round
            raise EngineUnresponsiveError(f"the engine core has answered nothing for {self.heartbeat.age:.0f} s "
                                          f"(core_heartbeat_timeout_s={self.heartbeat.limit_s:g})")
        request_id = request_id or f"async-{next(self._ids)}"
        if request_id in self._streams:
            raise ValueError(f"request_id {request_id!r} is already in use")
        stream: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = stream  # reserved now: the id is taken while the request is processed
        finished = False
        try:
            # Checked completely here, off the event loop and off the step loop: a bad request is
            # answered at once whatever the engine is running, and an upload decodes in this thread.
            request = processed or await asyncio.to_thread(self.processor.process, request_id, prompt, params)
            accepted = self._adds[request_id] = self._loop.create_future()
            self._send("add", request)
            await accepted  # raises what add_processed raised
            while True:
                item = await stream.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self._streams.pop(request_id, None)
            self._adds.pop(request_id, None)
            if not finished:  # gone early (or never accepted: aborting an unknown id does nothing)
                self._send("abort", request_id, None)

    async def abort(self, request_id: str) -> None:
        self._send("abort", request_id, None)

    # -- LoRA adapters ---------------------------------------------------------------
    # The registry is thread-safe and reads adapters in the caller's thread: a worker thread here, so
    # the event loop keeps serving and the core keeps stepping while one is read.
    async def load_lora(self, name: str, path: str) -> None:
        """Reads and registers an adapter (seconds for a large one); ValueError if it cannot be served."""
        await asyncio.to_thread(require_registry(self.loras).load, name, path)

    async def unload_lora(self, name: str) -> None:
        """Forgets an adapter; requests already accepted with it finish with it. ValueError if unknown."""
        await asyncio.to_thread(require_registry(self.loras).unload, name)

    def valid_samplers(self) -> list[str]:
        """The samplers this model runs (probed at start-up; read-only since)."""
        return self.processor.valid_samplers()

    def list_loras(self) -> list[dict]:
        """The loaded adapters ({"name", "path", "file", "digest"}); quick, safe on the event loop."""
        return [] if self.loras is None else self.loras.list()

    def stats(self) -> dict:
        """The engine's counters as of its latest step (a snapshot the core sent), with one entry per
        worker under "workers"."""
        return dict(self._stats)

    def liveness(self) -> dict[str, Any]:
        """What /health reports: the engine core's heartbeat (seconds since its loop last reported, its bound) and
        each stage process's (its call in flight's age and bound, as of its worker's latest step)."""
        responsive = self.heartbeat.responsive  # (first: an age read after it is as old or older)
        core = {"pid": self.core_process.pid if self.core_process is not None else os.getpid(),
                "heartbeat_age_s": round(self.heartbeat.age, 3), "limit_s": self.heartbeat.limit_s,
                "responsive": responsive, "stalls": self.heartbeat.stalls}
        stages = [{"worker": w["worker"], **p} for w in self._stats.get("workers", []) for p in
                  w.get("stage_processes", [])]
        return {"engine_core": core, "stage_processes": stages}

    # -- the core --------------------------------------------------------------------
    def _send(self, *command: Any) -> None:
        if self.core_process is not None:
            self.core_process.send(*command)
        else:
            self._core.put(*command)

    def _run(self, model: str | None, engine_args: dict[str, Any], loaded: threading.Event) -> None:
        """The loop thread of an in-process core."""
        try:
            self.engine = DiffusionEngine(model, **engine_args)
            self._core = CoreLoop(self.engine, self._on_report)
            self._stats = self._core.stats()
        except BaseException as e:  # bad arguments, a missing model: the constructor raises it
            self.dead = e
            return
        finally:
            loaded.set()
        self._started.wait()
        try:
            self._core.run()
        except BaseException as e:  # the engine is broken: every open stream must hear of it
            logger.exception("engine loop died")
            self._on_core_exit(e)
        finally:
            self.engine.shutdown()  # the decode stage drains; Ray workers go with the loop that drove them

    def _on_report(self, report: tuple) -> None:
        """What the core says (on its loop thread, or the reader thread of a core process)."""
        self.heartbeat.seen()
        kind = report[0]
        if kind == "pong":
            return
        if kind == "accepted":
            _, request_id, error = report
            self._loop.call_soon_threadsafe(self._settle, request_id, error)
            return
        self._stats = report[-1]
        if kind != "step":
            return
        _, step, outputs, _ = report
        for listener in self.step_listeners:
            try:
                listener(step, outputs)
            except Exception:  # metrics must never take the engine down
                logger.exception("step listener %r failed", listener)
        if outputs:
            self._loop.call_soon_threadsafe(self._deliver, outputs)

    def _on_core_exit(self, error: BaseException) -> None:
        if self.core_process is not None:
            logger.error("the engine core process died: %r", error)
        self.dead = error
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._fail_all, EngineDeadError(f"engine loop died: {error!r}"))

    # -- on the event loop -------------------------------------------------------------
    def _settle(self, request_id: str, error: BaseException | None) -> None:
        future = self._adds.pop(request_id, None)
        if future is None or future.done():
            return
        if error is None:
            future.set_result(None)
        else:
            future.set_exception(error)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is not None:
                stream.put_nowait(out)

    def _fail_all(self, error: BaseException) -> None:
        for stream in self._streams.values():
            stream.put_nowait(error)
        for request_id in list(self._adds):
            self._settle(request_id, error)
