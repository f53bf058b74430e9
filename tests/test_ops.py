"""The autograd conjugates: each op's forward and backward against what the dense math requires.

Each rank r feeds x_r and backpropagates a cotangent c_r; the expected outputs and input
gradients are written out from the definitions, so a wrong collective in either direction fails.
"""

import pytest
import torch

from tensorpar.expert_parallel import ep_mappings
from tensorpar.tensor_parallel import mappings as ops

from harness import mesh


def _t(rank, shape, salt=0.0):
    torch.manual_seed(1000 * rank + int(salt))
    return torch.randn(shape, dtype=torch.float64)


def check_conjugates(tp):
    m = mesh(tp=tp)
    g = m.tp_group
    r, n = g.rank, g.size
    xs = [_t(i, (2, 4 * n, 3 * n)) for i in range(n)]  # every rank can compute every rank's input
    cs = [_t(i, (2, 4 * n, 3 * n), salt=1) for i in range(n)]
    results = {}

    def run(name, fn, x, c, want_out, want_grad):
        x = x.clone().requires_grad_()
        out = fn(x)
        out.backward(c)
        results[name] = (torch.allclose(out, want_out, atol=1e-12), torch.allclose(x.grad, want_grad, atol=1e-12))

    chunk = lambda t, dim: t.chunk(n, dim)[r]  # noqa: E731
    total_c = sum(cs)
    run("copy_to_tp", lambda x: ops.copy_to_tp(x, g), xs[r], cs[r], xs[r], total_c)
    run("reduce_from_tp", lambda x: ops.reduce_from_tp(x, g), xs[r], cs[r], sum(xs), cs[r])
    run("gather_from_tp", lambda x: ops.gather_from_tp(x, g), chunk(xs[r], -1), cs[r],
        torch.cat([chunk_i for chunk_i in (xs[i].chunk(n, -1)[i] for i in range(n))], -1), chunk(cs[r], -1))
    run("scatter_to_tp", lambda x: ops.scatter_to_tp(x, g), xs[r], chunk(cs[r], -1),
        chunk(xs[r], -1), torch.cat([cs[i].chunk(n, -1)[i] for i in range(n)], -1))
    run("gather_from_sp", lambda x: ops.gather_from_sp(x, g), chunk(xs[r], 1), cs[r],
        torch.cat([xs[i].chunk(n, 1)[i] for i in range(n)], 1), chunk(total_c, 1))
    run("gather_from_sp(grad_is_partial=False)", lambda x: ops.gather_from_sp(x, g, grad_is_partial=False),
        chunk(xs[r], 1), cs[r], torch.cat([xs[i].chunk(n, 1)[i] for i in range(n)], 1), chunk(cs[r], 1))
    run("reduce_scatter_to_sp", lambda x: ops.reduce_scatter_to_sp(x, g), xs[r], chunk(cs[r], 1),
        chunk(sum(xs), 1), torch.cat([cs[i].chunk(n, 1)[i] for i in range(n)], 1))
    run("scatter_to_sp", lambda x: ops.scatter_to_sp(x, g), xs[r], chunk(cs[r], 1),
        chunk(xs[r], 1), torch.cat([cs[i].chunk(n, 1)[i] for i in range(n)], 1))
    # expert-TP's row collectives (any group): rank i holds sizes[i] rows, some none
    sizes = [(3 * i) % 4 for i in range(n)] if n > 1 else [2]
    total, start = sum(sizes), sum(sizes[:r])
    rows = [_t(i, (sizes[i], 5), salt=2) for i in range(n)]
    full_cs = [_t(i, (total, 5), salt=3) for i in range(n)]
    run("gather_from_expert_tp", lambda x: ep_mappings.gather_from_expert_tp(x, sizes, g), rows[r], full_cs[r],
        torch.cat(rows), sum(full_cs)[start : start + sizes[r]])
    fulls = [_t(i, (total, 5), salt=4) for i in range(n)]
    row_cs = [_t(i, (sizes[i], 5), salt=5) for i in range(n)]
    run("reduce_scatter_to_expert_tp", lambda x: ep_mappings.reduce_scatter_to_expert_tp(x, sizes, g), fulls[r], row_cs[r],
        sum(fulls)[start : start + sizes[r]], torch.cat(row_cs))
    return results


@pytest.mark.parametrize("tp", [1, 2, 3, 4])
def test_conjugate_pairs(pools, tp):
    for rank, results in enumerate(pools(tp).run(check_conjugates, tp)):
        wrong = {name: ok for name, ok in results.items() if ok != (True, True)}
        assert not wrong, f"rank {rank}: (forward ok, backward ok) = {wrong}"


def check_sequence_not_divisible(tp):
    from tensorpar.errors import LayoutError

    g = mesh(tp=tp).tp_group
    try:
        ops.scatter_to_sp(torch.randn(2, 5, 4), g)
    except LayoutError as e:
        return str(e)
    return None


def test_sequence_split_that_does_not_divide_is_a_clear_error(pools):
    for message in pools(2).run(check_sequence_not_divisible, 2):
        assert message and "size 5" in message and "2 ranks" in message
