"""FP8 GEMMs: column- and row-parallel fp8 layers at TP 1-4 (with and without SP) against the TP 1 fp8 layer and
a plain torch._scaled_mm reference on the dense weight, for both recipes; the amax all-reduce they add."""

import pytest
import torch
from torch import nn

from tensorpar.distributed.comm import Group
from tensorpar.layers import ColumnParallelLinear, RowParallelLinear, tp_region
from tensorpar.tensor_parallel.fp8_scaling import FP8_RECIPES, Fp8Recipe, fp8_unsupported

from checks import rel_err
from harness import mesh

pytestmark = pytest.mark.skipif(fp8_unsupported("cpu") is not None, reason="this torch has no fp8")

B, S, H, F = 2, 12, 12, 24  # S, H and F divide by 1, 2, 3 and 4
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def _q(t, fmt, dim=None):
    """(fp8 values, scale) of t with a power-of-two scale from its amax (per row along `dim` when given)."""
    a = t.abs().amax() if dim is None else t.abs().amax(dim=dim, keepdim=True)
    s = 2.0 ** torch.floor(torch.log2(torch.finfo(fmt).max / a.clamp(min=1e-30)))  # an all-zero row: any scale
    return (t * s).to(fmt), s


def _mm(a, sa, b, sb):
    """(a / sa) @ (b / sb)^T through torch._scaled_mm, fp32 out; b [N, K]."""
    rowwise = sa.dim() > 0
    return torch._scaled_mm(a, b.t(), (1 / sa).float(), (1 / sb).float().t() if rowwise else (1 / sb).float(),
                            out_dtype=torch.float32)


def reference(x, w, g, recipe):
    """A dense fp8 linear written out: y = x W^T, dx = g W, dW = g^T x as each recipe quantises them."""
    x2, g2 = x.reshape(-1, x.shape[-1]), g.reshape(-1, g.shape[-1])
    if recipe == "tensorwise":
        (xq, sx), (wq, sw), (gq, sg) = _q(x2, E4M3), _q(w, E4M3), _q(g2, E5M2)
        dw = _mm(gq.t().contiguous(), sg, xq.t().contiguous(), sx)
        dx = _mm(gq, sg, wq.t().contiguous(), sw)
    else:
        (xq, sx), (wq, sw), (gq, sg) = _q(x2, E4M3, -1), _q(w, E4M3, -1), _q(g2, E4M3, -1)
        wcq, swc = _q(w, E4M3, 0)
        dw = g2.t() @ x2
        dx = _mm(gq, sg, wcq.t().contiguous(), swc.t())
    y = _mm(xq, sx, wq, sw)
    return y.view(*x.shape[:-1], -1), dx.view_as(x), dw


def _run(layer, x, probe):
    x = x.detach().clone().requires_grad_()
    y = layer(x)
    (y * probe).sum().backward()
    return y.detach(), x.grad, layer.weight.grad


def check_fp8_layers(tp):
    """Errors of the fp8 column and row layers at this TP size against TP 1 (and TP 1 against the reference),
    per recipe and SP; and the collectives of one column layer's forward."""
    m = mesh(tp=tp)
    g, r = m.tp_group, m.tp_rank
    torch.manual_seed(0)
    col_dense, row_dense = nn.Linear(H, F), nn.Linear(F, H)
    x, h = torch.randn(B, S, H), torch.randn(B, S, F)  # the inputs of the column and the row layer
    gc, gr = torch.randn(B, S, F), torch.randn(B, S, H)  # their output gradients
    with torch.no_grad():
        # Outliers in the last TP shard, each multiplied by zeros, so that they set the scales but not the results:
        # another shard scaled by its own amax would round its small values differently (with power-of-two scales
        # only values near the bottom of the fp8 range change, so the outliers are large).
        col_dense.weight[-1] *= 1000
        gc[..., -1] = 0
        gc[..., -2] *= 1000
        col_dense.weight[-2] = 0
        h[..., -1] *= 1000
        row_dense.weight[:, -1] = 0
        row_dense.weight[:, -2] *= 1000
        h[..., -2] = 0
    errs, counts = {}, {}
    for recipe in FP8_RECIPES:
        one = tp_region(Group.single("tp"), fp8=Fp8Recipe(recipe))
        y1, dx1, dw1 = _run(ColumnParallelLinear.from_dense(col_dense, one), x, gc)
        z1, dh1, dv1 = _run(RowParallelLinear.from_dense(row_dense, one), h, gr)
        ry, rdx, rdw = reference(x, col_dense.weight.detach(), gc, recipe)
        errs[f"{recipe} tp1 vs reference"] = max(rel_err(y1 - col_dense.bias, ry), rel_err(dx1, rdx),
                                                 rel_err(dw1, rdw))
        for sp in (False, True):
            region = tp_region(g, sequence_parallel=sp, fp8=Fp8Recipe(recipe))
            seq = (lambda t: t.chunk(tp, 1)[r]) if sp and tp > 1 else (lambda t: t)
            col = ColumnParallelLinear.from_dense(col_dense, region)
            m.stats.reset()
            y, dx, dw = _run(col, seq(x), gc.chunk(tp, -1)[r])
            if sp:
                counts[recipe] = {k: (v.calls, v.elements) for k, v in m.stats.snapshot().items()}
            z, dh, dv = _run(RowParallelLinear.from_dense(row_dense, region), h.chunk(tp, -1)[r], seq(gr))
            errs[f"{recipe} sp={sp}"] = max(
                rel_err(y, y1.chunk(tp, -1)[r]), rel_err(dx, seq(dx1)), rel_err(dw, dw1.chunk(tp, 0)[r]),
                rel_err(z, seq(z1)), rel_err(dh, dh1.chunk(tp, -1)[r]), rel_err(dv, dv1.chunk(tp, 1)[r]))
    return errs, counts


@pytest.mark.parametrize("tp", [1, 2, 3, 4])
def test_fp8_parallel_layers_equal_tp1_and_a_scaled_mm_reference(pools, tp):
    for rank, (errs, counts) in enumerate(pools(tp).run(check_fp8_layers, tp)):
        bad = {k: v for k, v in errs.items() if not v <= 1e-5}  # NaN fails too
        assert not bad, f"rank {rank}: {bad}"
        if tp > 1:  # SP: the all-gather in and the reduce-scatter of the input gradient, as in bf16; plus small
            # all-reduces (max) of the split amaxes: tensorwise the weight's forward and the output gradient's
            # backward; rowwise one backward, of the output gradient's per token and the weight's per input feature
            rows = B * S
            assert counts["tensorwise"] == {("all_gather", "tp"): (1, B * S * H), ("reduce_scatter", "tp"): (1, B * S * H),
                                            ("all_reduce", "tp"): (2, 2)}
            assert counts["rowwise"] == {("all_gather", "tp"): (1, B * S * H), ("reduce_scatter", "tp"): (1, B * S * H),
                                         ("all_reduce", "tp"): (1, H + rows)}


@pytest.mark.parametrize("recipe", FP8_RECIPES)
def test_torch_compile_traces_the_fp8_linear_whole(recipe):
    """torch.compile (fullgraph: a graph break fails) traces the fp8 linear's autograd Function and its no-grad
    path, and computes what eager does; the amaxes still reach the recipe's statistics. A side effect inside the
    Function used to make dynamo give up on it: the casts then ran eagerly, recompiled for each weight shape."""
    from tensorpar.tensor_parallel.fp8_linear import fp8_linears

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(B, S, H, generator=gen)
    w1, w2 = torch.randn(F, H, generator=gen) / 4, torch.randn(H, H, generator=gen) / 4

    def step(x, w1, w2, rec):
        y1, y2 = fp8_linears(x, [w1, w2], rec)
        return y1.square().sum() + y2.sum()

    def grads(fn, rec):
        xs, ws = x.clone().requires_grad_(), [w.clone().requires_grad_() for w in (w1, w2)]
        loss = fn(xs, *ws, rec)
        loss.backward()
        with torch.no_grad():
            evaluated = fn(x, w1, w2, rec)
        return [loss, evaluated, xs.grad, *(w.grad for w in ws)]

    eager_recipe, compiled_recipe = Fp8Recipe(recipe), Fp8Recipe(recipe)
    eager = grads(step, eager_recipe)
    compiled = grads(torch.compile(step, backend="aot_eager", fullgraph=True), compiled_recipe)
    for a, b in zip(compiled, eager):
        assert rel_err(a, b) <= 1e-6
    taken = compiled_recipe.stats.take()
    assert {"fp8_amax_input", "fp8_amax_weight"} <= taken.keys()
    assert taken["fp8_amax_input"] == eager_recipe.stats.take()["fp8_amax_input"] == float(x.abs().amax())


@pytest.mark.parametrize("recipe", FP8_RECIPES)
def test_a_linear_of_no_rows_runs_forward_and_backward(recipe):
    """An expert that received no tokens runs its fp8 GEMMs on 0 rows (the loop over a rank's experts): rowwise's
    per-row amaxes are then empty, which Tensor.amax() refused (a RuntimeError mid-run in MoE fp8 rowwise training
    and validation)."""
    from tensorpar.tensor_parallel.fp8_linear import fp8_linears

    r = Fp8Recipe(recipe)
    for grad in (False, True):
        x = torch.randn(0, 16, dtype=torch.bfloat16, requires_grad=grad)
        w = torch.randn(8, 16, dtype=torch.bfloat16, requires_grad=grad)
        y = fp8_linears(x, [w], r)[0]
        assert y.shape == (0, 8)
        if grad:
            y.sum().backward()
            assert x.grad.shape == (0, 16) and torch.count_nonzero(w.grad) == 0
