"""End-to-end training: any TP/SP/PP/DP/ZeRO layout follows the single-device loss and grad-norm trajectory
(and, for 3D layouts, ends with the same weights); recomputation exact, dropout reproducible, bf16 close.
"""

import json

import pytest

from tensorpar.training import TrainOptions, train

import layout_runs
from harness import mesh  # noqa: F401  (imported so workers share the harness module)

BASE = dict(model="tiny", steps=20, seed=3, global_batch_size=8, micro_batch_size=4, seq_len=32, lr=3e-3,
            warmup_steps=5, val_every=0, progress=False, metrics=None, out_dir=None, device="cpu")


def run_training(**overrides):
    summary = train(TrainOptions(**{**BASE, **overrides}))
    return [(r["loss"], r["grad_norm"]) for r in summary["history"]]


def _trajectory(pools, world, **overrides):
    results = pools(world).run(run_training, **overrides)
    assert all(r == results[0] for r in results), "ranks disagree on the logged trajectory"
    return results[0]


def _assert_same(actual, expected, tol):
    assert len(actual) == len(expected)
    for step, ((loss, gn), (loss_ref, gn_ref)) in enumerate(zip(actual, expected), 1):
        assert abs(loss - loss_ref) <= tol * abs(loss_ref), f"step {step}: loss {loss} vs {loss_ref}"
        assert abs(gn - gn_ref) <= tol * abs(gn_ref), f"step {step}: grad norm {gn} vs {gn_ref}"


@pytest.fixture(scope="module")
def reference(pools):
    return {model: _trajectory(pools, 1, model=model) for model in ("tiny", "tiny-gpt2")}


@pytest.mark.parametrize(
    "world,layout",
    [
        (2, dict(tp=2)),
        (4, dict(tp=4)),  # tiny has 2 KV heads: TP=4 replicates each on 2 ranks
        (2, dict(tp=2, sequence_parallel=True)),
        (4, dict(tp=4, sequence_parallel=True, model="tiny-gpt2")),  # vocab 257 padded, tied, learned positions
        (4, dict(tp=2, dp=2)),
        (4, dict(tp=2, dp=2, micro_batch_size=2)),  # 2 micro-batches per DP rank
        (4, dict(tp=2, dp=2, zero=1, sequence_parallel=True)),
        (4, dict(tp=1, dp=4, zero=2, micro_batch_size=1)),
        (2, dict(cp=2)),
        (4, dict(cp=4)),
        (4, dict(cp=4, cp_impl="allgather", model="tiny-gpt2")),
        (4, dict(tp=2, cp=2, sequence_parallel=True)),  # 2 KV heads: one per TP rank
        (4, dict(cp=2, dp=2, zero=1)),
        (4, dict(cp=2, pp=2, micro_batch_size=2)),
        (2, dict(dp=2, zero=3)),
        (4, dict(tp=2, dp=2, zero=3, sequence_parallel=True)),
        (4, dict(pp=2, dp=2, zero=3, micro_batch_size=2, model="tiny-gpt2")),  # tied embedding on both ends
        (4, dict(dp=4, zero=3, micro_batch_size=1, zero3_reshard_after_forward=False)),
        (2, dict(dp=2, zero=3, micro_batch_size=1, recompute="full")),  # 4 micro-batches per rank
    ],
    ids=["tp2", "tp4", "tp2-sp", "tp4-sp-gpt2", "tp2-dp2", "tp2-dp2-accum", "tp2-sp-dp2-zero1", "dp4-zero2-accum",
         "cp2", "cp4", "cp4-allgather-gpt2", "tp2-cp2-sp", "cp2-dp2-zero1", "cp2-pp2", "dp2-zero3",
         "tp2-sp-dp2-zero3", "pp2-dp2-zero3-gpt2", "dp4-zero3-keep-params-accum2", "dp2-zero3-accum4-recompute"],
)
def test_layouts_follow_the_single_device_trajectory(pools, reference, world, layout):
    model = layout.get("model", "tiny")
    _assert_same(_trajectory(pools, world, **layout), reference[model], 1e-4)


def test_the_trajectory_actually_moves(reference):
    """Guard against a vacuous comparison: the reference run learns."""
    losses = [loss for loss, _ in reference["tiny"]]
    assert losses[-1] < losses[0] - 1.0


def test_recomputation_leaves_the_trajectory_unchanged(pools):
    base = _trajectory(pools, 2, tp=2, steps=4, warmup_steps=2)
    for mode in ("selective", "full"):
        _assert_same(_trajectory(pools, 2, tp=2, steps=4, warmup_steps=2, recompute=mode), base, 1e-6)


def test_dropout_is_reproducible_from_the_seed_and_recomputable(pools):
    kw = dict(tp=2, sequence_parallel=True, steps=4, warmup_steps=2, dropout=0.1)
    first = _trajectory(pools, 2, **kw)
    assert first == _trajectory(pools, 2, **kw), "same seed, different run"
    assert first != _trajectory(pools, 2, **{**kw, "seed": 4}), "the seed does not reach the dropout masks"
    no_dropout = _trajectory(pools, 2, **{**kw, "dropout": 0.0})
    assert first != no_dropout, "dropout had no effect"
    # full recomputation replays the same masks: identical up to float reassociation
    _assert_same(_trajectory(pools, 2, **kw, recompute="full"), first, 1e-6)


@pytest.mark.parametrize("layout", [dict(tp=2, dtype="bf16"), dict(dp=2, zero=1, dtype="fp16"),
                                    dict(dp=2, zero=3, dtype="bf16", grad_reduce_dtype="bf16")],
                         ids=["bf16-tp2", "fp16-dp2-zero1", "bf16-dp2-zero3-bf16-reduce"])
def test_low_precision_trains_close_to_fp32(pools, reference, layout):
    """bf16/fp16 parameters with fp32 master weights follow the fp32 run closely and end within 2% of it."""
    low = _trajectory(pools, 2, **layout)
    for (loss, _), (loss_ref, _) in zip(low, reference["tiny"]):
        assert abs(loss - loss_ref) <= 0.05 * loss_ref
    assert abs(low[-1][0] - reference["tiny"][-1][0]) <= 0.02 * reference["tiny"][-1][0]
    assert low[-1][0] < low[0][0] - 1.0


@pytest.fixture(scope="module")
def reference_3d(pools, config_file):
    return pools(1).run(layout_runs.run, config_file)[0]


LAYOUTS = [
    dict(tp=2, pp=2, schedule="afab"),
    dict(tp=2, pp=2, schedule="1f1b"),
    dict(tp=2, pp=2, schedule="interleaved", virtual_stages=2, sequence_parallel=True),
    dict(tp=1, pp=2, dp=2, schedule="1f1b", zero=0),
    dict(tp=1, pp=2, dp=2, schedule="afab", zero=1),
    dict(tp=1, pp=2, dp=2, schedule="interleaved", virtual_stages=2, zero=2),
    dict(tp=2, dp=2, zero=0),
    dict(tp=2, dp=2, zero=1),
    dict(tp=2, dp=2, zero=2),
    dict(pp=4, schedule="afab"),
    dict(pp=4, schedule="1f1b"),
    dict(pp=4, schedule="interleaved", virtual_stages=2),
    dict(dp=4, zero=0),
    dict(dp=4, zero=1),
    dict(dp=4, zero=2, micro_batch_size=2),
]


def _id(layout):
    return "-".join(f"{k}{v}" if k not in ("schedule",) else v for k, v in layout.items())


@pytest.mark.parametrize("layout", LAYOUTS, ids=[_id(lay) for lay in LAYOUTS])
def test_3d_layouts_train_like_one_process(pools, config_file, reference_3d, layout):
    layout = {"tp": 1, "pp": 1, "dp": 4 // (layout.get("tp", 1) * layout.get("pp", 1)), **layout}
    layout_runs.assert_same_training(pools(4).run(layout_runs.run, config_file, **layout), reference_3d)


@pytest.mark.parametrize("layout", [dict(pipeline_layers="2,6", schedule="1f1b"),
                                    dict(pipeline_layers="6,2", schedule="afab", zero=1),
                                    dict(pipeline_layers="1,7", schedule="1f1b")],
                         ids=["pp2-2.6-1f1b", "pp2-6.2-afab-zero1", "pp2-1.7-1f1b"])
def test_uneven_pipeline_stages_train_like_one_process(pools, config_file, reference_3d, layout):
    """--pipeline-layers: the stages hold different numbers of the 8 layers; training is unchanged."""
    from tensorpar.parallel.pipeline import parse_pipeline_layers
    from tensorpar.planning.params import local_parameters

    layout = {"tp": 1, "pp": 2, "dp": 2, **layout}
    results = pools(4).run(layout_runs.run, config_file, **layout)
    layout_runs.assert_same_training(results, reference_3d)
    # The split is real: the stages' optimizer states are in the ratio of their planned parameters.
    split = tuple(parse_pipeline_layers(layout["pipeline_layers"]))
    planned = [sum(n for _, n, _ in local_parameters(layout_runs.CONFIG, 1, 2, s, pipeline_layers=split))
               for s in (0, 1)]
    small, large = sorted({r["optimizer_state_bytes"] for r in results})
    assert small / large == pytest.approx(min(planned) / max(planned), rel=1e-3)


@pytest.fixture(scope="module")
def four_layers(pools, tmp_path_factory):
    """A 4-layer TINY8 (for --pipeline-layers 1,3 and 3,1) and its one-process training, 20 steps."""
    config = layout_runs.CONFIG.replace(num_layers=4)
    path = tmp_path_factory.mktemp("cfg4") / "tiny4.json"
    path.write_text(json.dumps(config.to_dict()))
    return config, str(path), pools(1).run(layout_runs.run, str(path), steps=20)[0]


@pytest.mark.parametrize("layout", [dict(pipeline_layers="1,3", schedule="1f1b", tp=2),
                                    dict(pipeline_layers="3,1", schedule="afab", dp=2, zero=1)],
                         ids=["pp2-1.3-1f1b-tp2", "pp2-3.1-afab-dp2-zero1"])
def test_one_and_three_layers_per_stage_train_like_one_process(pools, four_layers, layout):
    from tensorpar.parallel.pipeline import parse_pipeline_layers
    from tensorpar.planning.params import local_parameters

    config, path, reference = four_layers
    layout = {"tp": 1, "pp": 2, "dp": 1, **layout}
    results = pools(4).run(layout_runs.run, path, steps=20, **layout)
    assert len(results[0]["trajectory"]) == 20
    layout_runs.assert_same_training(results, reference)
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
    one_step = dict(steps=1, warmup_steps=0)
    reference = pools(1).run(layout_runs.run, config_file, **one_step)[0]
    layout = {"tp": 1, "pp": 1, **layout}
    results = pools(4).run(layout_runs.run, config_file, zero=3, **one_step, **layout)
    layout_runs.assert_same_training(results, reference, tol=1e-5)


def test_reference_learns(reference_3d):
    losses = [loss for loss, _ in reference_3d["trajectory"]]
    assert losses[-1] < losses[0] - 0.5


@pytest.fixture(scope="module")
def reference_20_steps(pools, config_file):
    """One process, 20 steps, at the two global batches the zero-bubble layouts use (8 micro-batches per rank)."""
    return {gb: pools(1).run(layout_runs.run, config_file, steps=20, global_batch_size=gb)[0] for gb in (8, 16)}


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
def test_zero_bubble_schedules_train_like_one_process(pools, config_file, reference_20_steps, layout):
    """zb-h1 and zbv (backward split into B and W, W run later by the schedule) at pp 2 and 4 with 8 micro-batches
    per step, with TP 2 and with DP 2 (ZeRO 0/1/2 reduce only after every deferred W): 20 steps equal to one
    process's."""
    dp = layout.get("dp", 1)
    layout = {"tp": 1, **layout, "steps": 20, "global_batch_size": 8 * dp}
    world = layout["tp"] * layout["pp"] * dp
    results = pools(world).run(layout_runs.run, config_file, **layout)
    assert results[0]["peak_in_flight"] is not None
    layout_runs.assert_same_training(results, reference_20_steps[8 * dp])
