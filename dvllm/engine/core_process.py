"""The engine core in a process of its own (as vLLM v1's EngineCoreProc), and the server's end of it.

The core is a process of dvllm's runtime (runtime/spawn.py) with one channel to the server
(runtime/channel.py). The child builds the DiffusionEngine and runs the CoreLoop on its main
thread; a reader thread takes commands off the channel and a writer thread sends the loop's
reports down it, so the loop never waits on the channel and pickling stays off it. The server
keeps admission (the input processor, LoRA files) and everything HTTP: what crosses is a checked
Request one way and RequestOutputs the other; a request's LoRA adapters cross as ids (dvllm.lora.ref), the
core's worker reads their files itself. Its liveness is the runtime's heartbeat
(runtime/liveness.py), which the async engine runs over the loop's pings and reports.

The child ignores SIGINT (a terminal's Ctrl-C reaches the whole process group, and the server
drains before it stops its core) and leaves when told to or when the server's end of the channel
closes, so a server that dies takes its core with it; while it still loads, the rules every child
is started with (dvllm.child_process) see to that.
"""
from __future__ import annotations

import logging
import queue
import subprocess
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from dvllm.config import EngineConfig
from dvllm.decode_budget import DecodeBudget
from dvllm.logging_setup import STARTUP_LOGGER
from dvllm.models.base import ModelInfo
from dvllm.models.load_config import LoadedModel
from dvllm.runtime.channel import Channel
from dvllm.runtime.errors import portable
from dvllm.runtime.spawn import spawn

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CoreInfo:
    """What the server needs of a core that has loaded its model: to check requests as its engine would."""

    config: EngineConfig
    model_info: ModelInfo
    loaded_model: LoadedModel
    block_numel: int
    pool_blocks: int      # the smallest worker's pool
    model_key: str        # the result cache's model identity
    valid_samplers: list[str]
    decode_budget: DecodeBudget  # which decodes run tiled: the workers' tightest
    stats: dict           # the counters at start-up, until the first report


class CoreProcess:
    """The server's end: starts the core, sends it commands, hands each report to `on_report` (on a
    reader thread of its own), and calls `on_exit` once if the core goes without being told to."""

    def __init__(self, engine_args: dict[str, Any], on_report: Callable[[tuple], None],
                 on_exit: Callable[[BaseException], None], log_level: str | None = None) -> None:
        self._on_report, self._on_exit = on_report, on_exit
        self._stopping = False
        self._send_queue: queue.SimpleQueue = queue.SimpleQueue()
        # (it dies with this process, even while it imports and loads)
        self._process, self._channel = spawn("dvllm.engine.core_process:run_core", "dvllm-core")
        try:
            logging.getLogger(STARTUP_LOGGER).info("the engine core process (pid %d) loads the model ...",
                                                   self._process.pid)
            self._channel.send((engine_args, log_level))
            self.info = self._wait_ready()
        except BaseException:  # a failed load (the core has exited), or SIGTERM / Ctrl-C while it loads
            if self._process.poll() is None:
                self._process.kill()
            self._wait(5)
            raise
        on_report(("stats", self.info.stats))  # the counters are there before any request or probe
        self._reader = threading.Thread(target=self._read, name="dvllm-core-reader", daemon=True)
        self._writer = threading.Thread(target=self._write, name="dvllm-core-writer", daemon=True)
        self._reader.start()
        self._writer.start()

    def _wait_ready(self) -> CoreInfo:
        try:
            kind, payload = self._channel.receive()
        except (EOFError, OSError):
            self._wait(5)
            raise RuntimeError(f"the engine core process exited with code {self._process.returncode} while "
                               "loading the model (its log is above)") from None
        if kind == "failed":
            self._wait(10)
            raise payload
        return payload

    @property
    def pid(self) -> int | None:
        return self._process.pid

    @property
    def returncode(self) -> int | None:
        """The core's exit code once it has gone (None while it runs)."""
        return self._process.poll()

    def is_alive(self) -> bool:
        return self._process.poll() is None

    def _wait(self, timeout: float) -> bool:
        """True if the core exited within `timeout`."""
        try:
            self._process.wait(timeout)
            return True
        except subprocess.TimeoutExpired:
            return False

    def send(self, *command: Any) -> None:
        """("add", Request) / ("abort", id, reason) / ("stop",): pickled and sent in order, off the caller."""
        self._send_queue.put(command)

    def close(self, timeout: float = 10.0) -> None:
        """Asks the core to drain its stages and exit; kills it past `timeout`."""
        self._stopping = True
        self.send("stop")
        if not self._wait(timeout):
            logger.warning("the engine core did not exit in %.0f s: killing it", timeout)
            self._process.kill()
            self._wait(5)
        self._send_queue.put(None)

    def _write(self) -> None:
        while True:
            command = self._send_queue.get()
            if command is None:
                return
            try:
                self._channel.send(command)
            except (OSError, ValueError):  # the core is gone: the reader reports it
                return

    def _read(self) -> None:
        error: BaseException | None = None
        try:
            while True:
                kind, *rest = self._channel.receive()
                if kind == "dead":
                    error = rest[0]
                    break
                self._on_report((kind, *rest))
        except (EOFError, OSError):
            pass
        self._wait(5)
        if not self._stopping:
            self._on_exit(error or RuntimeError(f"the engine core process exited with code {self._process.returncode}"))


def run_core(channel: Channel) -> None:
    """The core process's target (runtime/spawn.py): read its arguments, load, say ready (or why not), then step
    until told to stop. (A library user's server leaves the libraries as quiet as the runtime made them.)"""
    from dvllm.engine.core_loop import CoreLoop
    from dvllm.engine.engine import DiffusionEngine
    from dvllm.logging_setup import setup_logging

    engine_args, log_level = channel.receive()
    if log_level is not None:  # the server's dvllm logging, on the stderr the core shares with it
        setup_logging(log_level)
    out: queue.SimpleQueue = queue.SimpleQueue()
    writer = threading.Thread(target=_send_reports, args=(out, channel), name="dvllm-core-writer", daemon=True)
    writer.start()
    try:
        engine = DiffusionEngine(**engine_args)
    except BaseException as e:  # bad arguments, a missing model: the server raises it
        out.put(("failed", portable(e)))
        out.put(None)
        writer.join()
        return
    loop = CoreLoop(engine, out.put)
    out.put(("ready", CoreInfo(engine.config, engine.model_info, engine.loaded_model, engine.block_numel,
                               engine.processor.pool_blocks, engine.processor.model_key,
                               engine.valid_samplers(), engine.processor.decode_budget, loop.stats())))
    threading.Thread(target=_take_commands, args=(channel, loop), name="dvllm-core-commands",
                     daemon=True).start()
    try:
        loop.run()
    except BaseException as e:  # the engine is broken: the server fails every open request
        logger.exception("engine core died")
        out.put(("dead", portable(e)))
    finally:
        engine.shutdown()  # drains the decode stage, stops Ray workers
        out.put(None)
        writer.join(10)


def _take_commands(channel: Channel, loop: Any) -> None:
    """Puts commands into the loop's queue; the server's end closing stops the loop."""
    try:
        while True:
            command = channel.receive()
            if command[0] == "stop":
                break
            loop.put(*command)
    except (EOFError, OSError):
        logger.warning("the server's end of the engine core's channel closed: stopping")
    loop.stop()


def _send_reports(out: queue.SimpleQueue, channel: Channel) -> None:
    while True:
        report = out.get()
        if report is None:
            return
        try:
            channel.send(report)
        except (OSError, ValueError):
            return  # the server is gone; the command reader stops the loop

