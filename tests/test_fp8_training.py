"""fp8 training end to end: TP 2 + SP (rowwise), DP 2 with ZeRO-3 (tensorwise, fp8 gathers), PP 2 (rowwise) and
TP 2 x EP 2 (MoE, tensorwise) follow the one-process fp8 run; a checkpoint resumes at another layout and precision;
fp8 requests that cannot run are refused before any rank starts."""

import pytest

from tensorpar.tensor_parallel.fp8_scaling import fp8_unsupported

from layout_runs import reference, run


pytestmark = pytest.mark.skipif(fp8_unsupported("cpu") is not None, reason="this torch has no fp8")

# Two micro-batches of 2 sequences per step: a DP 2 rank's micro-batch is one of the one-process run's, so that the
# activations' amaxes (each rank scales its own tokens) are the same ones.
FP8 = dict(steps=4, seed=3, seq_len=32, global_batch_size=4, micro_batch_size=2, lr=3e-4, dtype="fp8",
           return_state=False)
LAYOUTS = {
    "tp2-sp-rowwise": (2, "tiny", dict(tp=2, sequence_parallel=True, fp8_recipe="rowwise")),
    "dp2-zero3": (2, "tiny", dict(dp=2, zero=3)),
    "pp2-rowwise": (2, "tiny", dict(pp=2, fp8_recipe="rowwise")),
    "tp2-ep2-moe": (4, "tiny-moe", dict(tp=2, dp=2, ep=2)),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_fp8_layouts_train_like_one_fp8_process(pools, name):
    """Each step's loss to 1e-3 and grad norm to 1e-2 over 4 steps. A layout's quantised values equal one
    process's given equal inputs (tests/test_fp8.py, to 1e-7), but here its inputs differ in the last bit (another
    summation order, bf16 partial sums), and an fp8 rounding that flips on such a bit moves an element by a whole
    fp8 step (6% in e4m3, 12% in e5m2), which AdamW's normalised updates carry into the weights whose gradients are
    small: after 6 steps the bf16 weights of a layout differ from one process's by up to 1.1e-2 (relative norm), so
    they are not compared. Measured: over 20 steps the losses still agree to 1e-3 while grad norms drift by up to
    7% at a loss spike (bf16 alone drifts 6% at TP 2, lr 3e-3)."""
    world, model, layout = LAYOUTS[name]
    settings = {**FP8, **{k: v for k, v in layout.items() if k == "fp8_recipe"}}
    results = pools(world).run(run, model, **{**FP8, **layout})
    ref = reference(pools, model, **settings)
    for rank, result in enumerate(results):
        for step, ((loss, gn), (loss_ref, gn_ref)) in enumerate(zip(result["trajectory"], ref["trajectory"],
                                                                    strict=True), 1):
            assert abs(loss - loss_ref) <= 1e-3 * loss_ref, f"rank {rank} step {step}: loss {loss} vs {loss_ref}"
            assert abs(gn - gn_ref) <= 1e-2 * gn_ref, f"rank {rank} step {step}: grad norm {gn} vs {gn_ref}"


def test_fp8_that_cannot_run_is_refused_before_any_rank(cli):
    code, _, err = cli("train", "--dtype", "fp8", "--pp", "2", "--schedule", "zb-h1", "--steps", "1")
    assert code != 0 and "--dtype fp8 cannot run under --schedule zb-h1" in err, err
    code, _, err = cli("train", "--dtype", "fp8", "--fp8-recipe", "blockwise", "--steps", "1")
    assert code != 0 and "blockwise" in err, err


def test_an_fp8_checkpoint_resumes_at_another_layout_and_precision(pools, tmp_path):
    """Checkpoints hold the fp32 masters: an fp8 run saved at TP 2 continues at TP 1 as the straight fp8 run does,
    and continues in bf16 too."""
    import os

    kw = dict(FP8)
    straight = reference(pools, "tiny", **kw)["trajectory"]
    save = str(tmp_path / "ckpt")
    pools(2).run(run, "tiny", **kw, tp=2, save=save, stop_after=2)
    step2 = os.path.join(save, "step-000002")
    resumed = pools(1).run(run, "tiny", **kw, resume=step2)[0]["trajectory"]
    bf16 = pools(1).run(run, "tiny", **{**kw, "dtype": "bf16"}, resume=step2)[0]["trajectory"]
    assert len(resumed) == len(bf16) == 2
    for (loss, _), (b, _), (ref, _) in zip(resumed, bf16, straight[2:]):
        assert abs(loss - ref) <= 1e-3 * ref and abs(b - ref) <= 2e-2 * ref, (loss, b, ref)


def amaxes(model, **overrides):
    """The fp8 amax metrics of the first step."""
    from harness import train
    from layout_runs import BASE
    from tensorpar.training import TrainOptions

    summary = train(TrainOptions(model=model, **{**BASE, **FP8, "steps": 1, **overrides}))
    return {k: v for k, v in summary["history"][0].items() if k.startswith("fp8_amax")}


def test_the_fp8_amax_metrics_are_the_worlds_not_rank_0s(pools):
    """Under EP 2 rank 0 holds half the experts and under DP 2 half the tokens: the metrics are the maxima over
    every rank (rank 0's alone missed the expert whose weight has the model's largest amax), so the inputs' and
    weights' equal one process's; each DP rank's output gradients carry the factor dp of its loss weights
    (training/loss_weights.py; the DP mean divides it out), a power of two here, so exactly twice one process's."""
    one = pools(1).run(amaxes, "tiny-moe")[0]
    assert one.keys() == {"fp8_amax_input", "fp8_amax_weight", "fp8_amax_grad_output"}, one
    for result in pools(2).run(amaxes, "tiny-moe", dp=2, ep=2):
        assert result["fp8_amax_input"] == one["fp8_amax_input"], (result, one)
        assert result["fp8_amax_weight"] == one["fp8_amax_weight"], (result, one)
        assert result["fp8_amax_grad_output"] == 2 * one["fp8_amax_grad_output"], (result, one)
