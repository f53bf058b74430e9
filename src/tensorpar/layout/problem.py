"""A reason a layout cannot run, as the trainer raises it and the planner records it."""

from __future__ import annotations

from typing import NamedTuple

from tensorpar.errors import LayoutError


class Problem(NamedTuple):
    """Why a layout cannot run (`reason`: what the planner records for an infeasible layout) and what would
    (`remedy`: valid values, a way out). The trainer's one-line error is ``"reason; remedy"``."""

    reason: str
    remedy: str = ""

    def __str__(self) -> str:
        return f"{self.reason}; {self.remedy}" if self.remedy else self.reason


def require(problem: Problem | None) -> None:
    """Raise `problem` as a LayoutError (nothing when it is None)."""
    if problem is not None:
        raise LayoutError(str(problem))


def divisibility(numerator: int, denominator: int, what: str, dimension: str = "tensor-parallel",
                 short: str = "TP") -> Problem | None:
    """Why `numerator` cannot be split over `denominator` ranks of `dimension` (naming `what` and the sizes that
    would divide it), or None."""
    if numerator % denominator == 0:
        return None
    valid = [d for d in range(1, numerator + 1) if numerator % d == 0 and d <= 64]
    return Problem(f"{what} = {numerator} is not divisible by the {dimension} size {denominator}",
                   f"{short} sizes that divide it: {valid}")


def divide(numerator: int, denominator: int, what: str, dimension: str = "tensor-parallel", short: str = "TP") -> int:
    """numerator / denominator, or a LayoutError naming `what`, the `dimension` split over and its valid sizes."""
    require(divisibility(numerator, denominator, what, dimension, short))
    return numerator // denominator
