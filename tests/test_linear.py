"""Column- and row-parallel linears against nn.Linear: outputs, input and weight gradients, weights after a
step, communication counts, seeded initialisation identical at any TP size, sizes that do not divide.
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tensorpar.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    tp_region,
)

from checks import rel_err
from harness import mesh

TP_SIZES = [1, 2, 3, 4]


B, S, H = 2, 12, 12  # S and H divide by 1, 2, 3 and 4


def _errors(pairs):
    return {name: rel_err(a, b) for name, (a, b) in pairs.items()}


def check_mlp(tp, sequence_parallel, tp_overlap=False, batch=B, seq=S):
    """Column -> gelu -> Row against nn.Linear -> gelu -> nn.Linear, and what was communicated."""
    m = mesh(tp=tp)
    g = m.tp_group
    torch.manual_seed(0)
    fc1, fc2 = nn.Linear(H, 4 * H), nn.Linear(4 * H, H)
    x = torch.randn(batch, seq, H, requires_grad=True)
    probe = torch.randn(batch, seq, H)  # a random cotangent, so every gradient entry matters
    y = fc2(F.gelu(fc1(x)))
    (y * probe).sum().backward()

    region = tp_region(g, sequence_parallel=sequence_parallel, overlap=tp_overlap)
    col = ColumnParallelLinear.from_dense(fc1, region)
    row = RowParallelLinear.from_dense(fc2, region)
    if sequence_parallel:
        x_local = x.detach().chunk(tp, 1)[g.rank].clone().requires_grad_()
        probe_local, y_expected, dx_expected = probe.chunk(tp, 1)[g.rank], y.chunk(tp, 1)[g.rank], x.grad.chunk(tp, 1)[g.rank]
    else:
        x_local = x.detach().clone().requires_grad_()
        probe_local, y_expected, dx_expected = probe, y, x.grad
    y_local = row(F.gelu(col(x_local)))
    forward_counts = m.stats.snapshot()
    (y_local * probe_local).sum().backward()
    all_counts = m.stats.snapshot()

    errs = _errors({
        "output": (y_local, y_expected),
        "input grad": (x_local.grad, dx_expected),
        "fc1 weight grad": (col.weight.grad, fc1.weight.grad.chunk(tp, 0)[g.rank]),
        "fc1 bias grad": (col.bias.grad, fc1.bias.grad.chunk(tp, 0)[g.rank]),
        "fc2 weight grad": (row.weight.grad, fc2.weight.grad.chunk(tp, 1)[g.rank]),
        "fc2 bias grad": (row.bias.grad, fc2.bias.grad),
    })
    dense_opt = torch.optim.AdamW(list(fc1.parameters()) + list(fc2.parameters()), lr=1e-2, weight_decay=0.1)
    par_opt = torch.optim.AdamW(list(col.parameters()) + list(row.parameters()), lr=1e-2, weight_decay=0.1)
    dense_opt.step()
    par_opt.step()
    errs.update(_errors({
        "fc1 weight after AdamW": (col.weight, fc1.weight.chunk(tp, 0)[g.rank]),
        "fc2 weight after AdamW": (row.weight, fc2.weight.chunk(tp, 1)[g.rank]),
        "fc2 bias after AdamW": (row.bias, fc2.bias),
    }))
    counts = lambda snap: {k: (v.calls, v.elements) for k, v in snap.items()}  # noqa: E731
    return errs, counts(forward_counts), counts(all_counts)


@pytest.mark.parametrize("tp", TP_SIZES)
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp+sp"])
def test_column_row_mlp_matches_dense(pools, tp, sequence_parallel):
    for rank, (errs, fwd, total) in enumerate(pools(tp).run(check_mlp, tp, sequence_parallel)):
        bad = {k: v for k, v in errs.items() if v > 1e-5}
        assert not bad, f"rank {rank}: {bad}"
        if tp == 1:
            assert total == {}, "a one-rank group must communicate nothing"
        elif not sequence_parallel:
            # one all-reduce of B*S*H forward (g) and one backward (f); nothing else
            assert fwd == {("all_reduce", "tp"): (1, B * S * H)}
            assert total == {("all_reduce", "tp"): (2, 2 * B * S * H)}
        else:
            # forward: all-gather into the column layer, reduce-scatter out of the row layer;
            # backward: their conjugates, plus the all-reduce of the replicated fc2 bias gradient (H elements)
            assert fwd == {("all_gather", "tp"): (1, B * S * H), ("reduce_scatter", "tp"): (1, B * S * H)}
            assert total == {
                ("all_gather", "tp"): (2, 2 * B * S * H),
                ("reduce_scatter", "tp"): (2, 2 * B * S * H),
                ("all_reduce", "tp"): (1, H),
            }


def check_unparallel_ends(tp):
    """ColumnParallelLinear(gather_output=True) and RowParallelLinear(input_is_parallel=False) on their own."""
    m = mesh(tp=tp)
    torch.manual_seed(1)
    dense = nn.Linear(H, 2 * H)
    x = torch.randn(B, S, H, requires_grad=True)
    probe = torch.randn(B, S, 2 * H)
    (dense(x) * probe).sum().backward()
    errs = {}
    for name, layer, split in (
        ("column gather_output", ColumnParallelLinear.from_dense(dense, m, gather_output=True), 0),
        ("row input_is_parallel=False", RowParallelLinear.from_dense(dense, m, input_is_parallel=False), 1),
    ):
        x_local = x.detach().clone().requires_grad_()
        y = layer(x_local)
        (y * probe).sum().backward()
        errs.update(_errors({
            f"{name} output": (y, dense(x)),
            f"{name} input grad": (x_local.grad, x.grad),
            f"{name} weight grad": (layer.weight.grad, dense.weight.grad.chunk(tp, split)[m.tp_rank]),
        }))
    return errs


@pytest.mark.parametrize("tp", TP_SIZES)
def test_gathered_and_scattered_ends_match_dense(pools, tp):
    for errs in pools(tp).run(check_unparallel_ends, tp):
        assert max(errs.values()) <= 1e-5, errs


def check_same_init_any_tp(tp):
    """Seeded full weight, then split: every TP size starts from the same full weights."""
    from tensorpar.distributed.comm import Group

    m = mesh(tp=tp)
    g = m.tp_group
    results = {}
    for seed in (123, None):
        torch.manual_seed(7)  # seed=None draws the layer's seed from torch's global RNG
        col = ColumnParallelLinear(H, 2 * H, m, seed=seed)
        row = RowParallelLinear(2 * H, H, m, seed=seed)
        emb = VocabParallelEmbedding(1001, H, m, seed=seed)
        torch.manual_seed(7)
        one = Group.single("tp")
        col1, row1, emb1 = (
            ColumnParallelLinear(H, 2 * H, one, seed=seed),
            RowParallelLinear(2 * H, H, one, seed=seed),
            VocabParallelEmbedding(1001, H, one, seed=seed),
        )
        results[f"seed={seed}"] = (
            torch.equal(g.all_gather(col.weight.detach(), 0), col1.weight)
            and torch.equal(g.all_gather(col.bias.detach(), 0), col1.bias)
            and torch.equal(g.all_gather(row.weight.detach(), 1), row1.weight)
            and torch.equal(row.bias, row1.bias)
            and torch.equal(g.all_gather(emb.weight.detach(), 0)[:1001], emb1.weight)
        )
    # and the default init is nn.Linear's: same distribution bounds
    results["linear bound"] = bool(col1.weight.abs().max() <= 1 / H**0.5)
    return results


@pytest.mark.parametrize("tp", [2, 3, 4])
def test_initialisation_is_identical_across_tp_sizes(pools, tp):
    for results in pools(tp).run(check_same_init_any_tp, tp):
        assert all(results.values()), results


def check_bad_sizes(tp):
    from tensorpar.errors import LayoutError

    m = mesh(tp=tp)
    messages = []
    for build in (lambda: ColumnParallelLinear(8, 10, m), lambda: RowParallelLinear(10, 8, m)):
        try:
            build()
            messages.append(None)
        except LayoutError as e:
            messages.append(str(e))
    return messages


@pytest.mark.parametrize("tp", [3, 4])
def test_linear_size_that_does_not_divide_is_refused_on_every_rank(pools, tp):
    for col_msg, row_msg in pools(tp).run(check_bad_sizes, tp):
        assert col_msg and "out_features = 10" in col_msg and f"tensor-parallel size {tp}" in col_msg
        assert row_msg and "in_features = 10" in row_msg and f"tensor-parallel size {tp}" in row_msg


def test_from_dense_names_a_module_of_another_kind():
    """from_dense(a Conv1d, say Hugging Face GPT-2's transposed Conv1D) failed on a missing attribute, in_features."""
    from tensorpar.errors import TensorparError

    with pytest.raises(TensorparError, match="ColumnParallelLinear.from_dense takes a torch nn.Linear, got Conv1d"):
        ColumnParallelLinear.from_dense(nn.Conv1d(2, 2, 1))
    with pytest.raises(TensorparError, match="VocabParallelEmbedding.from_dense takes a torch nn.Embedding, got "
                                             "Linear"):
        VocabParallelEmbedding.from_dense(nn.Linear(2, 2))
