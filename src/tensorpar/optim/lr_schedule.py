"""Learning-rate schedule: linear warmup, then cosine decay to a floor. Pure functions, no communication."""

from __future__ import annotations

import math

import torch

from tensorpar.errors import TensorparError


def _check(step, max_lr, min_lr, warmup_steps, total_steps) -> None:
    for name, value in (("step", step), ("warmup_steps", warmup_steps), ("total_steps", total_steps)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TensorparError(f"lr_at: {name} must be an integer, got {value!r}")
    for name, value in (("step", step), ("warmup_steps", warmup_steps), ("max_lr", max_lr), ("min_lr", min_lr)):
        if not value >= 0:  # also refuses NaN
            raise TensorparError(f"lr_at: {name} must be >= 0, got {value!r}")
    if total_steps < 1:
        raise TensorparError(f"lr_at: total_steps must be >= 1, got {total_steps}")
    if min_lr > max_lr:
        raise TensorparError(f"lr_at: min_lr ({min_lr}) must not exceed max_lr ({max_lr})")
    if warmup_steps > total_steps:
        raise TensorparError(f"lr_at: warmup_steps ({warmup_steps}) must not exceed total_steps ({total_steps})")


def lr_at(step: int, *, max_lr: float, min_lr: float, warmup_steps: int, total_steps: int) -> float:
    """The learning rate at 0-based `step`.

    - Warmup, ``step < warmup_steps``: ``max_lr * (step + 1) / warmup_steps``, so step 0 has
      ``max_lr / warmup_steps`` and step ``warmup_steps - 1`` has ``max_lr``.
    - Cosine decay from ``max_lr`` at the peak step ``p = max(warmup_steps - 1, 0)`` to ``min_lr``
      at step ``total_steps - 1``: ``min_lr + (max_lr - min_lr) * (1 + cos(pi * t)) / 2`` with
      ``t = (step - p) / (total_steps - 1 - p)``; ``min_lr`` from then on.

    ``warmup_steps=0`` means no warmup (step 0 has ``max_lr``; the same schedule as
    ``warmup_steps=1``). Raises TensorparError for negative values, ``min_lr > max_lr``,
    ``total_steps < 1`` or ``warmup_steps > total_steps``.
    """
    _check(step, max_lr, min_lr, warmup_steps, total_steps)
    if step < warmup_steps:
        return max_lr * (step + 1) / warmup_steps
    peak = max(warmup_steps - 1, 0)
    last = total_steps - 1
    if step >= last:
        return float(min_lr)
    t = (step - peak) / (last - peak)
    return min_lr + (max_lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * t))


def set_lr(optimizer, lr: float) -> None:
    """Set the learning rate of every parameter group of `optimizer` to `lr`."""
    if not lr >= 0:
        raise TensorparError(f"set_lr: lr must be >= 0, got {lr!r}")
    for group in optimizer.param_groups:
        group["lr"] = lr
