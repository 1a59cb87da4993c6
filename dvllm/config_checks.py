"""The value checks EngineConfig.validate runs on its fields: each raises ValueError naming the field."""
from __future__ import annotations

from typing import Any


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
