"""fp16 training's dynamic loss scaling: overflowing steps are skipped and the scale backs off, then grows; the
scale and the fp32 master weights survive a resume exactly."""

import math
import os

from tensorpar.optim.loss_scaler import DynamicLossScaler
from tensorpar.training import TrainOptions

from harness import train

BASE = dict(model="tiny", seed=3, global_batch_size=4, micro_batch_size=4, seq_len=32, lr=3e-3, warmup_steps=2,
            val_every=0, progress=False, metrics=None, out_dir=None, device="cpu", dtype="fp16")


def run(**overrides):
    summary = train(TrainOptions(**{**BASE, **overrides}))
    return summary["history"]


def test_the_scaler_backs_off_on_overflow_and_grows_after_a_window():
    s = DynamicLossScaler(1024.0, growth_interval=2)
    assert s.update(math.inf) and s.scale == 512.0
    assert s.update(math.nan) and s.scale == 256.0
    assert not s.update(1.0) and s.scale == 256.0
    assert not s.update(1.0) and s.scale == 512.0  # two good steps in a row
    restored = DynamicLossScaler()
    restored.load_state_dict(s.state_dict())
    assert (restored.scale, restored.good_steps) == (512.0, 0)


def _state(**overrides):
    return train(TrainOptions(**{**BASE, **overrides, "return_state": True}))["state"]


def test_an_overflowing_fp16_run_skips_those_steps_and_recovers(pools):
    history = pools(1).run(run, steps=24, loss_scale=2.0**32)[0]
    skipped = [r["skipped"] for r in history]
    assert skipped[0] and not any(skipped[-6:]), skipped
    assert sum(skipped) >= 12  # fp16 gradients overflow at least down to a scale of 2^20
    for r, nxt in zip(history, history[1:]):
        assert nxt["loss_scale"] == r["loss_scale"] * (0.5 if r["skipped"] else 1.0)
        assert math.isfinite(r["grad_norm"]) != r["skipped"]
    good = history[sum(skipped):]
    assert all(not r["skipped"] for r in good)  # once it fits, it stays
    assert good[-1]["loss"] < good[0]["loss"] - 0.3


def test_skipped_steps_leave_the_weights_alone(pools):
    all_skipped = pools(1).run(_state, steps=3, warmup_steps=0, loss_scale=2.0**40)[0]
    untouched = pools(1).run(_state, steps=1, warmup_steps=0, lr=0.0)[0]
    for name, w in untouched.items():
        assert (all_skipped[name] == w).all(), name


def test_the_loss_scale_and_the_master_weights_survive_a_resume(pools, tmp_path):
    kw = dict(steps=8, loss_scale=2.0**8, loss_scale_window=3)
    straight = pools(1).run(run, **kw)[0]
    assert straight[-1]["loss_scale"] > 2.0**8  # it grew during the run
    save = str(tmp_path / "ckpt")
    pools(2).run(run, **kw, stop_after=4, save=save, dp=2, zero=1, micro_batch_size=2)
    resumed = pools(1).run(run, **kw, resume=os.path.join(save, "step-000004"))[0]
    assert [r["loss_scale"] for r in resumed] == [r["loss_scale"] for r in straight[4:]]
    for r, ref in zip(resumed, straight[4:]):
        assert abs(r["loss"] - ref["loss"]) <= 1e-4 * ref["loss"], (r, ref)


def _summary_line(**overrides):
    import contextlib
    import io

    from tensorpar.commands.train import print_summary

    summary = train(TrainOptions(**{**BASE, **overrides}))
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        print_summary(summary)
    return summary, out.getvalue()


def test_the_summary_says_how_many_steps_were_skipped(pools):
    """A run whose every step overflowed says so (its summary looked like a normal run's before)."""
    summary, text = pools(1).run(_summary_line, steps=3, warmup_steps=0, loss_scale=2.0**40)[0]
    assert summary["skipped_steps"] == 3 and summary["final_loss_scale"] == 2.0**38
    assert "skipped 3 of 3 steps (non-finite gradients: weights left unchanged); loss scale 2.74878e+11" in text
    summary, text = pools(1).run(_summary_line, steps=2)[0]
    assert summary["skipped_steps"] == 0 and "skipped" not in text
