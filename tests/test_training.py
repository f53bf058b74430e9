"""End-to-end training: any TP/SP/DP layout follows the single-device loss and grad-norm trajectory."""

import pytest

from harness import mesh  # noqa: F401  (imported so workers share the harness module)
from tensorpar.training import TrainOptions, train

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
    ],
    ids=["tp2", "tp4", "tp2-sp", "tp4-sp-gpt2", "tp2-dp2", "tp2-dp2-accum", "tp2-sp-dp2-zero1", "dp4-zero2-accum"],
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


def test_bf16_trains_close_to_fp32(pools, reference):
    bf16 = _trajectory(pools, 2, tp=2, dtype="bf16")
    for (loss, _), (loss_ref, _) in zip(bf16, reference["tiny"]):
        assert abs(loss - loss_ref) <= 0.05 * loss_ref
    assert bf16[-1][0] < bf16[0][0] - 1.0


@pytest.mark.parametrize("device_name,key", [("NVIDIA H100 80GB HBM3", "h100-80gb"), ("NVIDIA H200", "h200"),
                                             ("NVIDIA A100-SXM4-40GB", "a100-40gb"), ("NVIDIA A100-SXM4-80GB", "a100-80gb")])
def test_mfu_peak_of_a_gpu_comes_from_the_planner_catalog(monkeypatch, device_name, key):
    import torch

    from tensorpar.planning.hardware import GPUS
    from tensorpar.training.mfu import peak_flops

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: device_name)
    for dtype in ("bf16", "fp32"):
        assert peak_flops(torch.device("cuda", 0), dtype) == (GPUS[key].peak(dtype), f"{key} datasheet")
