"""A GGUF file's header and tensor table, read and checked before any model code sees the file.

The gguf package's reader (which diffusers loads GGUF weights with) maps the whole file and, on a truncated or
foreign file, fails with an IndexError or a reshape error that names neither the file nor the cause. This reader
walks the same layout (magic, version, counts, key/value metadata, tensor infos, aligned data) with plain reads,
reading no tensor data, and says what is wrong: `<file>: not a valid GGUF file (<cause>)`.
"""
from __future__ import annotations

import math
import os
import struct
from typing import Any, BinaryIO

MAGIC = b"GGUF"
VERSIONS = (2, 3)  # what the gguf package reads (version 1 had 32-bit counts)
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4  # ggml's GGML_MAX_DIMS
MAX_NESTING = 8  # arrays of arrays: deeper is no file a converter writes
# Metadata entries, tensors and the items of string arrays, together, read one by one: far past any model (an
# LLM's vocabulary is ~250k strings), and a bound on the time a garbage header of huge counts can take.
MAX_HEADER_ITEMS = 1 << 22
# GGUFValueType -> struct format of its scalars (8: string, 9: array)
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY, _UINT32 = 8, 9, 4


class _Invalid(Exception):
    """Why the file is no GGUF file (turned into the ValueError naming the file)."""


class _Reader:
    def __init__(self, f: BinaryIO, size: int) -> None:
        self.f, self.size, self.order = f, size, "<"
        self.items_left = MAX_HEADER_ITEMS

    def count(self, n: int, what: str) -> int:
        """`n` items to read one by one, within MAX_HEADER_ITEMS."""
        if n > self.items_left:
            raise _Invalid(f"{what} claims {n} entries; no model's header holds more than {MAX_HEADER_ITEMS}")
        self.items_left -= n
        return n

    def take(self, n: int, what: str) -> bytes:
        if n > self.size - self.f.tell():
            raise _Invalid(f"the file ends inside {what}")
        return self.f.read(n)

    def skip(self, n: int, what: str) -> None:
        if n > self.size - self.f.tell():
            raise _Invalid(f"the file ends inside {what}")
        self.f.seek(n, os.SEEK_CUR)

    def scalar(self, fmt: str, what: str) -> Any:
        return struct.unpack(self.order + fmt, self.take(struct.calcsize(fmt), what))[0]

    def string(self, what: str) -> str:
        data = self.take(self.scalar("Q", what), what)
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError:
            raise _Invalid(f"{what} is not UTF-8 text") from None

    def value(self, kind: int, what: str, depth: int = 0) -> Any:
        """One metadata value; an array's items are skipped (only general.alignment is kept, a scalar)."""
        if kind in _SCALARS:
            return self.scalar(_SCALARS[kind], what)
        if kind == _STRING:
            self.skip(self.scalar("Q", what), what)
            return None
        if kind != _ARRAY:
            raise _Invalid(f"{what} has an unknown value type {kind}")
        if depth >= MAX_NESTING:
            raise _Invalid(f"{what} nests arrays more than {MAX_NESTING} deep")
        item, count = self.scalar("I", what), self.scalar("Q", what)
        if item in _SCALARS:  # fixed-size items: skipped at once, however many
            self.skip(count * struct.calcsize(_SCALARS[item]), what)
            return None
        for _ in range(self.count(count, what)):
            self.value(item, what, depth + 1)
        return None


def read_gguf_names(path: str) -> list[str]:
    """The names of the tensors in the GGUF file at `path`, its header, tensor table and the tensors' extents
    checked; ValueError `<path>: not a valid GGUF file (<cause>)` otherwise."""
    try:
        from gguf import GGML_QUANT_SIZES
    except ImportError:
        raise ValueError(f"{path}: reading a GGUF file needs the gguf package (pip install gguf)") from None
    try:
        with open(path, "rb") as f:
            return _read(_Reader(f, os.fstat(f.fileno()).st_size), GGML_QUANT_SIZES)
    except _Invalid as e:
        raise ValueError(f"{path}: not a valid GGUF file ({e})") from None
    except OSError as e:
        raise ValueError(f"{path}: cannot be read ({e.strerror or type(e).__name__})") from None


def _read(r: _Reader, quant_sizes: dict[int, tuple[int, int]]) -> list[str]:
    head = r.f.read(4)
    if not head:
        raise _Invalid("the file is empty")
    if head != MAGIC[:len(head)]:
        raise _Invalid(f"it does not start with GGUF's magic bytes {MAGIC!r} (it starts {head!r})")
    if head != MAGIC:
        raise _Invalid("the file ends inside its header")
    version = r.scalar("I", "its header")
    if version & 0xFFFF == 0:  # written on a machine of the other byte order
        r.order = ">"
        version = struct.unpack(">I", struct.pack("<I", version))[0]
    if version not in VERSIONS:
        raise _Invalid(f"version {version}; GGUF versions {' and '.join(map(str, VERSIONS))} are read")
    tensor_count, kv_count = r.scalar("Q", "its header"), r.scalar("Q", "its header")
    alignment = DEFAULT_ALIGNMENT
    keys: set[str] = set()
    for k in range(r.count(kv_count, "its header's metadata")):
        key = r.string(f"metadata entry {k}")
        if key in keys:
            raise _Invalid(f"metadata key {key[:100]!r} appears twice")
        keys.add(key)
        what = f"metadata entry {key[:100]!r}"
        kind = r.scalar("I", what)
        value = r.value(kind, what)
        if key == "general.alignment":
            if kind != _UINT32 or not value or value & (value - 1):
                raise _Invalid(f"general.alignment must be a power of two (a uint32), got {value!r}")
            alignment = value
    tensors = [_tensor_info(r, k, quant_sizes) for k in range(r.count(tensor_count, "its tensor table"))]
    data_start = -(-r.f.tell() // alignment) * alignment
    names: set[str] = set()
    for name, offset, nbytes in tensors:
        if name in names:
            raise _Invalid(f"tensor {name[:100]!r} appears twice")
        names.add(name)
        if offset % alignment:
            raise _Invalid(f"tensor {name[:100]!r} starts at offset {offset}, not a multiple of {alignment}")
        if data_start + offset + nbytes > r.size:
            raise _Invalid(f"tensor {name[:100]!r} ends at byte {data_start + offset + nbytes}, past the file's end "
                           f"({r.size} bytes): a truncated download?")
    return [name for name, _, _ in tensors]


def _tensor_info(r: _Reader, k: int, quant_sizes: dict[int, tuple[int, int]]) -> tuple[str, int, int]:
    """(name, offset into the data, bytes) of the k-th tensor info."""
    name = r.string(f"tensor info {k}")
    what = f"the info of tensor {name[:100]!r}"
    n_dims = r.scalar("I", what)
    if n_dims > MAX_DIMS:
        raise _Invalid(f"tensor {name[:100]!r} has {n_dims} dimensions; ggml's tensors have at most {MAX_DIMS}")
    dims = [r.scalar("Q", what) for _ in range(n_dims)]
    kind, offset = r.scalar("I", what), r.scalar("Q", what)
    if kind not in quant_sizes:
        raise _Invalid(f"tensor {name[:100]!r} has an unknown type {kind}")
    block, block_bytes = quant_sizes[kind]
    if dims and dims[0] % block:
        raise _Invalid(f"tensor {name[:100]!r}'s rows of {dims[0]} do not split into blocks of {block}")
    return name, offset, math.prod(dims) // block * block_bytes
