"""End-to-end training: any TP/SP/CP/PP/DP/ZeRO layout follows the single-device loss and grad-norm trajectory and ends
with the single-device weights; recomputation exact, dropout reproducible, bf16/fp16 close to fp32.

Most comparisons take 4 steps (each step's loss and grad norm, then every weight); two canonical runs take 20 steps
(TP 2 + SP, and TP 2 x PP 2 x DP 2 with ZeRO-1) so that drift that only builds up over a longer run is caught.
"""

import json

import pytest

import layout_runs
from layout_runs import assert_same_training, reassociated, reference, run

# The tiny preset (4 layers, 2 KV heads) at seq 32; one micro-batch per DP rank unless accumulation is the point.
TINY = dict(seed=3, seq_len=32, micro_batch_size=None)


def _world(layout):
    return layout.get("tp", 1) * layout.get("cp", 1) * layout.get("pp", 1) * layout.get("dp", 1)


def _compare(pools, model, layout, tol=1e-4, floor=False, **settings):
    """Train `layout` (which may set its own micro-batch size) and one process with the same settings; assert the
    same training (`floor`: leaving out what float reassociation alone moves: `layout_runs.assert_same_training`)."""
    results = pools(_world(layout)).run(run, model, **{**settings, **layout})
    assert all(r["trajectory"] == results[0]["trajectory"] for r in results), "ranks disagree on the trajectory"
    assert_same_training(results, reference(pools, model, **settings), tol,
                         reassociated(pools, model, **settings) if floor else None)
    return results


TINY_LAYOUTS = [
    dict(tp=2),
    dict(tp=4),  # tiny has 2 KV heads: TP=4 replicates each on 2 ranks
    dict(tp=4, sequence_parallel=True, model="tiny-gpt2"),  # vocab 257 padded, tied, learned positions
    dict(tp=2, dp=2),
    dict(tp=2, dp=2, micro_batch_size=2),  # 2 micro-batches per DP rank
    dict(tp=2, dp=2, zero=1, sequence_parallel=True),
    dict(tp=1, dp=4, zero=2, micro_batch_size=1),  # 2 micro-batches per DP rank
    dict(cp=2),
    dict(cp=4),
    dict(cp=4, cp_impl="allgather", model="tiny-gpt2"),
    dict(tp=2, cp=2, sequence_parallel=True),  # 2 KV heads: one per TP rank
    dict(cp=2, dp=2, zero=1),
    dict(cp=2, pp=2, micro_batch_size=2),
    dict(dp=2, zero=3),
    dict(tp=2, dp=2, zero=3, sequence_parallel=True),
    dict(pp=2, dp=2, zero=3, micro_batch_size=2, model="tiny-gpt2"),  # tied embedding on both ends
    dict(dp=4, zero=3, micro_batch_size=1, zero3_reshard_after_forward=False),  # 2 micro-batches per rank
    dict(dp=2, zero=3, micro_batch_size=1, recompute="full"),  # 4 micro-batches per rank
]
TINY_IDS = ["tp2", "tp4", "tp4-sp-gpt2", "tp2-dp2", "tp2-dp2-accum", "tp2-sp-dp2-zero1", "dp4-zero2-accum",
            "cp2", "cp4", "cp4-allgather-gpt2", "tp2-cp2-sp", "cp2-dp2-zero1", "cp2-pp2", "dp2-zero3",
            "tp2-sp-dp2-zero3", "pp2-dp2-zero3-gpt2", "dp4-zero3-keep-params-accum2", "dp2-zero3-accum4-recompute"]


@pytest.mark.parametrize("layout", TINY_LAYOUTS, ids=TINY_IDS)
def test_layouts_follow_the_single_device_training(pools, layout):
    layout = dict(layout)
    _compare(pools, layout.pop("model", "tiny"), layout, **TINY)


# -- the canonical 20-step runs ------------------------------------------------------------------------------

# The settings of the trajectories this suite has compared at 20 steps from the start: two micro-batches of 4, and
# a validation split (each run ends with a validation loss).
TWENTY = dict(steps=20, warmup_steps=5, micro_batch_size=4, val_fraction=0.05)


def test_twenty_steps_of_tp2_sp_follow_the_single_device_training(pools):
    _compare(pools, "tiny", dict(tp=2, sequence_parallel=True), **{**TINY, **TWENTY})
    losses = [loss for loss, _ in reference(pools, "tiny", **{**TINY, **TWENTY})["trajectory"]]
    assert losses[-1] < losses[0] - 1.0, "the reference does not learn: a vacuous comparison"


def test_twenty_steps_of_3d_with_zero1_follow_the_single_device_training(pools):
    """TP 2 x PP 2 x DP 2 (8 ranks), 1F1B over 4 micro-batches per DP rank, ZeRO-1; the tiny preset's 4 layers, 2 per
    stage (8 layers cost this run a third more, in TP collectives on 8 processes, and prove nothing more)."""
    settings = dict(steps=20, warmup_steps=2)
    # A step where the gradient is sensitive moves with float reassociation alone (one process reordering its own
    # sums moved an 8-layer run's grad norm by 4.5e-5 at one step, 2e-7 elsewhere): `floor` leaves those out.
    _compare(pools, "tiny", dict(tp=2, pp=2, dp=2, schedule="1f1b", zero=1), floor=True, **settings)
    losses = [loss for loss, _ in reference(pools, "tiny", **settings)["trajectory"]]
    assert losses[-1] < losses[0] - 0.5, "the reference does not learn: a vacuous comparison"


# -- recomputation, dropout, precision ------------------------------------------------------------------------

def _trajectory(pools, world, **settings):
    results = pools(world).run(run, "tiny", **{**TINY, "return_state": False, **settings})
    assert all(r["trajectory"] == results[0]["trajectory"] for r in results), "ranks disagree on the trajectory"
    return results[0]


def test_recomputation_leaves_the_training_unchanged(pools):
    base = _trajectory(pools, 2, tp=2, return_state=True)
    for mode in ("selective", "full"):
        assert_same_training([_trajectory(pools, 2, tp=2, recompute=mode, return_state=True)], base, 1e-6)


def test_dropout_is_reproducible_from_the_seed_and_recomputable(pools):
    kw = dict(tp=2, sequence_parallel=True, steps=2, warmup_steps=1, dropout=0.1)
    first = _trajectory(pools, 2, **kw)["trajectory"]
    assert first == _trajectory(pools, 2, **kw)["trajectory"], "same seed, different run"
    assert first != _trajectory(pools, 2, **{**kw, "seed": 4})["trajectory"], "the seed does not reach the masks"
    assert first != _trajectory(pools, 2, **{**kw, "dropout": 0.0})["trajectory"], "dropout had no effect"
    # full recomputation replays the same masks: identical up to float reassociation
    recomputed = _trajectory(pools, 2, **kw, recompute="full")["trajectory"]
    for (loss, gn), (loss_ref, gn_ref) in zip(recomputed, first, strict=True):
        assert abs(loss - loss_ref) <= 1e-6 * loss_ref and abs(gn - gn_ref) <= 1e-6 * gn_ref


@pytest.mark.parametrize("layout", [dict(tp=2, dtype="bf16"), dict(dp=2, zero=1, dtype="fp16"),
                                    dict(dp=2, zero=3, dtype="bf16", grad_reduce_dtype="bf16"),
                                    dict(dp=2, dtype="bf16", grad_reduce_dtype="bf16"),
                                    dict(dp=2, zero=1, dtype="bf16", grad_reduce_dtype="bf16")],
                         ids=["bf16-tp2", "fp16-dp2-zero1", "bf16-dp2-zero3-bf16-reduce", "bf16-dp2-zero0-bf16-reduce",
                              "bf16-dp2-zero1-bf16-reduce"])
def test_low_precision_trains_close_to_fp32(pools, layout):
    """bf16/fp16 parameters with fp32 master weights follow the fp32 run closely over 20 steps and end within 2%;
    the first step's gradient norm (before the runs drift apart) within 5% of the fp32 run's: the low-precision
    gradients are averaged over DP like the fp32 ones."""
    fp32 = reference(pools, "tiny", **{**TINY, **TWENTY})["trajectory"]
    low = _trajectory(pools, 2, **{**TWENTY, **layout})["trajectory"]
    assert len(low) == len(fp32)
    assert abs(low[0][1] - fp32[0][1]) <= 0.05 * fp32[0][1], (low[0][1], fp32[0][1])
    for (loss, _), (loss_ref, _) in zip(low, fp32):
        assert abs(loss - loss_ref) <= 0.05 * loss_ref
    assert abs(low[-1][0] - fp32[-1][0]) <= 0.02 * fp32[-1][0]
    assert low[-1][0] < low[0][0] - 1.0


# -- pipeline, data and ZeRO layouts of the 8-layer config ----------------------------------------------------

LAYOUTS = [
    dict(tp=2, pp=2, schedule="afab", micro_batch_size=2),
    dict(tp=2, pp=2, schedule="1f1b", micro_batch_size=2),
    dict(tp=2, pp=2, schedule="interleaved", virtual_stages=2, sequence_parallel=True, micro_batch_size=2),
    dict(tp=1, pp=2, dp=2, schedule="1f1b", zero=0),
    dict(tp=1, pp=2, dp=2, schedule="afab", zero=1),
    dict(tp=1, pp=2, dp=2, schedule="interleaved", virtual_stages=2, zero=2),
    dict(tp=2, dp=2, zero=0, micro_batch_size=None),
    dict(tp=2, dp=2, zero=1, micro_batch_size=None),
    dict(tp=2, dp=2, zero=2, micro_batch_size=None),
    dict(pp=4, schedule="afab"),
    dict(pp=4, schedule="1f1b"),
    dict(pp=4, schedule="interleaved", virtual_stages=2),
    dict(dp=4, zero=0, micro_batch_size=None),
    dict(dp=4, zero=1, micro_batch_size=None),
    dict(dp=4, zero=2, micro_batch_size=1),  # 2 micro-batches per rank
]


def _id(layout):
    return "-".join(f"{k}{v}" if k != "schedule" else v for k, v in layout.items() if k != "micro_batch_size")


@pytest.mark.parametrize("layout", LAYOUTS, ids=[_id(lay) for lay in LAYOUTS])
def test_3d_layouts_train_like_one_process(pools, config_file, layout):
    """The pipeline layouts run 4 (TP 2: micro-batches of 2) or 8 micro-batches per step."""
    layout = {"tp": 1, "pp": 1, "dp": 4 // (layout.get("tp", 1) * layout.get("pp", 1)), **layout}
    _compare(pools, config_file, layout)


@pytest.mark.parametrize("layout", [dict(pipeline_layers="2,6", schedule="1f1b"),
                                    dict(pipeline_layers="6,2", schedule="afab", zero=1),
                                    dict(pipeline_layers="1,7", schedule="1f1b"),
                                    dict(pipeline_layers="1,3,3,1", schedule="interleaved", virtual_stages=2),
                                    dict(pipeline_layers="3,1,2,2", schedule="zbv")],
                         ids=["pp2-2.6-1f1b", "pp2-6.2-afab-zero1", "pp2-1.7-1f1b", "pp2-v2-1.3.3.1-interleaved",
                              "pp2-3.1.2.2-zbv"])
def test_uneven_pipeline_stages_train_like_one_process(pools, config_file, layout):
    """--pipeline-layers: the stages hold different numbers of the 8 layers; training is unchanged."""
    from tensorpar.layout import parse_pipeline_layers
    from tensorpar.planning.params import local_parameters

    layout = {"tp": 1, "pp": 2, "dp": 2, **layout}
    results = _compare(pools, config_file, layout)
    # The split is real: the stages' optimizer states are in the ratio of their planned parameters.
    split = tuple(parse_pipeline_layers(layout["pipeline_layers"]))
    planned = [sum(n for _, n, _ in local_parameters(layout_runs.CONFIG, 1, 2, s, layout.get("virtual_stages", 1),
                                                     pipeline_layers=split, schedule=layout["schedule"]))
               for s in (0, 1)]
    small, large = sorted({r["optimizer_state_bytes"] for r in results})
    assert small / large == pytest.approx(min(planned) / max(planned), rel=1e-3)


@pytest.fixture(scope="module")
def four_layers(tmp_path_factory):
    """A 4-layer TINY8 (for --pipeline-layers 1,3 and 3,1)."""
    config = layout_runs.CONFIG.replace(num_layers=4)
    path = tmp_path_factory.mktemp("cfg4") / "tiny4.json"
    path.write_text(json.dumps(config.to_dict()))
    return config, str(path)


@pytest.mark.parametrize("layout", [dict(pipeline_layers="1,3", schedule="1f1b", tp=2),
                                    dict(pipeline_layers="3,1", schedule="afab", dp=2, zero=1)],
                         ids=["pp2-1.3-1f1b-tp2", "pp2-3.1-afab-dp2-zero1"])
def test_one_and_three_layers_per_stage_train_like_one_process(pools, four_layers, layout):
    from tensorpar.layout import parse_pipeline_layers
    from tensorpar.planning.params import local_parameters

    config, path = four_layers
    layout = {"tp": 1, "pp": 2, "dp": 1, **layout}
    results = _compare(pools, path, layout)
    split = tuple(parse_pipeline_layers(layout["pipeline_layers"]))
    planned = [sum(n for _, n, _ in local_parameters(config, layout["tp"], 2, s, pipeline_layers=split))
               for s in (0, 1)]
    by_stage = {}
    for rank, r in enumerate(results):
        by_stage.setdefault(rank // (layout["tp"] * layout["dp"]), set()).add(r["optimizer_state_bytes"])
    per_stage = [by_stage[0].pop(), by_stage[1].pop()]
    assert per_stage[0] / per_stage[1] == pytest.approx(planned[0] / planned[1], rel=1e-3)


@pytest.mark.parametrize("layout", [dict(dp=4), dict(tp=2, dp=2, sequence_parallel=True), dict(pp=2, dp=2)],
                         ids=["dp4", "tp2-sp-dp2", "pp2-dp2"])
def test_zero3_weights_after_a_step_are_the_single_device_weights(pools, config_file, layout):
    _compare(pools, config_file, {"tp": 1, "pp": 1, "zero": 3, **layout}, tol=1e-5, steps=1, warmup_steps=0)


ZERO_BUBBLE_LAYOUTS = [
    dict(tp=2, pp=2, schedule="zb-h1"),
    dict(tp=2, pp=2, schedule="zbv", sequence_parallel=True),
    dict(pp=2, dp=2, schedule="zb-h1", zero=1),
    dict(pp=2, dp=2, schedule="zbv", zero=2),
    dict(tp=2, pp=4, schedule="zb-h1"),
    dict(tp=2, pp=4, schedule="zbv"),
    dict(pp=4, dp=2, schedule="zb-h1", zero=0),
    dict(pp=4, dp=2, schedule="zbv", zero=1),
]


@pytest.mark.parametrize("layout", ZERO_BUBBLE_LAYOUTS, ids=[_id(lay) for lay in ZERO_BUBBLE_LAYOUTS])
def test_zero_bubble_schedules_train_like_one_process(pools, config_file, layout):
    """zb-h1 and zbv (backward split into B and W, W run later by the schedule) at pp 2 and 4 with 8 micro-batches
    per step, with TP 2 and with DP 2 (ZeRO 0/1/2 reduce only after every deferred W) train like one process: two
    steps (the second from the weights and AdamW state the first left) and the weights after them."""
    layout = {"tp": 1, "dp": 1, **layout}
    results = _compare(pools, config_file, layout, global_batch_size=8 * layout["dp"], steps=2)
    assert results[0]["peak_in_flight"] is not None
