"""The flight recorder of collectives (distributed/flight_recorder.py) and `tensorpar diagnose`
(distributed/flight_diagnosis.py): what each rank records, and what the records say read together."""

import json

import pytest
import torch

from tensorpar.distributed.flight_diagnosis import diagnose, load_records, mismatches, stuck
from tensorpar.distributed.flight_recorder import FORMAT, FlightRecorder
from tensorpar.errors import TensorparError

from harness import mesh


def check_records_of_real_collectives(folder):
    """Three collectives on a 2-rank TP group (one asynchronous), then the record written: what it holds (an
    all-gather counts its gathered output, as CommStats does)."""
    m = mesh(tp=2)
    flight = m.stats.flight
    flight.folder, before = folder, dict(flight.sequence)
    m.tp_group.all_reduce(torch.ones(4))
    m.tp_group.all_gather_async(torch.empty(6), torch.ones(3)).wait()
    m.tp_group.all_reduce(torch.ones(2, dtype=torch.float64), op="max")
    path = flight.dump("a test")
    flight.folder = None
    start = before.get("tp", 0)
    return path, [(e["seq"] - start, e["op"], e["elements"], e["dtype"], e["state"])
                  for e in list(flight.entries)[-3:]]


def test_every_rank_records_the_same_numbered_collectives(pools, tmp_path):
    results = pools(2).run(check_records_of_real_collectives, str(tmp_path))
    assert results[0][1] == results[1][1] == [(1, "all_reduce", 4, "torch.float32", "completed"),
                                              (2, "all_gather", 6, "torch.float32", "completed"),
                                              (3, "all_reduce", 2, "torch.float64", "completed")]
    records = load_records(str(tmp_path))
    assert sorted(records) == [0, 1] and records[1]["reason"] == "a test" and records[0]["world_size"] == 2
    assert "Every recorded collective completed" in diagnose(records)


def test_the_recorder_keeps_the_last_entries_and_writes_nowhere_without_a_folder():
    flight = FlightRecorder(capacity=3)
    for i in range(5):
        flight.end(flight.start("tp", [0, 1], "all_reduce", i, "torch.float32"))
    assert [e["seq"] for e in flight.entries] == [3, 4, 5] and flight.dump("no folder") is None


def _record(rank, world, entries, reason="a collective failed"):
    full = [{"group": "tp", "ranks": [0, 1, 2], "dtype": "torch.float32", "start": 0.0, "end": 1.0,
             "state": "completed", **e} for e in entries]
    return {"format": FORMAT, "rank": rank, "world_size": world, "pid": 1, "reason": reason, "time": 0.0,
            "entries": full}


def test_diagnose_names_the_rank_behind_and_the_collective_the_others_waited_in():
    ar = dict(op="all_reduce", elements=8)
    records = {0: _record(0, 4, [dict(seq=6, **ar), dict(seq=7, state="failed", **ar)]),
               1: _record(1, 4, [dict(seq=6, **ar), dict(seq=7, state="failed", **ar)]),
               2: _record(2, 4, [dict(seq=6, **ar)], reason="stopped by SIGTERM")}
    records[1]["reason"] = "rank 1: all_reduce #7 on group 'tp' timed out"  # a collective's error names its rank
    said = diagnose(records)
    assert said.startswith("Rank 3 left no flight record")
    assert ("Rank 0 (failed) and rank 1 (failed) waited in all_reduce #7 on group 'tp' (ranks [0, 1, 2]; 8 float32 "
            "elements); rank 2 never started it (its record of that group ends at #6).") in said
    assert "rank 2: stopped by SIGTERM" in said and "; rank 1: all_reduce #7 on group 'tp' timed out;" in said
    assert mismatches(records) == []


def test_diagnose_leaves_out_a_record_an_earlier_run_left_in_the_folder():
    """A run stopped (every rank writes), then resumed into the same OUT_DIR, where rank 1 hangs: rank 1's file is the
    stopped run's, written before this run started; it is left out and rank 1 named as having left none."""
    ar = dict(op="all_reduce", elements=8)
    old = _record(1, 2, [dict(seq=s, ranks=[0, 1], **ar) for s in range(1, 40)], reason="stopped by SIGTERM")
    new = _record(0, 2, [dict(seq=1, ranks=[0, 1], **ar), dict(seq=2, ranks=[0, 1], state="failed", **ar)])
    old.update(started=100.0, time=160.0)
    new.update(started=200.0, time=230.0)
    said = diagnose({0: new, 1: old})
    assert said.startswith("Rank 1 left no flight record")
    assert "waited in all_reduce #2 on group 'tp' (ranks [0, 1]; 8 float32 elements); rank 1 left no record." in said
    assert "Left out: the record of rank 1, written before the newest run's ranks started" in said
    assert "disagree" not in said and "never started" not in said
    old.update(world_size=4)  # an earlier run at another world size: only this run's ranks can be missing
    assert diagnose({0: new, 1: old}).startswith("Rank 1 left no flight record")


def test_diagnose_names_a_mismatched_collective():
    """Rank 1 skipped an all-reduce: its #4 on the group is the all-gather the others ran as #5."""
    records = {0: _record(0, 2, [dict(seq=3, op="all_reduce", elements=8), dict(seq=4, op="all_reduce", elements=8)]),
               1: _record(1, 2, [dict(seq=3, op="all_reduce", elements=8), dict(seq=4, op="all_gather", elements=4,
                                                                                state="started")])}
    assert mismatches(records) == [
        "The ranks disagree about collective #4 on group 'tp' (ranks [0, 1, 2]): rank 0 all_reduce of 8 float32, "
        "rank 1 all_gather of 4 float32: a mismatched collective (the ranks ran different code there)."]
    assert len(stuck(records)) == 1 and "mismatched collective" in diagnose(records)


class MLPThatSkipsAnAllReduce(torch.nn.Module):
    """A test-only TP MLP (column- then row-parallel linear, the loss averaged over the group) whose rank `skipper`
    leaves out the row-parallel output's all-reduce: its next collective, the loss's (one number), meets the other
    rank's all-reduce of the activations."""

    def __init__(self, group, skipper):
        from tensorpar.layers import ColumnParallelLinear, RowParallelLinear

        super().__init__()
        torch.manual_seed(0)
        self.up = ColumnParallelLinear.from_dense(torch.nn.Linear(8, 16), group)
        self.down = RowParallelLinear.from_dense(torch.nn.Linear(16, 8), group)
        self.group, self.skips = group, group.rank == skipper

    def forward(self, x):
        h = self.up(x).relu()
        if self.skips:
            self.group.all_reduce = lambda t, op="sum": t  # this rank's bug: one all-reduce left out
        try:
            y = self.down(h)
        finally:
            self.group.__dict__.pop("all_reduce", None)
        return self.group.all_reduce(y.square().mean().reshape(1)) / self.group.size


def check_a_rank_that_skips_an_all_reduce(folder):
    """Run MLPThatSkipsAnAllReduce on a 2-rank group of its own, created under TORCH_DISTRIBUTED_DEBUG=DETAIL: PyTorch
    then compares each collective's operation, shapes and dtypes across the ranks before running it and raises on
    every rank (without it, gloo aborts the process that receives the larger message; NCCL waits until the timeout).
    The pool's own groups are not involved, and the group is destroyed after. Returns the error this rank raised."""
    from datetime import timedelta

    import torch.distributed as dist

    from tensorpar.distributed.comm import CommStats, Group
    from tensorpar.errors import CollectiveError

    level = dist.get_debug_level()
    dist.set_debug_level(dist.DebugLevel.DETAIL)
    try:
        pg = dist.new_group([0, 1], timeout=timedelta(seconds=20))
    finally:
        dist.set_debug_level(level)
    stats = CommStats()
    stats.flight.folder, stats.flight.rank, stats.flight.world_size = folder, dist.get_rank(), 2
    try:
        MLPThatSkipsAnAllReduce(Group("tp", [0, 1], pg, stats), skipper=1)(torch.ones(4, 8))
        return None
    except CollectiveError as e:
        return str(e)
    finally:
        dist.destroy_process_group(pg)


def test_a_rank_that_skips_an_all_reduce_is_named_as_a_mismatched_collective(pools, tmp_path):
    errors = pools(2).run(check_a_rank_that_skips_an_all_reduce, str(tmp_path))
    for rank, error in enumerate(errors):
        assert error and error.startswith(f"rank {rank}: all_reduce on group 'tp'"), errors
    records = load_records(str(tmp_path))
    assert sorted(records) == [0, 1]
    # Rank 0's first collective is the row-parallel all-reduce of [4, 8]; rank 1's, the loss's one number.
    assert mismatches(records) == [
        "The ranks disagree about collective #1 on group 'tp' (ranks [0, 1]): rank 0 all_reduce of 32 float32, "
        "rank 1 all_reduce of 1 float32: a mismatched collective (the ranks ran different code there)."]
    assert mismatches(records)[0] in diagnose(records)


def test_diagnose_refuses_a_folder_without_records(tmp_path, cli):
    with pytest.raises(TensorparError, match="no flight records"):
        load_records(str(tmp_path))
    with pytest.raises(TensorparError, match="is not a folder: give a run's OUT_DIR"):
        load_records(str(tmp_path / "no-such-run"))
    (tmp_path / "flight").mkdir()
    (tmp_path / "flight" / "rank0.json").write_text(json.dumps(_record(0, 1, [dict(seq=1, op="barrier",
                                                                                   elements=0)])))
    code, out, err = cli("diagnose", str(tmp_path))
    assert code == 0 and "Every recorded collective completed" in out, err


def test_point_to_point_transfers_are_numbered_apart_and_never_a_mismatch():
    """A pipeline's send on one rank is a recv on the other: numbered apart from the group's collectives."""
    flight = FlightRecorder()
    flight.start("pp", [0, 1], "send", 6, "torch.float32")
    assert flight.start("pp", [0, 1], "all_reduce", 1, "torch.float32")["seq"] == 1
    p2p = dict(p2p=True, elements=6)
    records = {0: _record(0, 2, [dict(seq=1, op="send", **p2p)]), 1: _record(1, 2, [dict(seq=1, op="recv", **p2p)])}
    assert mismatches(records) == [] and "Every recorded collective completed" in diagnose(records)


def test_a_pipeline_hang_is_one_sentence_naming_the_failed_transfer():
    """A pipeline rank's sends not yet waited for are counted, not each told: rank 0 failed in recv #5 with three
    sends still pending (what a real PP 2 hang leaves, 13 sends there)."""
    p2p = dict(p2p=True, elements=6, ranks=[0, 1], group="pp")
    entries = [dict(seq=1, op="send", **p2p), dict(seq=2, op="send", state="started", **p2p),
               dict(seq=3, op="send", state="started", **p2p), dict(seq=4, op="send", state="started", **p2p),
               dict(seq=5, op="recv", state="failed", **p2p)]
    said = diagnose({0: _record(0, 2, entries)})
    assert ("Rank 0 (failed) waited in a point-to-point recv on group 'pp' (ranks [0, 1]; 6 elements), with 3 more "
            "started and not completed.") in said
    assert said.count("point-to-point") == 1
