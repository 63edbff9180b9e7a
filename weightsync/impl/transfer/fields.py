"""Field validators of the request dicts (``init_info``, ``update_info``): every parse error is a
``ValueError`` whose message names the offending field, the value and the rule."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar


def require_mapping(obj: object, what: str) -> Mapping[str, Any]:
    if not isinstance(obj, Mapping):
        raise ValueError(f"{what} must be a dict, got {type(obj).__name__}")
    for k in obj:
        if not isinstance(k, str):
            raise ValueError(f"{what} keys must be str, got {k!r}")
    return obj


def check_fields(d: Mapping[str, Any], what: str, required: Sequence[str], optional: Sequence[str]) -> None:
    for f in required:
        if f not in d:
            raise ValueError(f"{what} is missing required field {f!r} (required: {', '.join(required)})")
    allowed = set(required) | set(optional)
    for k in d:
        if k not in allowed:
            raise ValueError(f"{what} has unknown field {k!r}; allowed fields: {', '.join(sorted(allowed))}")


def field_int(
    d: Mapping[str, Any], key: str, what: str, minimum: int | None = None, maximum: int | None = None
) -> int:
    v = d[key]
    if isinstance(v, bool) or not isinstance(v, int):
        raise ValueError(f"{what}[{key!r}] must be an int, got {type(v).__name__} {v!r}")
    if minimum is not None and v < minimum:
        raise ValueError(f"{what}[{key!r}]={v} must be >= {minimum}")
    if maximum is not None and v > maximum:
        raise ValueError(f"{what}[{key!r}]={v} must be <= {maximum}")
    return v


def field_bool(d: Mapping[str, Any], key: str, what: str) -> bool:
    v = d[key]
    if not isinstance(v, bool):
        raise ValueError(f"{what}[{key!r}] must be a bool, got {type(v).__name__} {v!r}")
    return v


def field_seconds(d: Mapping[str, Any], key: str, what: str) -> float:
    v = d[key]
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or v <= 0:
        raise ValueError(f"{what}[{key!r}] must be a positive finite number of seconds, got {v!r}")
    return float(v)


def field_str(d: Mapping[str, Any], key: str, what: str) -> str:
    v = d[key]
    if not isinstance(v, str) or not v:
        raise ValueError(f"{what}[{key!r}] must be a non-empty str, got {type(v).__name__} {v!r}")
    return v


def field_list(d: Mapping[str, Any], key: str, what: str) -> Sequence[Any]:
    v = d[key]
    if not isinstance(v, list | tuple):
        raise ValueError(f"{what}[{key!r}] must be a list, got {type(v).__name__}")
    return v


_R = TypeVar("_R")


def parse_request(cls: type[_R], obj: object, what: str) -> _R:
    """``cls(**obj)`` as vLLM builds its request dataclasses (``distributed/weight_transfer/base.py:440-470``,
    ``TypeError`` -> ``ValueError``), after checking that ``obj`` is a dict with str keys that names every
    required field of ``cls`` and no unknown one (weightsync's messages name the field)."""
    d = require_mapping(obj, what)
    fields = [f for f in dataclasses.fields(cls) if f.init]  # type: ignore[arg-type]
    required = [
        f.name
        for f in fields
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    ]
    check_fields(d, what, required, [f.name for f in fields if f.name not in required])
    try:
        return cls(**d)
    except TypeError as exc:
        raise ValueError(f"{what}: {exc}") from exc


def request_dict(obj: Any, always: Sequence[str]) -> dict[str, Any]:
    """The request dict of dataclass ``obj``: the fields in ``always`` unless None, every other field only
    when it differs from its default (so with weightsync's extras at their defaults the dict is vLLM's)."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(obj):
        if not f.init:
            continue
        v = getattr(obj, f.name)
        if f.name in always:
            if v is not None:
                out[f.name] = v
        elif f.default is dataclasses.MISSING or v != f.default:
            out[f.name] = v
    return out


__all__ = [
    "check_fields",
    "field_bool",
    "field_int",
    "field_list",
    "field_seconds",
    "field_str",
    "parse_request",
    "request_dict",
    "require_mapping",
]
