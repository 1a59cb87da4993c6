"""One framed duplex channel between two of dvllm's processes (or two threads of one, the in-process backend).

A message is a pickle (protocol 5) of everything but its host tensors, then one frame per tensor holding its raw
bytes, read straight into a tensor made for it: no torch.save zip per tensor, and no copy of the tensor inside
the pickle. A tensor that appears twice in a message (tied weights under two names) arrives as one tensor.
Frames are length-prefixed (multiprocessing.connection's own framing over a socket pair).
"""
from __future__ import annotations

import io
import pickle
import threading
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import torch

_PROTOCOL = pickle.HIGHEST_PROTOCOL


@dataclass(frozen=True)
class _TensorFrame:
    """A host tensor's place in a message: its frame's number, shape and dtype."""

    index: int
    shape: tuple[int, ...]
    dtype: torch.dtype


def _sent_raw(obj: Any) -> bool:
    """Whether a tensor travels as a frame of its bytes: a plain, dense host tensor (a Parameter, a CUDA or quantized
    tensor keeps torch's own pickling, which knows their extra state)."""
    return (type(obj) is torch.Tensor and obj.device.type == "cpu" and obj.layout == torch.strided
            and not obj.is_quantized and not obj.requires_grad)


class _Pickler(pickle.Pickler):
    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file, protocol=_PROTOCOL)
        self.tensors: list[torch.Tensor] = []
        self._seen: dict[int, _TensorFrame] = {}  # id(tensor) -> its frame: a tensor named twice goes once

    def persistent_id(self, obj: Any) -> _TensorFrame | None:
        if not _sent_raw(obj):
            return None
        frame = self._seen.get(id(obj))
        if frame is None:
            frame = self._seen[id(obj)] = _TensorFrame(len(self.tensors), tuple(obj.shape), obj.dtype)
            self.tensors.append(obj)
        return frame


class _Unpickler(pickle.Unpickler):
    def __init__(self, file: io.BytesIO, tensors: list[torch.Tensor]) -> None:
        super().__init__(file)
        self._tensors = tensors

    def persistent_load(self, frame: _TensorFrame) -> torch.Tensor:
        return self._tensors[frame.index]


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    # (a lazily conjugated or negated view holds other bytes than its values: resolved first)
    return tensor.resolve_conj().resolve_neg().contiguous().reshape(-1).view(torch.uint8).numpy().data


class Channel:
    """Sends and receives whole messages over a Connection; each direction is safe from several threads."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self._send_lock, self._recv_lock = threading.Lock(), threading.Lock()

    def fileno(self) -> int:
        return self.conn.fileno()

    def send(self, message: Any) -> None:
        """Raises OSError (or ValueError once closed) when the other end is gone."""
        out = io.BytesIO()
        pickler = _Pickler(out)
        pickler.dump(message)
        tensors = pickler.tensors
        with self._send_lock:
            self.conn.send_bytes(pickle.dumps([(t.shape, t.dtype) for t in tensors], protocol=_PROTOCOL))
            self.conn.send_bytes(out.getbuffer())
            for tensor in tensors:
                if tensor.numel():
                    self.conn.send_bytes(_bytes_of(tensor))

    def poll(self, timeout: float | None = 0.0) -> bool:
        """Whether a message (or the other end's close) is there to read within `timeout` seconds."""
        return self.conn.poll(timeout)

    def receive(self) -> Any:
        """The next message; raises EOFError (or OSError) when the other end is gone."""
        with self._recv_lock:
            layouts = pickle.loads(self.conn.recv_bytes())
            body = self.conn.recv_bytes()
            tensors = [torch.empty(shape, dtype=dtype) for shape, dtype in layouts]
            for tensor in tensors:
                if tensor.numel():
                    self.conn.recv_bytes_into(tensor.reshape(-1).view(torch.uint8).numpy())
        return _Unpickler(io.BytesIO(body), tensors).load()

    def close(self) -> None:
        self.conn.close()
