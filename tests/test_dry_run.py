"""`tensorpar train --dry-run`: one rank of a world of thousands, built for real on the meta device with a fake
process group; its parameter, gradient and optimizer bytes against the planner's at published layouts."""

import pytest

from tensorpar.commands.dry_run_report import planned_bytes
from tensorpar.training import TrainOptions, validate
from tensorpar.training.dry_run import dry_run

# Llama 3 405B as Meta trained it (TP 8, PP 16 with 7-layer first and last stages, 16,384 GPUs, 8K sequences);
# Mixtral 8x7B with EP 8 folded over DP at 512 ranks, ZeRO-1.
CASES = {
    "llama-405b-16384": dict(model="llama-405b", tp=8, pp=16, pipeline_layers="7" + ",8" * 14 + ",7", zero=1,
                             sequence_parallel=True, dtype="bf16", seq_len=8192, global_batch_size=2048,
                             micro_batch_size=1, recompute="full", world_size=16384),
    "mixtral-ep8-512": dict(model="mixtral-8x7b", tp=2, pp=4, ep=8, zero=1, sequence_parallel=True, dtype="bf16",
                            seq_len=4096, global_batch_size=256, micro_batch_size=1, recompute="full",
                            world_size=512),
}


@pytest.mark.parametrize("name,rank", [("llama-405b-16384", 0), ("llama-405b-16384", 16383),
                                       ("mixtral-ep8-512", 300)])
def test_a_rank_of_a_large_world_holds_the_bytes_the_planner_predicts(name, rank):
    kw = dict(CASES[name])
    run = validate(TrainOptions(**{**kw, "progress": False}), kw.pop("world_size"))
    result = dry_run(run, rank)
    planned = planned_bytes(run, result)
    assert result["layout"]["rank"] == rank and result["parameter_count"] > 0
    for key in ("parameter_bytes", "gradient_bytes"):  # the planner counts these to the byte
        assert result[key] == planned[key], (key, result[key], planned[key])
    # AdamW's step counters: one 4-byte tensor per parameter tensor in the planner, per master slice in the run
    assert abs(result["optimizer_bytes"] - planned["optimizer_bytes"]) <= 1e-5 * planned["optimizer_bytes"]
    ops = {(c["op"], c["group"]) for c in result["collectives"]}
    assert ("reduce_scatter", "dp") in ops, ops  # ZeRO-1's gradient buckets
    if run.cfg.is_moe:  # the step's traffic only (no micro-batch): the experts' buckets over expert-DP
        assert ("reduce_scatter", "edp") in ops and ("all_gather", "tp") not in ops, ops
    else:  # SP's gathers and reduce-scatters of the micro-batch
        assert {("all_gather", "tp"), ("reduce_scatter", "tp")} <= ops, ops


def test_a_dry_run_of_a_rank_outside_the_world_or_a_layout_that_cannot_run_is_refused(cli):
    code, _, err = cli("train", "--model", "llama-8b", "--tp", "8", "--dry-run", "--world-size", "64", "--rank",
                       "64", "--global-batch-size", "64")
    assert code != 0 and "--rank 64 is not a rank of a world of 64" in err, err
    code, _, err = cli("train", "--model", "llama-8b", "--tp", "8", "--dry-run", "--world-size", "60")
    assert code != 0 and "60" in err, err
