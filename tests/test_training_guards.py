"""Guards of a training run. A gradient norm that is NaN or Inf is never applied: --on-nan stop ends the run on every
rank with the step, the rank and the first parameter whose gradient is not finite, and no checkpoint after the bad
step; --on-nan skip skips that step and trains on. --spike-factor logs a loss spike with the step's samples."""

import math
import os

import pytest

from tensorpar.checkpoints.sharded import step_folder
from tensorpar.errors import TensorparError
from tensorpar.training import TrainOptions

import layout_runs
from harness import train

POISONED = "layers.1.mlp.down_proj.weight"
BAD_STEP = 3


def check_nan_in_one_ranks_gradient(save, on_nan, dtype, out_dir=None, async_save=False):
    """Train tiny at TP 2, one micro-batch per step, with a NaN put into rank 1's shard of POISONED's gradient at
    step BAD_STEP (a hook of this test); the history, or the error every rank raised."""
    import tensorpar.training.session as session

    build = session.build_model

    def poisoned(run, mesh):
        model, tokenizer = build(run, mesh)
        if mesh.rank == 1:
            backward_passes = [0]

            def hook(grad):
                backward_passes[0] += 1
                return grad * float("nan") if backward_passes[0] == BAD_STEP else grad

            dict(model.named_parameters())[POISONED].register_hook(hook)
        return model, tokenizer

    session.build_model = poisoned
    settings = {**layout_runs.BASE, "global_batch_size": 2, "micro_batch_size": 2, "return_state": False,
                "save": save, "save_every": 1, "on_nan": on_nan, "dtype": dtype, "tp": 2,
                "out_dir": out_dir, "dump_collectives_on_exit": out_dir is not None, "async_save": async_save}
    try:
        summary = train(TrainOptions(model="tiny", **settings))
        return {"history": [(r["step"], r["loss"], r["grad_norm"], r.get("skipped")) for r in summary["history"]]}
    except TensorparError as e:
        return {"error": str(e)}
    finally:
        session.build_model = build


@pytest.mark.parametrize("async_save", [False, True])
def test_a_nan_gradient_stops_the_run_naming_step_rank_and_parameter(pools, tmp_path, async_save):
    """With --async-save the save of the step before, still pending when the bad step stops the run, is committed
    first: `latest` names it, as after a blocking save."""
    save = str(tmp_path / "ckpt")
    results = pools(2).run(check_nan_in_one_ranks_gradient, save, "stop", "fp32", None, async_save)
    errors = [r.get("error") for r in results]
    assert errors[0] is not None and errors[0] == errors[1], results  # every rank stops, with the same line
    assert f"step {BAD_STEP}: the gradient norm is nan" in errors[0]
    assert f"rank 1: {POISONED}" in errors[0] and "rank 0:" not in errors[0]
    assert "was not applied" in errors[0]
    with open(os.path.join(save, "latest")) as f:
        assert f.read().strip() == os.path.basename(step_folder(save, BAD_STEP - 1))
    assert not os.path.exists(step_folder(save, BAD_STEP))


def test_on_nan_skip_skips_the_step_and_trains_on(pools, tmp_path):
    """bf16: the fp32 master weights' pieces are where the non-finite gradient is found. With
    --dump-collectives-on-exit both ranks write their flight records at the end, and they agree."""
    from tensorpar.distributed.flight_diagnosis import diagnose, load_records

    results = pools(2).run(check_nan_in_one_ranks_gradient, str(tmp_path / "ckpt"), "skip", "bf16",
                           str(tmp_path / "run"))
    records = load_records(str(tmp_path / "run"))
    assert sorted(records) == [0, 1] and records[0]["reason"] == "the run ended"
    assert "Every recorded collective completed" in diagnose(records)
    history = results[0]["history"]
    assert repr(results[1]["history"]) == repr(history)  # the same on both ranks (repr: nan compares unequal)
    assert [step for step, *_ in history] == [1, 2, 3, 4]
    for step, loss, norm, skipped in history:
        if step == BAD_STEP:
            assert math.isnan(norm) and skipped is True, history
        else:
            assert math.isfinite(norm) and skipped is None, history
        assert math.isfinite(loss), history
    assert history[BAD_STEP][1] < history[0][1]  # the steps after it still train


def check_spikes(spike_factor):
    """8 steps of tiny in one process: [(step, loss_spike flag)] and what the run wrote to stderr."""
    import contextlib
    import io

    err = io.StringIO()
    settings = {**layout_runs.BASE, "steps": 8, "global_batch_size": 2, "micro_batch_size": 2, "return_state": False,
                "spike_factor": spike_factor}
    with contextlib.redirect_stderr(err):
        summary = train(TrainOptions(model="tiny", **settings))
    return [(r["step"], r.get("loss_spike")) for r in summary["history"]], err.getvalue()


def test_a_loss_spike_is_logged_with_the_samples_of_its_step(pools):
    """A factor of 0.5 makes every step a "spike" once 5 steps are known (the loss falls, but not by half): each is
    flagged in the metrics and logged with its step and its two samples' window indices; a factor of 100 none."""
    flagged, log = pools(1).run(check_spikes, 0.5)[0]
    assert flagged == [(step, True if step > 5 else None) for step in range(1, 9)]
    lines = [line for line in log.splitlines() if "loss spike" in line]
    assert [line.split("loss spike at step ")[1].split(":")[0] for line in lines] == ["6", "7", "8"]
    windows = [line.split("its samples: windows [")[1].split("]")[0].split(", ") for line in lines]
    assert all(len(w) == 2 and all(i.isdigit() for i in w) for w in windows), lines
    flagged, log = pools(1).run(check_spikes, 100.0)[0]
    assert all(flag is None for _, flag in flagged) and "loss spike" not in log


def test_a_negative_spike_factor_is_refused():
    with pytest.raises(TensorparError, match="--spike-factor must be 0 \\(off\\) or positive, got -1.0"):
        train(TrainOptions(model="tiny", steps=3, spike_factor=-1.0))
