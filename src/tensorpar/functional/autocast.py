"""Autocast queries that also hold on the meta device (`tensorpar train --dry-run` builds and runs the model there,
where torch.autocast has no dispatch key): no autocast is ever on for meta tensors."""

from __future__ import annotations

import contextlib

import torch


def autocast_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype a matmul on `x` runs in: autocast's where it is on for x's device, else x's."""
    kind = x.device.type
    if kind == "meta" or not torch.is_autocast_enabled(kind):
        return x.dtype
    return torch.get_autocast_dtype(kind)


def without_autocast(device_type: str):
    """A context with autocast off on `device_type` (nothing to turn off on meta)."""
    if device_type == "meta":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device_type, enabled=False)
