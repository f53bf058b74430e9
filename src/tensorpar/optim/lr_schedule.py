"""Learning-rate schedules: linear warmup, then cosine decay to a floor (`lr_at`), or warmup-stable-decay (`wsd_lr_at`:
the peak held, then a decay over the last steps). Pure functions of the step, no communication: a resumed run
continues its schedule where it stopped."""

from __future__ import annotations

import math

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


def wsd_decay_steps(total_steps: int, decay_fraction: float) -> int:
    """The steps of a WSD decay: `decay_fraction` of the run, rounded."""
    return round(decay_fraction * total_steps)


def check_wsd(total_steps: int, warmup_steps: int, decay_fraction: float) -> None:
    """TensorparError unless the fraction lies in [0, 1] and warmup and decay fit in the run."""
    if not 0.0 <= decay_fraction <= 1.0:
        raise TensorparError(f"--decay-fraction must lie between 0 and 1 (a share of --steps), got {decay_fraction}")
    decay = wsd_decay_steps(total_steps, decay_fraction)
    if warmup_steps + decay > total_steps:
        raise TensorparError(f"--lr-schedule wsd: {warmup_steps} warmup steps and {decay} decay steps "
                             f"(--decay-fraction {decay_fraction} of {total_steps}) do not fit in --steps "
                             f"{total_steps}: lower --warmup-steps or --decay-fraction")


_DECAY_SHAPES = {
    "linear": lambda t: 1.0 - t,
    "cosine": lambda t: 0.5 * (1.0 + math.cos(math.pi * t)),
    "1-sqrt": lambda t: 1.0 - math.sqrt(t),
}


def wsd_lr_at(step: int, *, max_lr: float, min_lr: float, warmup_steps: int, total_steps: int, decay_steps: int,
              shape: str = "1-sqrt") -> float:
    """The learning rate at 0-based `step` of warmup-stable-decay (MiniCPM's WSD; torchtitan's and Megatron's).

    - Warmup, ``step < warmup_steps``: as `lr_at`'s, ``max_lr * (step + 1) / warmup_steps``.
    - Stable: ``max_lr`` up to the decay's start ``s = total_steps - decay_steps``.
    - Decay, ``step >= s``: ``min_lr + (max_lr - min_lr) * f(t)`` with ``t = (step - s + 1) / decay_steps``, so
      that step ``total_steps - 1`` has ``min_lr``; ``f(t)`` is ``1 - t`` (linear), ``(1 + cos(pi t)) / 2``
      (cosine) or ``1 - sqrt(t)`` (1-sqrt). ``min_lr`` from then on.
    """
    _check(step, max_lr, min_lr, warmup_steps, total_steps)
    if shape not in _DECAY_SHAPES:
        raise TensorparError(f"wsd_lr_at: shape must be one of {sorted(_DECAY_SHAPES)}, got {shape!r}")
    if not 0 <= decay_steps <= total_steps - warmup_steps:
        raise TensorparError(f"wsd_lr_at: decay_steps must lie in [0, {total_steps - warmup_steps}], got {decay_steps}")
    if step < warmup_steps:
        return max_lr * (step + 1) / warmup_steps
    start = total_steps - decay_steps
    if step < start:
        return float(max_lr)
    t = min((step - start + 1) / decay_steps, 1.0)
    return min_lr + (max_lr - min_lr) * _DECAY_SHAPES[shape](t)


def run_lr(options, step: int) -> float:
    """The learning rate of 0-based `step` of a training run (resolved TrainOptions: min_lr and warmup_steps set)."""
    o = options
    kw = dict(max_lr=o.lr, min_lr=o.min_lr, warmup_steps=o.warmup_steps, total_steps=o.steps)
    if o.lr_schedule == "wsd":
        return wsd_lr_at(step, **kw, decay_steps=wsd_decay_steps(o.steps, o.decay_fraction), shape=o.decay_shape)
    return lr_at(step, **kw)


def set_lr(optimizer, lr: float) -> None:
    """Set the learning rate of every parameter group of `optimizer` to `lr`."""
    if not lr >= 0:
        raise TensorparError(f"set_lr: lr must be >= 0, got {lr!r}")
    for group in optimizer.param_groups:
        group["lr"] = lr
