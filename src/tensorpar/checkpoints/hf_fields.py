"""Reading Hugging Face config.json fields: each helper returns the value or raises a TensorparError naming
the field, its value and what would be valid."""

from __future__ import annotations

import math

from tensorpar.errors import TensorparError


def unsupported(field: str, value, why: str) -> TensorparError:
    return TensorparError(f"unsupported Hugging Face config: {field}={value!r} ({why})")


def positive_int(hf: dict, field: str, default=None) -> int:
    value = hf.get(field, default)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise unsupported(field, value, "expected a positive integer")
    return value


def positive_float(hf: dict, field: str, default=None) -> float:
    value = hf.get(field, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise unsupported(field, value, "expected a positive number")
    return float(value)


def boolean(hf: dict, field: str, default: bool) -> bool:
    value = hf.get(field, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise unsupported(field, value, "expected true or false")
    return value


def require(hf: dict, field: str, expected, default, why: str) -> None:
    value = hf.get(field, default)
    if value != expected:
        raise unsupported(field, value, why)


def non_negative_float(hf: dict, field: str, default: float) -> float:
    value = hf.get(field, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise unsupported(field, value, "expected a number >= 0")
    return float(value)
