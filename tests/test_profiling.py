"""--profile-steps: one torch.profiler trace per rank, with tensorpar's collectives and pipeline actions named."""

import collections
import gzip
import json

import pytest

from tensorpar.errors import TensorparError
from tensorpar.training import TrainOptions

import layout_runs
from harness import train


def check_profiled_run(out_dir):
    """3 steps of TP 2 x PP 2 with steps 2 and 3 profiled: the collectives the run counted, per (op, group)."""
    settings = {**layout_runs.BASE, "steps": 3, "return_state": False, "tp": 2, "pp": 2, "micro_batch_size": 2,
                "out_dir": out_dir, "profile_steps": "2:3"}
    summary = train(TrainOptions(model="tiny", **settings))
    return {key: calls for key, (calls, _) in summary["comm"].items()}


def _ranges(path):
    with gzip.open(path, "rt") as f:
        events = json.load(f)["traceEvents"]
    return collections.Counter(e["name"] for e in events if e.get("ph") == "X")


def test_profile_steps_write_one_trace_per_rank_with_the_collectives_it_counted(pools, tmp_path):
    counted = pools(4).run(check_profiled_run, str(tmp_path / "run"))
    for rank, calls in enumerate(counted):
        ranges = _ranges(tmp_path / "run" / "profile" / f"rank{rank}.json.gz")
        for op_group in ("all_reduce/tp", "send/pp", "recv/pp"):
            # The three steps make the same collectives: two of them were profiled.
            assert ranges[op_group] == calls[op_group] * 2 // 3 > 0, (rank, op_group, ranges[op_group], calls)
        assert sum(n for name, n in ranges.items() if name.startswith("pipeline F ")) == 2 * 4  # 4 micro-batches


def test_profile_options_are_checked():
    with pytest.raises(TensorparError, match="A:B"):
        train(TrainOptions(model="tiny", steps=3, profile_steps="2-3", out_dir="x"))
    with pytest.raises(TensorparError, match="1 <= A <= B"):
        train(TrainOptions(model="tiny", steps=3, profile_steps="2:4", out_dir="x"))
    with pytest.raises(TensorparError, match="give --out-dir"):
        train(TrainOptions(model="tiny", steps=3, profile_steps="2:3"))
    with pytest.raises(TensorparError, match="the ranks of this run are 0 to 0"):
        train(TrainOptions(model="tiny", steps=3, profile_steps="2:3", profile_ranks="0,5", out_dir="x"))


def test_a_resumed_run_profiles_the_steps_of_the_range_it_trains(tmp_path):
    """Resumed at step 4 with --profile-steps 3:5: step 5 is traced (the range's first step is never run); a range
    wholly before the resumed step is named in a warning, as no trace is written."""
    import types

    import torch

    from tensorpar.distributed.comm import CommStats
    from tensorpar.training.profiling import StepProfiler, resumed_past_profile_note

    options = types.SimpleNamespace(profile_steps="3:5", profile_ranks=None, steps=6, out_dir=str(tmp_path))
    mesh = types.SimpleNamespace(rank=0, world_size=1, stats=CommStats(), device=torch.device("cpu"))
    profiler = StepProfiler(options, mesh)
    for step in range(4, 6):  # 0-based: 1-based steps 5 and 6
        profiler.begin(step)
        torch.ones(4) @ torch.ones(4)
        profiler.end(step)
    assert (tmp_path / "profile" / "rank0.json.gz").exists() and profiler._profile is None
    assert resumed_past_profile_note(options, {"step": 4}) == []
    assert resumed_past_profile_note(options, None) == []
    note = resumed_past_profile_note(options, {"step": 5})
    assert note == ["warning: --profile-steps 3:5 ends before step 6, where this resumed run starts: no profile is "
                    "written"]
