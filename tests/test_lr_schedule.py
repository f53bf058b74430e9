"""The learning-rate schedule: linear warmup, cosine decay to a floor."""

import math

import pytest
from torch import nn

from tensorpar.errors import TensorparError
from tensorpar.optim import build_optimizer, lr_at, set_lr

SCHED = dict(max_lr=1.0, min_lr=0.1, warmup_steps=5, total_steps=15)  # peak at step 4, floor at step 14


def test_lr_warmup_is_linear_from_max_over_warmup_to_max():
    assert lr_at(0, **SCHED) == pytest.approx(1.0 / 5)
    assert lr_at(2, **SCHED) == pytest.approx(3.0 / 5)
    assert lr_at(4, **SCHED) == pytest.approx(1.0)  # step warmup_steps - 1


def test_lr_cosine_midpoint_end_and_after():
    assert lr_at(9, **SCHED) == pytest.approx((1.0 + 0.1) / 2)  # halfway between step 4 and step 14
    assert lr_at(14, **SCHED) == pytest.approx(0.1)
    assert lr_at(15, **SCHED) == 0.1 and lr_at(1000, **SCHED) == 0.1
    lrs = [lr_at(s, **SCHED) for s in range(4, 15)]
    assert all(a > b for a, b in zip(lrs, lrs[1:])), "cosine decay must be strictly decreasing"


def test_lr_without_warmup_starts_at_max():
    sched = dict(max_lr=2.0, min_lr=0.0, warmup_steps=0, total_steps=11)
    assert lr_at(0, **sched) == pytest.approx(2.0)
    assert lr_at(5, **sched) == pytest.approx(1.0)
    assert lr_at(10, **sched) == pytest.approx(0.0)
    # on a schedule of 9 steps (0..8) step 2 is a quarter of the way: max * (1 + cos(pi/4)) / 2
    quarter = 0.5 * 2.0 * (1 + math.cos(math.pi / 4))
    assert lr_at(2, max_lr=2.0, min_lr=0.0, warmup_steps=0, total_steps=9) == pytest.approx(quarter)
    assert lr_at(2, **dict(sched, warmup_steps=1)) == lr_at(2, **sched)  # warmup 1 == no warmup


@pytest.mark.parametrize(
    "kwargs, words",
    [
        (dict(step=-1), "step must be >= 0"),
        (dict(max_lr=-1.0, min_lr=-2.0), "max_lr must be >= 0"),
        (dict(min_lr=-0.1), "min_lr must be >= 0"),
        (dict(warmup_steps=-3), "warmup_steps must be >= 0"),
        (dict(min_lr=2.0), "min_lr (2.0) must not exceed max_lr (1.0)"),
        (dict(total_steps=0), "total_steps must be >= 1"),
        (dict(warmup_steps=20), "warmup_steps (20) must not exceed total_steps (15)"),
        (dict(step=1.5), "step must be an integer"),
    ],
)
def test_lr_at_refuses_bad_arguments(kwargs, words):
    args = dict(SCHED, step=0)
    args.update(kwargs)
    step = args.pop("step")
    with pytest.raises(TensorparError) as e:
        lr_at(step, **args)
    assert words in str(e.value)


def test_set_lr_sets_every_group():
    opt = build_optimizer(nn.Linear(3, 2), lr=1.0, weight_decay=0.1)
    set_lr(opt, lr_at(0, **SCHED))
    assert [g["lr"] for g in opt.param_groups] == [pytest.approx(0.2)] * 2
    with pytest.raises(TensorparError):
        set_lr(opt, -1.0)
