"""Muon: its update equals torch.optim.Muon's and a plain single-tensor reference; TP and ZeRO-1/3 (each matrix
orthogonalised whole by one owner) and PP train what one process trains; its state is checkpointed and resharded."""

import copy
import math
import os

import pytest
import torch
from safetensors import safe_open

from tensorpar.models import Transformer, get_config
from tensorpar.optim.muon import Muon, WholeMatrices, uses_muon

from layout_runs import assert_same_training, reference, run

# 10 steps of WSD (decay over the last 3) with Muon for the hidden matrices, one micro-batch per DP rank.
MUON = dict(steps=10, warmup_steps=2, optimizer="muon", lr_schedule="wsd", decay_fraction=0.3, micro_batch_size=None)


def _reference_muon(w, g, buf, lr, wd, mu):
    """Muon written out for one matrix in fp32: momentum, Nesterov, 5 quintic Newton-Schulz steps on the unit-norm
    wide orientation, Moonlight's 0.2 sqrt(max(A, B)) scale, decoupled weight decay."""
    buf = mu * buf + (1 - mu) * g
    u = (1 - mu) * g + mu * buf
    x = u.T if u.shape[0] > u.shape[1] else u
    x = x / x.norm().clamp(min=1e-7)
    for _ in range(5):
        a = x @ x.T
        x = 3.4445 * x + (-4.7750 * a + 2.0315 * a @ a) @ x
    x = x.T if u.shape[0] > u.shape[1] else x
    return w * (1 - lr * wd) - lr * 0.2 * math.sqrt(max(w.shape)) * x, buf


def _muon_and_adamw_groups(weights, others):
    return [{"params": weights, "muon": True, "weight_decay": 0.1}, {"params": others, "weight_decay": 0.0}]


def test_the_update_equals_torch_optim_muon_and_a_plain_reference():
    torch.manual_seed(0)
    weights = [torch.nn.Parameter(torch.randn(48, 80)), torch.nn.Parameter(torch.randn(96, 32))]
    bias = torch.nn.Parameter(torch.randn(5))
    bf16 = [copy.deepcopy(w) for w in weights]
    ours = Muon(_muon_and_adamw_groups(bf16, [bias]), lr=0.02, momentum=0.9)
    torchs = torch.optim.Muon([copy.deepcopy(w) for w in weights], lr=0.02, weight_decay=0.1, momentum=0.9,
                              adjust_lr_fn="match_rms_adamw")
    fp32 = [copy.deepcopy(w) for w in weights]
    ours32 = Muon(_muon_and_adamw_groups(fp32, []), lr=0.02, momentum=0.9, orthogonalize=WholeMatrices(torch.float32))
    plain, buffers = [w.detach().clone() for w in weights], [torch.zeros_like(w) for w in weights]
    for _ in range(3):
        grads = [torch.randn_like(w) for w in weights]
        for params in (bf16, torchs.param_groups[0]["params"], fp32):
            for p, g in zip(params, grads):
                p.grad = g.clone()
        bias.grad = torch.randn_like(bias)
        ours.step(), torchs.step(), ours32.step()
        for i, g in enumerate(grads):
            plain[i], buffers[i] = _reference_muon(plain[i], g, buffers[i], 0.02, 0.1, 0.9)
        for a, b in zip(bf16, torchs.param_groups[0]["params"]):
            assert torch.equal(a, b)  # bf16 Newton-Schulz: torch's arithmetic, to the bit
        for a, b in zip(fp32, plain):
            assert (a - b).norm() <= 1e-5 * b.norm()
    assert not torch.equal(bf16[0], weights[0]) and ours.state[bias]["step"] == 3  # AdamW stepped the bias


def test_muon_steps_the_blocks_matrices_and_adamw_the_rest():
    for preset in ("tiny", "tiny-gpt2"):
        model = Transformer(get_config(preset), None, init=False)
        muon = {n for n, p in model.named_parameters() if uses_muon(n, p.shape)}
        assert muon == {n for n, p in model.named_parameters()
                        if n.startswith("layers.") and p.ndim == 2}, preset
        assert not any(k in n for n in muon for k in ("embed", "head", "norm", "bias"))
    assert not uses_muon("layers.0.mlp.router.weight", (8, 64))


LAYOUTS = [dict(tp=2), dict(dp=2, zero=1), dict(dp=2, zero=3), dict(pp=2, micro_batch_size=2)]


@pytest.mark.parametrize("layout", LAYOUTS, ids=["tp2", "dp2-zero1", "dp2-zero3", "pp2"])
def test_layouts_follow_the_single_device_muon_training(pools, config_file, layout):
    world = layout.get("tp", 1) * layout.get("dp", 1) * layout.get("pp", 1)
    results = pools(world).run(run, config_file, **{**MUON, **layout})
    assert all(r["trajectory"] == results[0]["trajectory"] for r in results), "ranks disagree on the trajectory"
    assert_same_training(results, reference(pools, config_file, **MUON))


def count_orthogonalisations(model, **settings):
    """`run`, counting the shapes this rank hands to Newton-Schulz."""
    from tensorpar.data_parallel import muon_matrices

    shapes, plain = [], muon_matrices.newton_schulz

    def counted(update, **kw):
        shapes.append(tuple(update.shape))
        return plain(update, **kw)

    muon_matrices.newton_schulz = counted
    try:
        run(model, **settings)
    finally:
        muon_matrices.newton_schulz = plain
    return shapes


def test_each_matrix_is_orthogonalised_whole_by_one_owner(pools, config_file):
    """TP 2 x DP 2 with ZeRO-1: every step each hidden matrix goes through Newton-Schulz once, whole (its dense
    shape, not a TP shard), on one of the four ranks, and each rank takes a share."""
    dense = sorted(tuple(p.shape) for n, p in Transformer(get_config(config_file), None, init=False).named_parameters()
                   if uses_muon(n, p.shape))
    per_rank = pools(4).run(count_orthogonalisations, config_file,
                            **{**MUON, "steps": 2, "warmup_steps": 1, "tp": 2, "dp": 2, "zero": 1, "return_state": False})
    assert sorted(s for shapes in per_rank for s in shapes) == sorted(dense * 2)
    assert all(len(shapes) >= len(dense) // 2 for shapes in per_rank), [len(s) for s in per_rank]


def test_muon_trains_otherwise_than_adamw(pools, config_file):
    """The comparisons above are not AdamW's in disguise: the same run with AdamW follows another trajectory."""
    muon = reference(pools, config_file, **MUON)["trajectory"]
    adamw = reference(pools, config_file, **{**MUON, "optimizer": "adamw"})["trajectory"]
    assert muon[0] == adamw[0] and abs(muon[-1][0] - adamw[-1][0]) > 1e-2 * adamw[-1][0]


def test_the_momentum_is_checkpointed_and_resharded(pools, config_file, tmp_path):
    """Saved at TP 2 x DP 2 with ZeRO-1 after step 6, resumed at DP 2 with ZeRO-3: the Muon matrices' momentum
    (and the rest's AdamW moments) come back in the new layout's shards, and the run ends as the straight one."""
    save = str(tmp_path / "ckpt")
    pools(4).run(run, config_file, **{**MUON, "tp": 2, "dp": 2, "zero": 1, "stop_after": 6, "save": save})
    step = os.path.join(save, "step-000006")
    with safe_open(os.path.join(step, "model-tp00-pp00.safetensors"), framework="pt") as f:
        keys = set(f.keys())
    assert "momentum_buffer/layers.0.attn.q_proj.weight" in keys and "exp_avg/layers.0.attn.q_proj.weight" not in keys
    assert "exp_avg/embed.weight" in keys and "momentum_buffer/embed.weight" not in keys
    resumed = pools(2).run(run, config_file, **{**MUON, "dp": 2, "zero": 3, "resume": step})
    straight = reference(pools, config_file, **MUON)
    assert_same_training(resumed, {**straight, "trajectory": straight["trajectory"][6:]})


def test_muon_refuses_what_it_cannot_train(cli):
    code, _, err = cli("train", "--model", "tiny-moe", "--optimizer", "muon", "--steps", 1)
    assert code != 0 and "does not train mixture-of-experts models yet" in err and len(err.strip().splitlines()) == 1
    code, _, err = cli("train", "--optimizer", "muon", "--muon-momentum", 1.0, "--steps", 1)
    assert code != 0 and "--muon-momentum must lie in [0, 1)" in err
