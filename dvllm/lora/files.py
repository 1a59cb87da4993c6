"""Where an adapter's weights are, checked before diffusers sees the path.

diffusers' loader takes anything: a file that is no safetensors falls back to a pickle reader that reads the
whole file as text, and a path that is no local file is looked up on the Hub. So dvllm resolves a path itself:
a local `.safetensors` file (or `.bin`, only if the operator allows pickles), or a folder holding exactly one
(or diffusers' `pytorch_lora_weights.safetensors`); bounded in size, its header read and checked; a Hub id only
if the operator allows them; the bare name of an adapter shipped in the package (dvllm/models/builtin/loras,
e.g. tiny-shapes-blue) is that adapter's folder. diffusers is then handed that one absolute file path, and only
the safetensors reader. The file's identity (device, inode, size, mtime) is kept, so that admission (a stat)
and every later read of the adapter serve the file that was loaded, or fail naming why.
"""
from __future__ import annotations

import json
import math
import os
import re
import stat
import struct
from dataclasses import dataclass
from importlib import resources
from typing import Any

SAFETENSORS, PICKLE = ".safetensors", ".bin"
DIFFUSERS_WEIGHT_NAMES = ("pytorch_lora_weights.safetensors", "pytorch_lora_weights.bin")
MAX_HEADER_BYTES = 100 << 20  # the safetensors format's own limit
MAX_FOLDER_ENTRIES = 10_000   # a folder is listed, not walked: a huge one is refused, not scanned
_HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,95}/[A-Za-z0-9][A-Za-z0-9_.-]{0,95}")
# bytes per element of each safetensors dtype
_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
                "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "U16": 2, "U32": 4, "U64": 8}


_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@+-]{0,127}")


def check_lora_name(name: object) -> None:
    """An adapter's name: what requests send as a `loras` key or as `model`; ValueError otherwise."""
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ValueError(f"LoRA name must be 1-128 letters, digits or ._:@+- (starting with a letter or "
                         f"digit), got {str(name)[:200]!r}")


class LoraPathError(ValueError):
    """The path names no loadable adapter file. Its message says why, for the operator (the Python API, the
    logs); a server answers clients with `public_message` only, which does not tell a missing path from a
    folder or an unreadable file."""

    def __init__(self, path: str, why: str) -> None:
        super().__init__(f"LoRA path {path!r}: {why}")
        self.public_message = f"LoRA path {path!r} is not a loadable adapter"


@dataclass(frozen=True)
class LoraFilePolicy:
    """What the operator allows adapter paths to be (EngineConfig's max_lora_file_mb, allow_lora_bin,
    allow_lora_hub_ids)."""

    max_mb: float
    allow_bin: bool = False
    allow_hub_ids: bool = False

    @classmethod
    def of(cls, config: Any) -> LoraFilePolicy:
        """The policy an EngineConfig sets."""
        return cls(config.max_lora_file_mb, config.allow_lora_bin, config.allow_lora_hub_ids)

    @property
    def max_bytes(self) -> int:
        return int(self.max_mb * (1 << 20))

    @property
    def extensions(self) -> tuple[str, ...]:
        return (SAFETENSORS, PICKLE) if self.allow_bin else (SAFETENSORS,)


@dataclass(frozen=True)
class LoraFile:
    """One adapter weights file on the local disk, as it was when it was checked."""

    path: str  # absolute
    device: int
    inode: int
    size: int
    mtime_ns: int

    @property
    def is_safetensors(self) -> bool:
        return self.path.endswith(SAFETENSORS)

    def changed(self) -> str | None:
        """Why the file at `path` is no longer the one checked, or None if it still is."""
        try:
            st = os.stat(self.path)
        except OSError as e:
            return f"it can no longer be read ({e.strerror or type(e).__name__})"
        if (st.st_dev, st.st_ino) != (self.device, self.inode):
            return "another file has replaced it"
        if st.st_size != self.size or st.st_mtime_ns != self.mtime_ns:
            return f"it was modified (size {self.size} -> {st.st_size} bytes)"
        return None


def locate_lora(path: str, policy: LoraFilePolicy) -> LoraFile:
    """The weights file `path` names, checked; LoraPathError saying why it cannot be loaded."""
    if not isinstance(path, str) or not path:
        raise ValueError(f"LoRA path must be a non-empty string, got {path!r}")
    shipped = builtin_lora_folder(path)
    if shipped is not None:  # as a built-in model's name: the same adapter whatever the working directory
        return locate_lora(shipped, policy)
    local = os.path.expanduser(path)
    try:
        st = os.stat(local)
    except FileNotFoundError:
        if policy.allow_hub_ids and _HUB_ID.fullmatch(path):
            return locate_lora(_download(path, policy), policy)
        hint = "" if policy.allow_hub_ids or not _HUB_ID.fullmatch(path) else \
            " (Hub ids are not loaded unless the server allows them: --allow-lora-hub-ids)"
        raise LoraPathError(path, f"does not exist{hint}") from None
    except OSError as e:
        raise LoraPathError(path, f"cannot be read ({e.strerror or type(e).__name__})") from None
    if stat.S_ISDIR(st.st_mode):
        local = os.path.join(local, _weights_in_folder(path, local, policy))
    elif not stat.S_ISREG(st.st_mode):
        raise LoraPathError(path, "is neither a regular file nor a folder")
    elif not local.endswith(policy.extensions):
        allowed = " or ".join(policy.extensions)
        also = "" if policy.allow_bin or not local.endswith(PICKLE) else \
            " (.bin files are pickles, loaded only if the server allows them: --allow-lora-bin)"
        raise LoraPathError(path, f"is not a {allowed} file{also}")
    return _check_file(path, os.path.abspath(local), policy)


def builtin_lora_folder(name: str) -> str | None:
    """The folder of an adapter shipped in the package, named by its bare name, or None."""
    loras = resources.files("dvllm.models") / "builtin" / "loras"
    if not loras.is_dir() or name not in {p.name for p in loras.iterdir()}:  # a bare name, never a path
        return None
    return str(loras / name)


def _weights_in_folder(path: str, folder: str, policy: LoraFilePolicy) -> str:
    """The one weights file in a folder: diffusers' standard name, else the only file of a loadable type."""
    names = []
    try:
        with os.scandir(folder) as entries:
            for count, entry in enumerate(entries):
                if count >= MAX_FOLDER_ENTRIES:
                    raise LoraPathError(path, f"is a folder of more than {MAX_FOLDER_ENTRIES} entries")
                if entry.name.endswith(policy.extensions) and entry.is_file():
                    names.append(entry.name)
    except OSError as e:
        raise LoraPathError(path, f"the folder cannot be listed ({e.strerror or type(e).__name__})") from None
    for standard in DIFFUSERS_WEIGHT_NAMES:
        if standard in names and standard.endswith(policy.extensions):
            return standard
    for extension in policy.extensions:  # safetensors first
        found = sorted(n for n in names if n.endswith(extension))
        if len(found) == 1:
            return found[0]
        if found:
            raise LoraPathError(path, f"the folder holds {len(found)} {extension} files ({', '.join(found[:5])}"
                                      f"{', ...' if len(found) > 5 else ''}): name the file")
    raise LoraPathError(path, f"the folder holds no {' or '.join(policy.extensions)} file")


def _check_file(path: str, local: str, policy: LoraFilePolicy) -> LoraFile:
    try:
        with open(local, "rb") as f:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode):
                raise LoraPathError(path, "is not a regular file")
            if st.st_size > policy.max_bytes:
                raise LoraPathError(path, f"the file is {st.st_size / (1 << 20):.1f} MB, over max_lora_file_mb="
                                          f"{policy.max_mb:g}")
            if local.endswith(SAFETENSORS):
                _check_safetensors_header(path, f, st.st_size)
    except OSError as e:
        raise LoraPathError(path, f"cannot be read ({e.strerror or type(e).__name__})") from None
    return LoraFile(local, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def _check_safetensors_header(path: str, f, size: int) -> None:
    """The header is JSON describing tensors that tile the data section exactly: reading it costs at most
    MAX_HEADER_BYTES, and what is not a safetensors file is refused here, never parsed by another reader."""
    def refuse(why: str) -> LoraPathError:
        return LoraPathError(path, f"not a safetensors file: {why}")

    prefix = f.read(8)
    if len(prefix) < 8:
        raise refuse("shorter than its 8-byte header length")
    (length,) = struct.unpack("<Q", prefix)
    if length > min(MAX_HEADER_BYTES, size - 8):
        raise refuse(f"its header length ({length} bytes) is past the file's end or over {MAX_HEADER_BYTES} bytes")
    try:
        header = json.loads(f.read(length))
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise refuse("its header is not JSON") from None
    if not isinstance(header, dict):
        raise refuse("its header is not a JSON object")
    header.pop("__metadata__", None)
    if not header:
        raise refuse("it holds no tensors")
    spans = []
    for name, info in header.items():
        offsets = info.get("data_offsets") if isinstance(info, dict) else None
        shape = info.get("shape") if isinstance(info, dict) else None
        dtype = info.get("dtype") if isinstance(info, dict) else None
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_count(o) for o in offsets)
                and isinstance(shape, list) and all(_is_count(d) for d in shape)
                and isinstance(dtype, str) and dtype in _DTYPE_BYTES):
            raise refuse(f"tensor {name[:100]!r} is not described by a dtype, a shape and data offsets")
        begin, end = offsets
        if end - begin != math.prod(shape) * _DTYPE_BYTES[dtype]:
            raise refuse(f"tensor {name[:100]!r} takes {end - begin} bytes, not its shape's")
        spans.append((begin, end))
    spans.sort()
    position = 0
    for begin, end in spans:
        if begin != position:
            raise refuse("its tensors overlap or leave gaps")
        position = end
    if position != size - 8 - length:
        raise refuse(f"its tensors take {position} bytes, but the file holds {size - 8 - length} after the header")


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _download(repo_id: str, policy: LoraFilePolicy) -> str:
    """A Hub repo's adapter file, chosen as in a folder, its size checked before it is fetched: the local copy."""
    from huggingface_hub import HfApi, get_hf_file_metadata, hf_hub_download, hf_hub_url

    try:
        files = [f for f in HfApi().list_repo_files(repo_id) if "/" not in f]
        loadable = [f for f in files if f.endswith(policy.extensions)]
        name = next((n for n in DIFFUSERS_WEIGHT_NAMES if n in loadable), None)
        if name is None:
            found = sorted(f for f in loadable if f.endswith(SAFETENSORS)) or sorted(loadable)
            if len(found) != 1:
                raise LoraPathError(repo_id, f"the Hub repo holds {len(found)} loadable weight files at its top; "
                                             "download the one to serve and give its path")
            name = found[0]
        size = get_hf_file_metadata(hf_hub_url(repo_id, name)).size
        if size is not None and size > policy.max_bytes:
            raise LoraPathError(repo_id, f"{name} is {size / (1 << 20):.1f} MB, over max_lora_file_mb="
                                         f"{policy.max_mb:g}")
        return hf_hub_download(repo_id, name)
    except LoraPathError:
        raise
    except Exception as e:  # offline, no such repo, gated...
        raise LoraPathError(repo_id, f"cannot be fetched from the Hub ({type(e).__name__}: {str(e)[:200]})") from None


def check_lora_modules(config: Any) -> None:
    """Each of an EngineConfig's --lora-modules names and paths, as a load would check them: before the model
    loads, not after."""
    policy = LoraFilePolicy.of(config)
    for name, path in config.lora_modules.items():
        try:
            check_lora_name(name)
            locate_lora(path, policy)
        except ValueError as e:
            raise ValueError(f"lora_modules: {name}={path}: {e}") from None
