"""A DeepSeek-V3-class MoE in training (tiny-deepseek: latent attention, group-limited sigmoid routing with the
balancing bias updated every step, a dense first layer, one multi-token prediction module): 10 steps at TP 2 + SP,
EP 2, CP 2 (ring and all-gather), PP 2 and DP 2 under ZeRO-1 and ZeRO-3 follow one process (loss, grad norm, MTP loss,
routing, and every weight and balancing bias after the last step); a checkpoint resumes at another layout with the
same biases; and the biases move an overloaded expert's load towards the mean."""

import json

import pytest
import torch

from tensorpar.checkpoints.dense_checkpoint import write_dense_checkpoint
from tensorpar.models import Transformer, full_state_dict, get_config, load_full_state_dict
from tensorpar.training import TrainOptions

from harness import train
from layout_runs import assert_same_training

STEPS = 10
CFG = get_config("tiny-deepseek")
BASE = dict(steps=STEPS, seed=7, global_batch_size=8, micro_batch_size=4, seq_len=16, lr=3e-3, warmup_steps=2,
            val_every=0, val_fraction=0.0, progress=False, metrics=None, out_dir=None, device="cpu",
            return_state=True)
KEYS = ("mtp_loss", "moe_aux_loss", "moe_load_imbalance")


def run(model, **overrides):
    summary = train(TrainOptions(model=model, **{**BASE, **overrides}))
    return {"trajectory": [(r["loss"], r["grad_norm"]) for r in summary["history"]],
            "metrics": [tuple(r.get(k, 0.0) for k in KEYS) for r in summary["history"]], "state": summary["state"]}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """tiny-deepseek as a config file (its biases move by DeepSeek-V3's 0.001 a step: a faster speed drives tokens onto
    the routing's decision boundaries, where float reassociation alone flips a choice now and then)."""
    path = tmp_path_factory.mktemp("deepseek") / "tiny-deepseek.json"
    path.write_text(json.dumps(CFG.to_dict()))
    return str(path)


@pytest.fixture(scope="module")
def reference(pools, model):
    return pools(1).run(run, model)[0]


def _same(result, reference):
    assert_same_training([result], reference)
    for step, (got, ref) in enumerate(zip(result["metrics"], reference["metrics"]), 1):
        for key, a, b in zip(KEYS, got, ref):
            assert abs(a - b) <= 1e-4 * max(abs(b), 1e-3), f"step {step}: {key} {a} vs {b}"


def test_the_reference_predicts_further_tokens_and_moves_its_biases(reference):
    biases = {k: v for k, v in reference["state"].items() if k.endswith("router.expert_bias")}
    assert sorted(biases) == [f"layers.{i}.mlp.router.expert_bias" for i in (1, 2, 3)] + [
        "layers.4.block.mlp.router.expert_bias"]  # the MTP module's block
    for name, bias in biases.items():  # +-0.001 a step
        assert 0 < bias.abs().max() <= STEPS * CFG.bias_update_speed + 1e-6, name
    losses = [m[0] for m in reference["metrics"]]
    assert all(loss > 0 for loss in losses) and losses[-1] < losses[0]  # the MTP module learns too
    assert any(k.startswith("layers.4.eh_proj") for k in reference["state"])


LAYOUTS = [dict(tp=2, sequence_parallel=True), dict(dp=2, ep=2), dict(cp=2), dict(cp=2, cp_impl="allgather"),
           dict(pp=2), dict(dp=2, zero=1), dict(dp=2, zero=3)]


@pytest.mark.parametrize("layout", LAYOUTS, ids=["-".join(f"{k}{v}" for k, v in lay.items()) for lay in LAYOUTS])
def test_layouts_train_like_one_process(pools, model, reference, layout):
    for result in pools(2).run(run, model, **layout):
        _same(result, reference)


def test_a_checkpoint_resumes_at_another_layout_with_the_same_biases(pools, model, reference, tmp_path):
    save = str(tmp_path / "ckpt")
    pools(2).run(run, model, tp=2, sequence_parallel=True, stop_after=5, save=save, save_every=5)
    for result in pools(2).run(run, model, dp=2, ep=2, resume=save):
        _same(result, {**reference, "trajectory": reference["trajectory"][5:], "metrics": reference["metrics"][5:]})


def _expert_load(model, ids) -> torch.Tensor:
    """[layers, E]: the routing choices of `ids` per MoE layer and expert (the decoder's layers)."""
    counts = []
    hooks = [block.mlp.router.register_forward_hook(
        lambda _m, _i, out: counts.append(torch.bincount(out.experts.flatten(), minlength=CFG.num_experts)))
        for block in model.decoder_layers().values() if block.moe]
    with torch.no_grad():
        model(ids)
    for h in hooks:
        h.remove()
    return torch.stack(counts).float()


def test_the_biases_move_an_overloaded_experts_load_towards_the_mean(pools, tmp_path):
    """Expert 0's router row is tilted towards the mean input of its layer, so that it takes far more than its share
    of the tokens; 50 steps of training with the bias updates bring its share down in every layer."""
    cfg = CFG.replace(num_layers=2, num_mtp_layers=0, bias_update_speed=0.02)  # one dense layer, one MoE layer
    model = Transformer(cfg, None, seed=3)
    inputs = {}
    hooks = [b.mlp.router.register_forward_pre_hook(lambda m, args, i=i: inputs.__setitem__(i, args[0]))
             for i, b in model.layers.items() if b.moe]
    ids = torch.randint(0, cfg.vocab_size, (8, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model(ids)
        for h in hooks:
            h.remove()
        for i, x in inputs.items():
            mean = x.mean(0)
            model.layers[i].mlp.router.weight[0] += 4 * mean / mean.norm() ** 2
    before = _expert_load(model, ids)
    folder = write_dense_checkpoint(str(tmp_path / "tilted"), cfg, full_state_dict(model))
    # the model is --init-from's: --model keeps its default ("tiny"; another value is refused as unused)
    result = pools(1).run(run, "tiny", steps=50, init_from=folder, warmup_steps=5, micro_batch_size=8)[0]
    trained = Transformer(cfg, None, init=False)
    load_full_state_dict(trained, result["state"])
    after = _expert_load(trained.eval(), ids)
    share_before, share_after = before[:, 0] / before.sum(1), after[:, 0] / after.sum(1)
    print("per-expert load before:", before.tolist(), "\nafter 50 steps:", after.tolist())
    assert (share_before > 2.5 / cfg.num_experts).all(), share_before  # 2.5x its share of the choices at the start
    assert (share_after < share_before / 2).all(), (share_before, share_after)
    assert (result["state"]["layers.1.mlp.router.expert_bias"][0] < 0)  # its bias went down
