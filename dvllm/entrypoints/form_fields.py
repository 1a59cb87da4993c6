"""Multipart form fields, typed as a request model declares them: form values are strings."""
from __future__ import annotations

import json
import re
import types
import typing
from typing import Any

from dvllm.entrypoints.protocol import APIError

JSON_FIELDS = ("cache", "loras", "controls")  # objects and lists in a JSON body: JSON text in a form


def typed_form(fields: dict[str, Any], model: type, aliases: dict[str, str] | None = None) -> dict[str, Any]:
    """Form values are strings: those `model` declares as numbers or booleans converted strictly (as JSON would
    read them), the objects in JSON_FIELDS read as JSON text. aliases: short field names -> the model's."""
    out: dict[str, Any] = {}
    hints = typing.get_type_hints(model)
    for key, value in fields.items():
        if key in JSON_FIELDS and isinstance(value, str):
            out[key] = _parse_json_field(key, value)
            continue
        kind = _base_type(hints.get((aliases or {}).get(key, key)))
        if not isinstance(value, str) or kind not in (int, float, bool):
            out[key] = value
            continue
        try:
            out[key] = _parse(value, kind)
        except ValueError:
            raise APIError(400, f"Invalid value for '{key}': expected {kind.__name__}, got {value[:40]!r}.",
                           param=key, code="invalid_value") from None
    return out


def _parse_json_field(key: str, value: str) -> Any:
    try:  # as a JSON body is read: NaN and Infinity are no JSON; 5000 digits or 10**5 brackets are ValueErrors too
        return json.loads(value, parse_constant=_no_constant)
    except (ValueError, RecursionError):
        kind = "list" if key == "controls" else "object"
        raise APIError(400, f"Invalid value for '{key}': expected a JSON {kind} or null, got {value[:80]!r}.",
                       param=key, code="invalid_value") from None


def _no_constant(name: str) -> None:
    raise ValueError(f"{name} is not valid JSON")


def _base_type(hint: Any) -> Any:
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        return args[0] if len(args) == 1 else None
    return hint


_INT = re.compile(r"-?[0-9]+")
_FLOAT = re.compile(r"-?[0-9]+(\.[0-9]+)?([eE][-+]?[0-9]+)?")  # JSON's number syntax


def _parse(value: str, kind: type) -> Any:
    """Strictly, as JSON would: no "1_000", no spaces, no full-width digits, no "inf"."""
    if kind is bool:
        if value.lower() not in ("true", "false"):  # clients write Python's True too
            raise ValueError(value)
        return value.lower() == "true"
    if not (_INT if kind is int else _FLOAT).fullmatch(value):
        raise ValueError(value)
    return kind(value)
