"""The dense model's gradient norm and clipping, from TP/PP-sharded gradients."""

import copy
import math

import pytest
import torch
from torch import nn

from tensorpar.distributed.sharding import ShardSpec, shard_spec, shard_tensor, tag
from tensorpar.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from tensorpar.optim import clip_grad_norm_, global_grad_norm

from checks import rel_err
from harness import mesh


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
