"""AsyncDiffusionEngine: the step loop on a background thread, one async stream per request.

The DiffusionEngine is touched only by its loop thread: requests and aborts reach it
through a command queue and are applied between steps; outputs come back to the
event loop with call_soon_threadsafe. The denoiser runs off the event loop, so an
asyncio server stays responsive while the model works.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from dvllm.engine.engine import DiffusionEngine, StepStats
from dvllm.outputs import RequestOutput
from dvllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine loop stopped; no request can finish."""


class EngineShuttingDownError(RuntimeError):
    """The engine no longer accepts requests."""


class AsyncDiffusionEngine:
    def __init__(self, model: str | None = None, **engine_args: Any) -> None:
        self.step_listeners: list[Callable[[StepStats, list[RequestOutput]], None]] = []  # run on the loop thread
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._streams: dict[str, asyncio.Queue] = {}  # touched only on the event loop
        self._ids = itertools.count()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._started = threading.Event()
        self._stop = threading.Event()
        self._accepting = True
        self.dead: BaseException | None = None
        # The model is loaded on the loop thread that will run it: torch's CPU thread pool belongs to
        # the thread that first used it, and running on another thread was measured 2x slower.
        loaded = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(model, engine_args, loaded), name="dvllm-engine-loop",
                                        daemon=True)
        self._thread.start()
        loaded.wait()
        if self.dead is not None:
            raise self.dead
        self.model_info = self.engine.model_info
        self.loaded_model = self.engine.loaded_model
        self.config = self.engine.config

    # -- lifecycle ---------------------------------------------------------------
    def start(self) -> None:
        """Lets the loop thread serve; call from the event loop that will consume the streams."""
        if not self._started.is_set():
            self._loop = asyncio.get_running_loop()
            self._started.set()

    @property
    def is_running(self) -> bool:
        return self._started.is_set() and self._thread.is_alive() and self.dead is None

    async def shutdown(self, grace_seconds: float = 30.0) -> None:
        """Stops accepting; lets running requests finish for up to grace_seconds; aborts the rest."""
        self._accepting = False
        deadline = time.monotonic() + grace_seconds
        while self._streams and self.is_running and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for request_id in list(self._streams):
            self._send("abort", request_id, "server shutting down")
        while self._streams and self.is_running and time.monotonic() < deadline + 5:
            await asyncio.sleep(0.02)
        self._stop.set()
        self._wakeup.set()
        self._started.set()  # a loop never started must still see the stop
        await asyncio.to_thread(self._thread.join, 10)
        self._fail_all(EngineShuttingDownError("the engine shut down before this request finished"))

    # -- requests ------------------------------------------------------------------
    async def generate(self, prompt: str, params: SamplingParams | None = None,
                       request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """Progress outputs (step k of n, previews when asked), then the final output.

        Bad input raises ValueError and a full queue QueueFullError before anything is
        yielded. Leaving the iteration early (a client gone, a timeout) aborts the request.
        """
        if not self._accepting:
            raise EngineShuttingDownError("the engine is shutting down")
        if not self.is_running:
            raise EngineDeadError(f"the engine loop is not running: {self.dead!r}")
        request_id = request_id or f"async-{next(self._ids)}"
        if request_id in self._streams:
            raise ValueError(f"request_id {request_id!r} is already in use")
        stream: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = stream  # reserved now: the id is taken while the request is processed
        accepted = self._loop.create_future()
        finished = False
        try:
            # Checked completely here, off the event loop and off the step loop: a bad request is
            # answered at once whatever the engine is running, and an upload decodes in this thread.
            request = await asyncio.to_thread(self.engine.processor.process, request_id, prompt, params)
            self._send("add", request, accepted)
            await accepted  # raises what add_request raised
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
            if not finished:  # gone early (or never accepted: aborting an unknown id does nothing)
                self._send("abort", request_id, None)

    async def abort(self, request_id: str) -> None:
        self._send("abort", request_id, None)

    # -- LoRA adapters ---------------------------------------------------------------
    # The engine's registry is thread-safe and reads adapters in the caller's thread: a worker thread
    # here, so the event loop keeps serving and the step loop keeps stepping while one is read.
    async def load_lora(self, name: str, path: str) -> None:
        """Reads and registers an adapter (seconds for a large one); ValueError if it cannot be served."""
        await asyncio.to_thread(self.engine.load_lora, name, path)

    async def unload_lora(self, name: str) -> None:
        """Forgets an adapter; requests already accepted with it finish with it. ValueError if unknown."""
        await asyncio.to_thread(self.engine.unload_lora, name)

    def valid_samplers(self) -> list[str]:
        """The samplers this model runs (probed at start-up; read-only since)."""
        return self.engine.valid_samplers()

    def list_loras(self) -> list[dict]:
        """The loaded adapters ({"name", "path", "in_host_cache"}); quick, safe on the event loop."""
        return self.engine.list_loras()

    def stats(self) -> dict:
        """The engine's counters as of its latest step (a snapshot taken on the loop thread), with
        one entry per worker under "workers"."""
        return dict(self._stats)

    # -- the loop thread -------------------------------------------------------------
    def _send(self, *command: Any) -> None:
        self._commands.put(command)
        self._wakeup.set()

    def _run(self, model: str | None, engine_args: dict[str, Any], loaded: threading.Event) -> None:
        try:
            self.engine = DiffusionEngine(model, **engine_args)
            self._snapshot_stats()
        except BaseException as e:  # bad arguments, a missing model: the constructor raises it
            self.dead = e
            return
        finally:
            loaded.set()
        self._started.wait()
        try:
            while not self._stop.is_set():
                self._apply_commands()
                self._snapshot_stats()
                if not self.engine.has_unfinished_requests():
                    # idle, yet a restarted worker must be let in, and a dead one noticed
                    interval = self.engine.idle_poll_interval
                    self._wakeup.wait(interval)
                    self._wakeup.clear()
                    if interval is not None:
                        self.engine.poll_workers()
                        self._snapshot_stats()
                    continue
                outputs = self.engine.step()
                self._snapshot_stats()
                for listener in self.step_listeners:
                    try:
                        listener(self.engine.last_step, outputs)
                    except Exception:  # metrics must never take the engine down
                        logger.exception("step listener %r failed", listener)
                if outputs:
                    self._loop.call_soon_threadsafe(self._deliver, outputs)
        except BaseException as e:  # the engine is broken: every open stream must hear of it
            logger.exception("engine loop died")
            self.dead = e
            if self._loop is not None:
                self._loop.call_soon_threadsafe(self._fail_all, EngineDeadError(f"engine loop died: {e!r}"))
        finally:
            self.engine.shutdown()  # Ray workers go with the loop that drove them

    def _snapshot_stats(self) -> None:
        self._stats = {**self.engine.stats(), "workers": self.engine.worker_stats()}

    def _apply_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if command[0] == "add":
                _, request, accepted = command
                try:
                    self.engine.add_processed(request)
                except Exception as e:  # bad input or a full queue: the caller's error
                    self._loop.call_soon_threadsafe(_settle, accepted, e)
                else:
                    self._loop.call_soon_threadsafe(_settle, accepted, None)
            else:
                _, request_id, reason = command
                if self.engine.abort_request(request_id) and reason:
                    logger.info("aborted %s: %s", request_id, reason)

    # -- on the event loop -------------------------------------------------------------
    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is not None:
                stream.put_nowait(out)

    def _fail_all(self, error: BaseException) -> None:
        for stream in self._streams.values():
            stream.put_nowait(error)


def _settle(future: asyncio.Future, error: BaseException | None) -> None:
    if future.done():
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)
