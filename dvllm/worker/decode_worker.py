"""Decode workers (EngineConfig.decode_workers): processes of their own, each holding a copy of the model's VAE
on the CPU or another GPU, that decode the decode stage's batches and convert them to the output type, so that
neither the VAE nor PIL runs in the worker's process (its GIL) or, on GPUs, on its device.

The decode stage gives each process a lane: a thread that sends it a batch (latents on the host, small) and
waits for the images. The process is spawned when the worker starts (its imports overlap the engine's first
steps) and gets its VAE copy with the first batch. A process found dead is spawned again and raises DecodeWorkerLost
to the lane, which decodes the batch once more: no request is lost to a killed process.
"""
from __future__ import annotations

import logging
import multiprocessing
import os
import pickle
import signal
import subprocess
import sys
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any, Callable

import torch

logger = logging.getLogger(__name__)

# How often a lane waiting for its process checks that the process is still alive
_ALIVE_POLL_S = 1.0
_CLOSE_TIMEOUT_S = 10.0


class DecodeWorkerLost(RuntimeError):
    """The decode process died (killed, or crashed) before answering."""


@dataclass
class VaeCopy:
    """What an adapter's decode reads of its pipeline (the VAE, the image processor, the latents' unpacking) as
    plain data a process rebuilds it from: the VAE's class, config, weights on the host and switches."""

    adapter_cls: type
    pipeline_cls: type
    vae_cls: type
    vae_config: dict[str, Any]
    state: dict[str, torch.Tensor]
    switches: dict[str, Any]  # tiling and slicing, as the engine's VAE has them
    training: bool  # its mode too: dummy weights are built in training mode, whose dropout changes layouts
    image_processor: Any
    vae_scale_factor: int

    @classmethod
    def of(cls, adapter: Any) -> VaeCopy:
        pipeline = adapter.pipeline
        vae = pipeline.vae
        check_copyable(vae)
        state = {name: tensor.detach().to("cpu", copy=True) for name, tensor in vae.state_dict().items()}
        switches = {k: v for k, v in vars(vae).items()
                    if k.startswith(("use_", "tile_")) and isinstance(v, (bool, int, float))}
        return cls(type(adapter), type(pipeline), type(vae), dict(vae.config), state, switches, vae.training,
                   pipeline.image_processor, pipeline.vae_scale_factor)

    def build(self, device: torch.device) -> VaeDecoder:
        vae = self.vae_cls.from_config(self.vae_config)
        vae.load_state_dict(self.state, strict=True, assign=True)  # each weight keeps its dtype
        for name, value in self.switches.items():
            setattr(vae, name, value)
        vae.to(device).train(self.training)
        return VaeDecoder(self.adapter_cls, _DecodeParts(vae, self.image_processor, self.vae_scale_factor,
                                                         self.pipeline_cls))


def check_copyable(vae: torch.nn.Module) -> None:
    """ValueError unless every weight of the VAE is a plain float tensor (what a copy can carry)."""
    for name, tensor in vae.state_dict().items():
        if type(tensor) is not torch.Tensor or not tensor.is_floating_point():
            raise ValueError(f"decode_workers: the VAE's {name} is not a plain float tensor (a quantized VAE?); "
                             "decode workers copy plain weights only")


class _DecodeParts:
    """The parts of a diffusers pipeline an adapter's decode reads."""

    def __init__(self, vae: Any, image_processor: Any, vae_scale_factor: int, pipeline_cls: type) -> None:
        self.vae, self.image_processor, self.vae_scale_factor = vae, image_processor, vae_scale_factor
        self._unpack_latents = getattr(pipeline_cls, "_unpack_latents", None)  # a staticmethod where it exists


class VaeDecoder:
    """The adapter's own decode, run on the parts alone (ModelAdapter.decode reads only self.pipeline's)."""

    def __init__(self, adapter_cls: type, pipeline: _DecodeParts) -> None:
        self.pipeline = pipeline
        self._decode = adapter_cls.decode

    def decode(self, latents: torch.Tensor, image_size: tuple[int, int]) -> torch.Tensor:
        return self._decode(self, latents, image_size)


# A batch: latents on the host, (height, width), each job's (image count, output type), and the most images
# one VAE call takes (max_decode_batch, as the worker's own decode chunks them)
Batch = tuple[torch.Tensor, tuple[int, int], list[tuple[int, str]], int]


class DecodeWorker:
    """One decode process and the pipe to it; used by one lane thread at a time."""

    def __init__(self, vae_copy: Callable[[], VaeCopy], device: str, threads: int, index: int) -> None:
        self._vae_copy = vae_copy  # a fresh copy for each process started
        self.device, self.threads, self.index = device, threads, index
        self.restarts = 0
        self._process: subprocess.Popen | None = None
        self._conn: Connection | None = None
        self._has_vae = False
        self._spawn()

    @property
    def pid(self) -> int | None:
        return None if self._process is None else self._process.pid

    def decode(self, batch: Batch) -> list[list[Any]]:
        """Each job's images; raises RuntimeError with the process's error, or DecodeWorkerLost (the process is
        spawned again before it is raised)."""
        try:
            if not self._has_vae:
                self._call(("vae", self._vae_copy()))
                self._has_vae = True
            return self._call(("decode", batch))
        except (EOFError, OSError, DecodeWorkerLost) as e:
            pid = self.pid
            self._respawn()
            raise DecodeWorkerLost(f"decode worker {self.index} (pid {pid}) died: {type(e).__name__}") from None

    def close(self) -> None:
        if self._process is None:
            return
        try:
            self._conn.send_bytes(pickle.dumps(None))
        except OSError:
            pass
        try:
            self._process.wait(_CLOSE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
        self._conn.close()
        self._process = self._conn = None

    def _call(self, message: tuple[str, Any]) -> Any:
        self._conn.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))
        while not self._conn.poll(_ALIVE_POLL_S):
            if self._process.poll() is not None:
                raise DecodeWorkerLost("exited")
        status, value = pickle.loads(self._conn.recv_bytes())
        if status == "error":
            raise RuntimeError(value)
        return value

    def _spawn(self) -> None:
        # A fresh interpreter, as the engine core process is (never a fork of a process holding CUDA or
        # threads; not multiprocessing's spawn, which imports the caller's main script again)
        parent, child = multiprocessing.Pipe()
        self._process = subprocess.Popen(
            [sys.executable, "-m", "dvllm.worker.decode_worker", str(child.fileno()), self.device, str(self.threads)],
            pass_fds=(child.fileno(),), stdin=subprocess.DEVNULL,
            # its OpenMP threads sleep between batches instead of spinning on cores the worker's threads use
            env={"OMP_WAIT_POLICY": "PASSIVE", **os.environ})
        child.close()  # the child's end lives in the child alone: its death ends the pipe
        self._conn = parent
        self._has_vae = False

    def _respawn(self) -> None:
        self.restarts += 1
        logger.error("decode worker %d (pid %s) died; starting it again", self.index, self.pid)
        if self._process.poll() is None:
            self._process.kill()
        self._process.wait()
        self._conn.close()
        self._spawn()


def _serve(conn: Connection, device: str, threads: int) -> None:
    """The decode process: builds the VAE from the first message, then answers batches until told to stop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C is the engine's to handle: it stops us
    from dvllm.worker.model_runner import to_output_type

    torch.set_num_threads(threads)
    decoder = None
    while True:
        try:
            message = pickle.loads(conn.recv_bytes())
        except EOFError:  # the engine is gone
            return
        if message is None:
            return
        kind, payload = message
        try:
            with torch.inference_mode():
                if kind == "vae":
                    decoder, answer = payload.build(torch.device(device)), None
                else:
                    latents, size, jobs, chunk = payload
                    pixels = torch.cat([decoder.decode(part, size) for part in latents.to(device).split(chunk)])
                    answer, lo = [], 0
                    for n, output_type in jobs:
                        answer.append(to_output_type(pixels[lo:lo + n], output_type))
                        lo += n
            reply = ("ok", answer)
        except Exception as e:  # noqa: BLE001 - the lane decides what a failed batch fails
            reply = ("error", f"{type(e).__name__}: {e}")
        conn.send_bytes(pickle.dumps(reply, protocol=pickle.HIGHEST_PROTOCOL))


def start_decode_workers(adapter: Any, count: int, devices: list[str], worker_device: torch.device) -> list[DecodeWorker]:
    """`count` decode processes placed in turn on `devices` (those this process sees: a Ray worker's are on its
    node); on a GPU worker none may share its GPU (there the decode stage's thread decodes with no second VAE)."""
    for device in devices:
        place = torch.device(device)
        if place.type == "cuda" and (place.index or 0) >= torch.cuda.device_count():
            raise ValueError(f"decode_device {device!r}: this worker sees {torch.cuda.device_count()} GPU(s) (a Ray "
                             "worker sees those it was given)")
        if _same_gpu(torch.device(device), worker_device):
            raise ValueError(f"decode_device {device!r} is the worker's own GPU ({worker_device}): decode workers "
                             "go to the CPU or another GPU (on the worker's GPU the decode stage's thread decodes)")
    check_copyable(adapter.pipeline.vae)
    # As many intra-op threads as the worker's: the CPU's kernels split their sums by the thread count, and an
    # image must not depend on the process that decoded it
    threads = torch.get_num_threads()
    logger.info("%d decode worker process(es) on %s", count, ", ".join(devices))
    return [DecodeWorker(lambda: VaeCopy.of(adapter), devices[i % len(devices)], threads, i) for i in range(count)]


def _same_gpu(a: torch.device, b: torch.device) -> bool:
    if a.type != "cuda" or b.type != "cuda":
        return False
    return (a.index if a.index is not None else torch.cuda.current_device()) == \
        (b.index if b.index is not None else torch.cuda.current_device())


if __name__ == "__main__":
    _serve(Connection(int(sys.argv[1])), sys.argv[2], int(sys.argv[3]))
