"""The value checks EngineConfig.validate runs on its fields: each raises ValueError naming the field."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dvllm.config import EngineConfig

# Most decode worker processes one engine may start
MAX_DECODE_WORKERS = 64


def parse_lora_modules(value: Any) -> dict[str, str]:
    """{name: path}, or the flag's ["name=path", ...]."""
    if value is None:
        return {}
    if isinstance(value, str):
        value = [value]
    if isinstance(value, (list, tuple)):
        pairs = {}
        for item in value:
            name, sep, path = item.partition("=") if isinstance(item, str) else ("", "", "")
            if not (sep and name and path):
                raise ValueError(f"lora_modules: expected name=path, got {item!r}")
            if name in pairs:
                raise ValueError(f"lora_modules: {name!r} is given twice")
            pairs[name] = path
        return pairs
    if isinstance(value, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        return dict(value)
    raise ValueError(f"lora_modules must map adapter names to paths, got {value!r}")


def choice(name: str, value: Any, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {list(allowed)}, got {value!r}")


def positive_int(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def non_negative(name: str, value: Any) -> None:
    if not (is_number(value) and value >= 0):
        raise ValueError(f"{name} must be a number >= 0, got {value!r}")


def is_cuda_index(device: str) -> bool:
    prefix, _, index = device.partition(":")
    return prefix == "cuda" and index.isdigit()


def check_encoder_device(config: EngineConfig) -> None:
    """encoder_device: a device name, and no combination that cannot work."""
    device = config.encoder_device
    if device is None:
        return
    if not (device in ("cpu", "cuda") or is_cuda_index(device)):
        raise ValueError(f"encoder_device must be 'cpu', 'cuda' or 'cuda:N', got {device!r}")
    if config.enable_lora:
        raise ValueError("encoder_device cannot be combined with LoRA serving: an adapter's text-encoder "
                         "layers read their weights from slot tables on the worker's device")
    if device != "cpu" and config.num_workers > 1:
        raise ValueError(f"encoder_device {device!r} with {config.num_workers} workers would put every worker's "
                         "text encoders on one GPU: use 'cpu', or one worker per engine")


def check_decode_workers(config: EngineConfig) -> None:
    """decode_workers and decode_device: counts, devices, and the stage they decode for."""
    if isinstance(config.decode_workers, bool) or not isinstance(config.decode_workers, int) \
            or not 0 <= config.decode_workers <= MAX_DECODE_WORKERS:
        raise ValueError(f"decode_workers must be an integer in [0, {MAX_DECODE_WORKERS}], got "
                         f"{config.decode_workers!r}")
    if config.decode_device is not None:
        if not config.decode_workers:
            raise ValueError("decode_device is set but decode_workers is 0")
        for device in config.decode_devices:
            if not (device in ("cpu", "cuda") or is_cuda_index(device)):
                raise ValueError(f"decode_device must be 'cpu', 'cuda' or 'cuda:N' (or several, comma-"
                                 f"separated), got {config.decode_device!r}")
    if config.decode_workers and config.decode_stage is False:
        raise ValueError("decode_workers decode for the decode stage: they cannot be combined with "
                         "decode_stage=False")
