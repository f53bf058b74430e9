"""The learning-rate schedules: linear warmup, cosine decay to a floor; warmup-stable-decay (WSD), whose resumed
run continues its decay."""

import math
import os

import pytest
from torch import nn

from tensorpar.errors import TensorparError
from tensorpar.optim import build_optimizer, lr_at, set_lr
from tensorpar.optim.lr_schedule import check_wsd, wsd_lr_at
from tensorpar.training import TrainOptions

from harness import train

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


WSD = dict(max_lr=1.0, min_lr=0.1, warmup_steps=2, total_steps=10, decay_steps=4)  # decay over steps 6..9


@pytest.mark.parametrize("shape,f", [("linear", lambda t: 1 - t), ("cosine", lambda t: (1 + math.cos(math.pi * t)) / 2),
                                     ("1-sqrt", lambda t: 1 - math.sqrt(t))])
def test_wsd_warms_up_holds_the_peak_then_decays_to_the_floor(shape, f):
    lrs = [wsd_lr_at(s, **WSD, shape=shape) for s in range(12)]
    assert lrs[:2] == [0.5, 1.0] and lrs[2:6] == [1.0] * 4  # warmup as lr_at's, then the peak held
    for step in range(6, 10):
        t = (step - 6 + 1) / 4
        assert lrs[step] == pytest.approx(0.1 + 0.9 * f(t))
    assert lrs[9] == pytest.approx(0.1) and lrs[10:] == [pytest.approx(0.1)] * 2
    assert all(a > b for a, b in zip(lrs[5:10], lrs[6:10])), "the decay must fall at every step"
    assert wsd_lr_at(7, **dict(WSD, decay_steps=0), shape=shape) == 1.0  # no decay: the peak to the end


def test_wsd_refuses_a_decay_that_does_not_fit():
    check_wsd(10, 2, 0.8)
    with pytest.raises(TensorparError, match="do not fit in --steps 10"):
        check_wsd(10, 3, 0.8)
    with pytest.raises(TensorparError, match="between 0 and 1"):
        check_wsd(10, 0, 1.5)


def _wsd_run(model, **overrides):
    options = dict(steps=10, seed=4, global_batch_size=4, seq_len=16, lr=3e-3, warmup_steps=2, val_fraction=0.0,
                   val_every=0, progress=False, metrics=None, out_dir=None, device="cpu", return_state=True,
                   lr_schedule="wsd", decay_fraction=0.4, decay_shape="cosine")
    summary = train(TrainOptions(model=model, **{**options, **overrides}))
    return [(r["step"], r["lr"], r["loss"]) for r in summary["history"]], summary["state"]


def test_a_wsd_run_resumed_mid_decay_matches_the_straight_run(pools, config_file, tmp_path):
    """Saved at step 7 of 10 (its decay runs over steps 7-10) and resumed: the same learning rates, losses and
    weights as the run that never stopped."""
    straight, weights = pools(1).run(_wsd_run, config_file)[0]
    save = str(tmp_path / "ckpt")
    pools(1).run(_wsd_run, config_file, save=save, stop_after=7)
    resumed, resumed_weights = pools(1).run(_wsd_run, config_file, resume=os.path.join(save, "step-000007"))[0]
    assert [(s, lr) for s, lr, _ in resumed] == [(s, lr) for s, lr, _ in straight[7:]]
    assert straight[5][1] == 3e-3 and straight[6][1] < 3e-3  # the resumed steps were in the decay
    for (_, _, loss), (_, _, loss_ref) in zip(resumed, straight[7:], strict=True):
        assert abs(loss - loss_ref) <= 1e-6 * loss_ref
    for name, ref in weights.items():
        assert (resumed_weights[name] - ref).norm() <= 1e-6 * ref.norm(), name
