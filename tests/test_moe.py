"""Mixture of experts end to end: tiny-moe (2 of its 4 layers, for time) trained at expert-parallel layouts (EP folded over DP, TP with and without
SP, CP, PP; expert-TP; ZeRO-1/2/3) follows the single-device loss, grad-norm and routing trajectory over 4 steps and
ends with its weights; with a capacity factor every layout drops the same tokens; a checkpoint saved at ep 4 resumes at ep 1 and
ep 2, one saved at ep 2 x expert-TP 2 at ep 1 and ep 4."""

import json
import os

import pytest

from tensorpar.checkpoints.sharded import read_meta
from tensorpar.errors import LayoutError
from tensorpar.models import get_config
from tensorpar.training import TrainOptions, validate

from harness import train

BASE = dict(model="tiny-moe", steps=4, seed=3, global_batch_size=8, micro_batch_size=None, seq_len=16, lr=3e-3,
            warmup_steps=2, val_every=0, val_fraction=0.0, progress=False, metrics=None, out_dir=None, device="cpu")
MOE_KEYS = ("moe_aux_loss", "moe_z_loss", "moe_dropped_tokens", "moe_load_imbalance",
            "moe_tokens_per_expert_mean")  # a count: routing choices counted twice would double it


TINY_MOE2 = get_config("tiny-moe").replace(num_layers=2)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("moe") / "tiny-moe-2-layers.json"
    path.write_text(json.dumps(TINY_MOE2.to_dict()))
    return str(path)


def run(**overrides):
    """A short run: each step's loss, grad norm and MoE metrics, and the dense weights after the last step."""
    summary = train(TrainOptions(**{**BASE, "return_state": True, **overrides}))
    return {"trajectory": [(r["loss"], r["grad_norm"]) for r in summary["history"]],
            "moe": [tuple(r[k] for k in MOE_KEYS) for r in summary["history"]], "summary_moe": summary.get("moe"),
            "state": summary.get("state")}


def _after_step_2(reference):
    """What a run resumed from its step-2 checkpoint must give: the last two steps, and the same final weights."""
    return {"trajectory": reference["trajectory"][2:], "moe": reference["moe"][2:], "state": reference["state"]}


def _world(layout):
    return layout.get("tp", 1) * layout.get("pp", 1) * layout.get("dp", 1) * layout.get("cp", 1)


def _assert_same(result, reference, tol=1e-4, weight_tol=1e-5):
    assert len(result["trajectory"]) == len(reference["trajectory"])
    for step, ((loss, gn), (loss_ref, gn_ref)) in enumerate(zip(result["trajectory"], reference["trajectory"]), 1):
        assert abs(loss - loss_ref) <= tol * loss_ref, f"step {step}: loss {loss} vs {loss_ref}"
        assert abs(gn - gn_ref) <= tol * gn_ref, f"step {step}: grad norm {gn} vs {gn_ref}"
    for step, (got, ref) in enumerate(zip(result["moe"], reference["moe"]), 1):
        for key, a, b in zip(MOE_KEYS, got, ref):
            assert abs(a - b) <= tol * max(abs(b), 1e-3), f"step {step}: {key} {a} vs {b}"
    if result.get("state") is not None and reference.get("state") is not None:
        assert result["state"].keys() == reference["state"].keys()
        for name, ref in reference["state"].items():
            err = (result["state"][name] - ref).norm() / ref.norm()
            assert err <= weight_tol, f"after the last step {name} differs by {err:.1e}"


@pytest.fixture(scope="module")
def reference(pools, model):
    return pools(1).run(run, model=model)[0]


LAYOUTS = [
    dict(dp=2, ep=2, recompute="full"),  # the MoE layers run again in the backward: stats counted once
    dict(tp=2, ep=2, sequence_parallel=True),  # EP folded over the TP ranks
    dict(dp=4, ep=2, zero=1, micro_batch_size=2),  # EP inside DP: two expert-DP replicas of each expert
    dict(tp=2, dp=2, ep=4, zero=2),  # EP folded over TP and DP (expert-TP 1)
    dict(pp=2, dp=2, ep=2),
    dict(dp=4, ep=2, expert_tp=2, micro_batch_size=2),  # expert-TP over DP ranks: the expert-DP groups are single
    dict(tp=2, expert_tp=2, sequence_parallel=True),  # each expert's width split over the TP ranks, ep 1
    dict(dp=2, ep=2, zero=3),  # ZeRO-3: the experts' expert-DP groups are single ranks, the dense weights sharded
]  # dp 4 x ep 2 under ZeRO-3 (experts sharded over expert-DP pairs): `zero3_run`


@pytest.mark.parametrize("layout", LAYOUTS, ids=["-".join(f"{k}{v}" for k, v in lay.items()) for lay in LAYOUTS])
def test_expert_parallel_layouts_train_like_one_process(pools, model, reference, layout):
    for result in pools(_world(layout)).run(run, model=model, **layout):
        _assert_same(result, reference)


@pytest.fixture(scope="module")
def ep4_run(pools, model, tmp_path_factory):
    """dp 4 x ep 4 (each rank holds 2 of the 8 experts), saving a checkpoint at step 2."""
    save = str(tmp_path_factory.mktemp("moe") / "ckpt")
    return save, pools(4).run(run, model=model, dp=4, ep=4, micro_batch_size=2, save=save, save_every=2)


def test_ep4_trains_like_one_process(reference, ep4_run):
    for result in ep4_run[1]:
        _assert_same(result, reference)


@pytest.fixture(scope="module")
def expert_tp_run(pools, model, tmp_path_factory):
    """tp 2 x dp 2 with ep 2 x expert-TP 2 (the expert-TP groups are the TP groups, EP runs over DP), saving a
    checkpoint at step 2."""
    save = str(tmp_path_factory.mktemp("moe") / "ckpt-etp")
    return save, pools(4).run(run, model=model, tp=2, dp=2, ep=2, expert_tp=2, save=save, save_every=2)


def test_tp2_dp2_with_ep2_expert_tp2_trains_like_one_process(reference, expert_tp_run):
    for result in expert_tp_run[1]:
        _assert_same(result, reference)


@pytest.fixture(scope="module")
def zero3_run(pools, model, tmp_path_factory):
    """dp 4 x ep 2 under ZeRO-3: the dense weights sharded over the 4 DP ranks, the experts over their expert-DP
    pairs; saving a checkpoint at step 2."""
    save = str(tmp_path_factory.mktemp("moe") / "ckpt-zero3")
    return save, pools(4).run(run, model=model, dp=4, ep=2, zero=3, micro_batch_size=2, save=save, save_every=2)


def test_zero3_dp4_ep2_trains_like_one_process(reference, zero3_run):
    for result in zero3_run[1]:
        _assert_same(result, reference)


def test_a_checkpoint_saved_under_zero3_resumes_at_ep2_expert_tp2(pools, model, reference, zero3_run):
    step_dir = os.path.join(zero3_run[0], "step-000002")
    resumed = pools(4).run(run, model=model, resume=step_dir, tp=2, dp=2, ep=2,
                           expert_tp=2)
    for result in resumed:
        _assert_same(result, _after_step_2(reference))


# ep 4 resumes under ZeRO-3: the checkpoint's experts cut into each rank's expert-DP shard
@pytest.mark.parametrize("layout", [dict(), dict(dp=4, ep=4, micro_batch_size=2, zero=3)], ids=["ep1", "ep4-zero3"])
def test_a_checkpoint_saved_at_ep2_expert_tp2_resumes_at_other_layouts(pools, model, reference, expert_tp_run,
                                                                        layout):
    save, _ = expert_tp_run
    step_dir, meta = read_meta(os.path.join(save, "step-000002"))
    assert (meta["layout"]["ep"], meta["layout"]["expert_tp"]) == (2, 2)
    assert sorted(f for f in meta["files"] if f.startswith("experts-")) == \
        [f"experts-ep{e:02d}-pp00.safetensors" for e in range(2)]  # whole experts: the width slices gathered
    assert meta["tensors"]["layers.0.mlp.experts.up_proj"]["shape"] == [8, TINY_MOE2.expert_ffn_size, 64]
    resumed = pools(_world(layout)).run(run, model=model, resume=step_dir, **layout)
    for result in resumed:
        _assert_same(result, _after_step_2(reference))


@pytest.mark.parametrize("layout", [dict(), dict(dp=2, ep=2)], ids=["ep1", "ep2"])
def test_a_checkpoint_saved_at_ep4_resumes_at_other_ep_sizes(pools, model, reference, ep4_run, layout):
    save, _ = ep4_run
    step_dir, meta = read_meta(os.path.join(save, "step-000002"))
    assert meta["layout"]["ep"] == 4 and sorted(f for f in meta["files"] if f.startswith("experts-")) == \
        [f"experts-ep{e:02d}-pp00.safetensors" for e in range(4)]
    assert meta["tensors"]["layers.0.mlp.experts.up_proj"]["group"] == "ep"
    # steps 3 and 4: the same losses and weights as the uninterrupted run
    resumed = pools(_world(layout)).run(run, model=model, resume=step_dir, **layout)
    for result in resumed:
        _assert_same(result, _after_step_2(reference))


def test_the_reference_learns_and_reports_its_router(pools, model):
    reference = pools(1).run(run, model=model, steps=20)[0]
    losses = [loss for loss, _ in reference["trajectory"]]
    assert losses[-1] < losses[0] - 1.0
    aux, z, dropped, imbalance, per_expert = reference["moe"][0]
    assert 2 * 0.01 * 0.9 < aux < 2 * 0.01 * 2 and z > 0 and dropped == 0 and imbalance >= 1.0
    tokens = BASE["global_batch_size"] * BASE["seq_len"]  # of one step, each routed to experts_per_token experts
    assert per_expert == tokens * TINY_MOE2.experts_per_token / TINY_MOE2.num_experts
    assert reference["summary_moe"]["dropped_tokens"] == 0


@pytest.fixture(scope="module")
def capacity_config(tmp_path_factory):
    path = tmp_path_factory.mktemp("moe") / "tiny-moe-capacity.json"
    path.write_text(json.dumps(TINY_MOE2.replace(capacity_factor=1.0).to_dict()))
    return str(path)


def test_a_capacity_drops_the_same_tokens_at_every_layout(pools, capacity_config):
    kw = dict(model=capacity_config)
    reference = pools(1).run(run, **kw)[0]
    assert all(dropped > 0 for _, _, dropped, _, _ in reference["moe"]), "capacity 1.0 dropped nothing"
    for layout in (dict(tp=2, ep=2), dict(tp=2, cp=2, ep=4, sequence_parallel=True)):
        for result in pools(_world(layout)).run(run, **kw, **layout):
            _assert_same(result, reference)
            assert [m[2] for m in result["moe"]] == [m[2] for m in reference["moe"]]


def test_bad_expert_layouts_are_refused_before_any_process_group():
    with pytest.raises(LayoutError, match="num_experts = 8 is not divisible by the expert-parallel size 3"):
        validate(TrainOptions(**{**BASE, "dp": 3, "ep": 3, "global_batch_size": 6, "micro_batch_size": 2}), world_size=3)
    with pytest.raises(LayoutError, match=r"ep=4 does not fold onto the 2 ranks of a pipeline stage"):
        validate(TrainOptions(**{**BASE, "dp": 2, "ep": 4}), world_size=2)
    with pytest.raises(LayoutError, match=r"expert_tp=2 x ep=2 = 4 does not fold onto the 2 ranks.*valid --expert-tp "
                                          r"at ep=2: \[1\]"):
        validate(TrainOptions(**{**BASE, "dp": 2, "ep": 2, "expert_tp": 2}), world_size=2)
    # the sizes offered must also divide num_experts (8): tp x dp = 6 would offer 3 and 6 otherwise
    with pytest.raises(LayoutError, match=r"ep=4 does not fold onto the 6 ranks.*valid: \[1, 2\]$"):
        validate(TrainOptions(**{**BASE, "tp": 2, "dp": 3, "ep": 4, "global_batch_size": 6, "micro_batch_size": 2}),
                 world_size=6)
    with pytest.raises(LayoutError, match=r"expert_ffn_size = \d+ is not divisible by the expert-TP size 3"):
        validate(TrainOptions(**{**BASE, "dp": 3, "expert_tp": 3, "global_batch_size": 6, "micro_batch_size": 2}),
                 world_size=3)
    with pytest.raises(LayoutError, match="--expert-tp 2 needs a mixture-of-experts model"):
        validate(TrainOptions(**{**BASE, "model": "tiny", "dp": 2, "expert_tp": 2}), world_size=2)
    with pytest.raises(LayoutError, match="--ep 2 needs a mixture-of-experts model"):
        validate(TrainOptions(**{**BASE, "model": "tiny", "dp": 2, "ep": 2}), world_size=2)


def test_bf16_experts_follow_the_fp32_trajectory(pools, model, reference):
    """bf16 weights and activations with fp32 masters, experts dispatched in bf16 over the EP all-to-all."""
    result = pools(2).run(run, model=model, dp=2, ep=2, dtype="bf16")[0]
    for step, ((loss, _), (loss_ref, _)) in enumerate(zip(result["trajectory"], reference["trajectory"]), 1):
        assert abs(loss - loss_ref) <= 0.02 * loss_ref, f"step {step}: bf16 loss {loss} vs fp32 {loss_ref}"
    assert all(abs(a - b) <= 0.05 * b for a, b in zip(result["moe"][-1][:2], reference["moe"][-1][:2]))


def test_the_loss_plot_of_a_moe_run_has_a_routing_panel(tmp_path):
    from PIL import Image

    from tensorpar.training.metrics import plot_loss_curve

    dense = [{"step": s, "loss": 5.0 - 0.1 * s} for s in range(1, 11)]
    moe = [{**r, "moe_load_imbalance": 2.0 - 0.05 * r["step"], "moe_aux_loss": 0.02, "moe_z_loss": 0.01,
            "moe_dropped_fraction": 0.0} for r in dense]
    heights = [Image.open(plot_loss_curve(records, str(tmp_path / f"{name}.png"), name)).size[1]
               for name, records in (("dense", dense), ("moe", moe))]
    assert heights[1] > 1.5 * heights[0]
