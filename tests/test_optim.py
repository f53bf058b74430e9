"""Training utilities: the LR schedule, AdamW groups, and the dense-model gradient norm from TP/PP shards."""

import copy
import math

import pytest
import torch
from torch import nn

from checks import rel_err
from harness import mesh
from tensorpar.errors import TensorparError
from tensorpar.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from tensorpar.layers.sharding import ShardSpec, shard_spec, shard_tensor, tag
from tensorpar.optim import build_optimizer, clip_grad_norm_, global_grad_norm, lr_at, set_lr

# -- schedule (in process) -----------------------------------------------------------------------

SCHED = dict(max_lr=1.0, min_lr=0.1, warmup_steps=5, total_steps=15)  # peak at step 4, floor at step 14


def test_lr_warmup_is_linear_from_max_over_warmup_to_max():
    assert lr_at(0, **SCHED) == pytest.approx(1.0 / 5)
    assert lr_at(2, **SCHED) == pytest.approx(3.0 / 5)
    assert lr_at(4, **SCHED) == pytest.approx(1.0)  # step warmup_steps - 1


def test_lr_cosine_midpoint_end_and_after():
    assert lr_at(9, **SCHED) == pytest.approx((1.0 + 0.1) / 2)  # halfway between step 4 and step 14
    assert lr_at(14, **SCHED) == pytest.approx(0.1)
    assert lr_at(15, **SCHED) == 0.1 and lr_at(1000, **SCHED) == 0.1
    lrs = [lr_at(s, **SCHED) for s in range(4, 15)]
    assert all(a > b for a, b in zip(lrs, lrs[1:])), "cosine decay must be strictly decreasing"


def test_lr_without_warmup_starts_at_max():
    sched = dict(max_lr=2.0, min_lr=0.0, warmup_steps=0, total_steps=11)
    assert lr_at(0, **sched) == pytest.approx(2.0)
    assert lr_at(5, **sched) == pytest.approx(1.0)
    assert lr_at(10, **sched) == pytest.approx(0.0)
    # on a schedule of 9 steps (0..8) step 2 is a quarter of the way: max * (1 + cos(pi/4)) / 2
    quarter = 0.5 * 2.0 * (1 + math.cos(math.pi / 4))
    assert lr_at(2, max_lr=2.0, min_lr=0.0, warmup_steps=0, total_steps=9) == pytest.approx(quarter)
    assert lr_at(2, **dict(sched, warmup_steps=1)) == lr_at(2, **sched)  # warmup 1 == no warmup


@pytest.mark.parametrize(
    "kwargs, words",
    [
        (dict(step=-1), "step must be >= 0"),
        (dict(max_lr=-1.0, min_lr=-2.0), "max_lr must be >= 0"),
        (dict(min_lr=-0.1), "min_lr must be >= 0"),
        (dict(warmup_steps=-3), "warmup_steps must be >= 0"),
        (dict(min_lr=2.0), "min_lr (2.0) must not exceed max_lr (1.0)"),
        (dict(total_steps=0), "total_steps must be >= 1"),
        (dict(warmup_steps=20), "warmup_steps (20) must not exceed total_steps (15)"),
        (dict(step=1.5), "step must be an integer"),
    ],
)
def test_lr_at_refuses_bad_arguments(kwargs, words):
    args = dict(SCHED, step=0)
    args.update(kwargs)
    step = args.pop("step")
    with pytest.raises(TensorparError) as e:
        lr_at(step, **args)
    assert words in str(e.value)


def test_set_lr_sets_every_group():
    opt = build_optimizer(nn.Linear(3, 2), lr=1.0, weight_decay=0.1)
    set_lr(opt, lr_at(0, **SCHED))
    assert [g["lr"] for g in opt.param_groups] == [pytest.approx(0.2)] * 2
    with pytest.raises(TensorparError):
        set_lr(opt, -1.0)


# -- optimizer (in process) ----------------------------------------------------------------------


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.fc = nn.Linear(4, 6)
        self.norm = nn.LayerNorm(6)
        self.head = nn.Linear(6, 3, bias=False)
        self.frozen = nn.Linear(3, 3)
        self.frozen.requires_grad_(False)


def test_build_optimizer_decays_matrices_and_embeddings_only():
    model = Tiny()
    opt = build_optimizer(model, lr=1e-3, weight_decay=0.1, betas=(0.8, 0.9), eps=1e-6)
    assert isinstance(opt, torch.optim.AdamW)
    names = {id(p): n for n, p in model.named_parameters()}
    decay, no_decay = ([names[id(p)] for p in g["params"]] for g in opt.param_groups)
    assert decay == ["emb.weight", "fc.weight", "head.weight"]
    assert no_decay == ["fc.bias", "norm.weight", "norm.bias"]
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
    g = opt.param_groups[0]
    assert (g["lr"], g["betas"], g["eps"], g["foreach"], g["fused"]) == (1e-3, (0.8, 0.9), 1e-6, True, False)

    # a step equals plain AdamW with the same groups
    ref = copy.deepcopy(model)
    torch.manual_seed(0)
    for p, q in zip(model.parameters(), ref.parameters()):
        if p.requires_grad:
            p.grad = torch.randn_like(p)
            q.grad = p.grad.clone()
    ref_opt = torch.optim.AdamW(
        [
            {"params": [ref.emb.weight, ref.fc.weight, ref.head.weight], "weight_decay": 0.1},
            {"params": [ref.fc.bias, ref.norm.weight, ref.norm.bias], "weight_decay": 0.0},
        ],
        lr=1e-3, betas=(0.8, 0.9), eps=1e-6, foreach=False,
    )
    opt.step()
    ref_opt.step()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.allclose(p, q, rtol=1e-6, atol=1e-7), name


def test_build_optimizer_refuses_a_model_without_trainable_parameters():
    with pytest.raises(TensorparError, match="no trainable parameters"):
        build_optimizer(nn.Linear(2, 2).requires_grad_(False), lr=1e-3, weight_decay=0.1)


# -- gradient norm on one rank (in process) ------------------------------------------------------


def _one_rank_mesh():
    import tensorpar

    return tensorpar.init_mesh(tp=1)  # a world of one: no process group, no communication


def test_grad_norm_on_one_rank_matches_torch_in_fp32_for_half_grads():
    m = _one_rank_mesh()
    a = nn.Parameter(torch.zeros(3, 4, dtype=torch.float16))
    b = nn.Parameter(torch.zeros(5, dtype=torch.bfloat16))
    c = nn.Parameter(torch.zeros(2))  # grad None: counts as zero
    a.grad = torch.full_like(a, 300.0)  # 300**2 overflows float16: the squares must be fp32
    b.grad = torch.arange(5, dtype=torch.bfloat16)
    norm = global_grad_norm([a, b, c], m)
    expected = math.sqrt(12 * 300.0**2 + sum(i * i for i in range(5)))
    assert norm.dtype == torch.float32 and norm.dim() == 0
    assert norm.item() == pytest.approx(expected, rel=1e-6)
    assert m.stats.calls() == 0

    # max_norm <= 0: no clipping, the norm is still returned
    assert clip_grad_norm_([a, b, c], 0.0, m).item() == pytest.approx(expected, rel=1e-6)
    assert torch.equal(a.grad, torch.full_like(a, 300.0))
    before = clip_grad_norm_(iter([a, b, c]), expected / 2, m)  # a generator is fine too
    assert before.item() == pytest.approx(expected, rel=1e-6)
    assert global_grad_norm([a, b, c], m).item() == pytest.approx(expected / 2, rel=1e-2)  # half-precision grads
    assert global_grad_norm([], m).item() == 0.0


# -- gradient norm across ranks ------------------------------------------------------------------

H, VOCAB, HEAD_DIM = 12, 1001, 4


def _dense_model():
    torch.manual_seed(0)  # the same on every rank
    dense = nn.ModuleDict({
        "emb": nn.Embedding(VOCAB, H),
        "fc1": nn.Linear(H, 4 * H),
        "fc2": nn.Linear(4 * H, H),
        "norm": nn.LayerNorm(H),
        "kv": nn.Linear(H, 2 * HEAD_DIM, bias=False),  # 2 "heads" of HEAD_DIM rows
    })
    for name, p in dense.named_parameters():
        # small parameters get large gradients, so counting a replicated one twice would show
        p.grad = torch.randn_like(p) * (1.0 if p.ndim == 2 else 10.0)
    return dense


def _tp_pieces(dense, m):
    """(name, TP param, dense param) for every dense parameter, this rank's shards."""
    tp, rank = m.tp_size, m.tp_rank
    col = ColumnParallelLinear.from_dense(dense["fc1"], m)
    row = RowParallelLinear.from_dense(dense["fc2"], m)  # its bias is replicated
    emb = VocabParallelEmbedding.from_dense(dense["emb"], m)  # 1001 rows, padded
    norm = copy.deepcopy(dense["norm"])
    tag(norm.weight, ShardSpec(dim=None))  # norm.bias stays untagged: replicated as well
    # KV heads shared by TP ranks: 2 heads over TP=4 (2 ranks per head), 1 head over TP=2 or 3
    heads = 2 if tp == 4 else 1
    kv_spec = ShardSpec(dim=0, full_size=heads * HEAD_DIM, replicas=tp // heads)
    kv_full = dense["kv"].weight.detach()[: heads * HEAD_DIM]
    kv_dense = nn.Parameter(kv_full.clone())
    kv_dense.grad = dense["kv"].weight.grad[: heads * HEAD_DIM].clone()
    kv = tag(nn.Parameter(shard_tensor(kv_full, kv_spec, rank, tp)), kv_spec)
    pieces = [
        ("emb.weight", emb.weight, dense["emb"].weight),
        ("fc1.weight", col.weight, dense["fc1"].weight),
        ("fc1.bias", col.bias, dense["fc1"].bias),
        ("fc2.weight", row.weight, dense["fc2"].weight),
        ("fc2.bias", row.bias, dense["fc2"].bias),
        ("norm.weight", norm.weight, dense["norm"].weight),
        ("norm.bias", norm.bias, dense["norm"].bias),
        ("kv.weight", kv, kv_dense),
    ]
    for name, p, d in pieces:
        spec = shard_spec(p)
        assert torch.equal(p.detach(), shard_tensor(d.detach(), spec, rank, tp)), f"{name}: not the matching shard"
        p.grad = shard_tensor(d.grad, spec, rank, tp)  # padding rows zero
    return pieces, heads


def check_grad_norm(tp, pp=1, dp=None):
    m = mesh(tp=tp, pp=pp, dp=dp)
    dense = _dense_model()
    pieces, heads = _tp_pieces(dense, m)
    dense_params = [d for _, _, d in pieces]  # every dense parameter, all stages
    if pp > 1:  # each stage holds different layers
        pieces = [x for i, x in enumerate(pieces) if i % pp == m.pp_rank]
    local = [p for _, p, _ in pieces]

    m.stats.reset()
    norm = global_grad_norm(local, m)
    norm_counts = {k: (v.calls, v.elements) for k, v in m.stats.snapshot().items()}
    expected = torch.nn.utils.clip_grad_norm_(dense_params, float("inf"))  # no clipping: the norm
    max_norm = expected.item() / 3

    m.stats.reset()
    before = clip_grad_norm_(local, max_norm, m)
    clip_counts = {k: (v.calls, v.elements) for k, v in m.stats.snapshot().items()}
    torch.nn.utils.clip_grad_norm_(dense_params, max_norm)  # the dense grads, clipped
    grad_errs = {
        name: rel_err(p.grad, shard_tensor(d.grad, shard_spec(p), m.tp_rank, m.tp_size)) for name, p, d in pieces
    }
    return {
        "norm": norm.item(),
        "dtype": str(norm.dtype),
        "expected": expected.item(),
        "before clip": before.item(),
        "after clip": global_grad_norm(local, m).item(),
        "max_norm": max_norm,
        "grad errs": grad_errs,
        "norm counts": norm_counts,
        "clip counts": clip_counts,
        "heads": heads,
    }


def _assert_norms(results, counts):
    norms = {r["norm"] for r in results}
    assert len(norms) == 1, f"ranks disagree on the norm: {norms}"
    for rank, r in enumerate(results):
        assert r["dtype"] == "torch.float32"
        assert rel_err(torch.tensor(r["norm"]), torch.tensor(r["expected"])) <= 1e-6, (rank, r)
        assert r["before clip"] == r["norm"], (rank, r)
        assert r["after clip"] == pytest.approx(r["max_norm"], rel=1e-5), (rank, r)
        bad = {k: v for k, v in r["grad errs"].items() if v > 1e-6}
        assert not bad, f"rank {rank}: clipped grads differ from the dense clipped grads: {bad}"
        assert r["norm counts"] == counts, (rank, r["norm counts"])
        assert r["clip counts"] == counts, (rank, r["clip counts"])


@pytest.mark.parametrize("tp", [2, 3, 4])
def test_global_grad_norm_and_clipping_match_the_dense_model(pools, tp):
    results = pools(tp).run(check_grad_norm, tp)
    assert results[0]["heads"] == (2 if tp == 4 else 1)  # KV tensors held by 2, 2 and 3 ranks
    _assert_norms(results, {("all_reduce", "tp"): (1, 1)})


def test_data_parallel_replicas_are_not_counted_twice(pools):
    results = pools(4).run(check_grad_norm, 2, 1, 2)  # tp=2, dp=2
    _assert_norms(results, {("all_reduce", "tp"): (1, 1)})


def test_pipeline_stages_are_summed(pools):
    results = pools(4).run(check_grad_norm, 2, 2, 1)  # tp=2, pp=2: each stage holds half the layers
    _assert_norms(results, {("all_reduce", "tp"): (1, 1), ("all_reduce", "pp"): (1, 1)})
