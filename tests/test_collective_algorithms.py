"""The ring / tree collectives over send/recv (tensorpar.distributed.collective_algorithms) equal
torch.distributed's, move what the simulation moves, and work on subgroups.
"""

import pytest
import torch

from tensorpar.distributed import collective_algorithms as C
from tensorpar.distributed import collective_simulation as S

from harness import mesh
from test_collective_simulation import _expected, _lengths  # noqa: F401


def _inputs(n, shape, seed):
    """Every rank's integer-valued float tensor (same on every process, so any rank can compute any rank's)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(-50, 50, shape, generator=g).float() for _ in range(n)]


def _run(m, fn):
    """(result, {(op, group): (calls, elements)}, events) of one implementation, counted alone."""
    m.stats.reset()
    events = []
    out = fn(events)
    counts = {k: (v.calls, v.elements) for k, v in m.stats.snapshot().items()}
    return out, counts, events


def _lists(t):
    return None if t is None else (list(t.shape), t.flatten().tolist())


def check_real_collectives(n):
    m = mesh(tp=n)
    g = m.tp_group
    assert g.size == n
    me = g.rank
    out = {}

    shape = (2 * n, 3)  # 6 elements per ring chunk
    x = _inputs(n, shape, 1)[me]

    mine, counts, ev = _run(m, lambda t: C.ring_all_reduce(x.clone(), g, trace=t))
    out["ring_all_reduce"] = (_lists(mine), _lists(g.all_reduce(x.clone())), counts, ev)

    # in place, also through a non-contiguous view; and sizes that do not divide (some chunks empty)
    y = x.clone().t()
    same = C.ring_all_reduce(y, g) is y
    ref = g.all_reduce(x.clone().t())
    out["ring_all_reduce_noncontiguous"] = (_lists(y) if same else None, _lists(ref), None, None)
    for numel in (5, 1):
        z = _inputs(n, (numel,), 7)[me]
        mine = C.ring_all_reduce(z.clone(), g)
        out[f"ring_all_reduce_{numel}"] = (_lists(mine), _lists(g.all_reduce(z.clone())), None, None)

    small = _inputs(n, (2, 3), 2)[me]
    mine, counts, ev = _run(m, lambda t: C.ring_all_gather(small, g, trace=t))
    out["ring_all_gather"] = (_lists(mine), _lists(g.all_gather(small)), counts, ev)

    before = x.clone()
    mine, counts, ev = _run(m, lambda t: C.ring_reduce_scatter(x, g, trace=t))
    assert torch.equal(x, before), "reduce-scatter must leave its input alone"
    out["ring_reduce_scatter"] = (_lists(mine), _lists(g.reduce_scatter(x.clone())), counts, ev)

    for root in sorted({0, n - 1}):
        mine, counts, ev = _run(m, lambda t: C.tree_reduce(x.clone(), g, root=root, trace=t))
        ref = g.reduce(x.clone(), dst=root)
        if me != root:  # other ranks' buffers are undefined after a reduce
            mine = ref = None
        out[f"tree_reduce_{root}"] = (_lists(mine), _lists(ref), counts, ev)

        src = x.clone() if me == root else torch.zeros(shape)
        mine, counts, ev = _run(m, lambda t: C.tree_broadcast(src, g, root=root, trace=t))
        out[f"tree_broadcast_{root}"] = (_lists(mine), _lists(g.broadcast(x.clone(), src=root)), counts, ev)

        mine, counts, ev = _run(m, lambda t: C.tree_all_reduce(x.clone(), g, root=root, trace=t))
        out[f"tree_all_reduce_{root}"] = (_lists(mine), _lists(g.all_reduce(x.clone())), counts, ev)

        mine, counts, ev = _run(m, lambda t: C.tree_gather(small, g, root=root, trace=t))
        out[f"tree_gather_{root}"] = (_lists(mine), _lists(g.gather(small, dst=root)), counts, ev)

        full = _inputs(n, (2 * n, 3), 3)[root]  # only the root's matters
        arg = full if me == root else None
        mine, counts, ev = _run(
            m, lambda t: C.tree_scatter(arg, g, root=root, shape=(2, 3), dtype=torch.float32, trace=t)
        )
        ref = g.scatter(arg, src=root, shape=(2, 3), dtype=torch.float32)
        out[f"tree_scatter_{root}"] = (_lists(mine), _lists(ref), counts, ev)
    return out


def _sim_messages(collective, algorithm, n, root, rank):
    """This rank's sends and receives in the simulation's schedule: [(step, kind, peer, chunk)]."""
    length = 2 * n if collective not in ("reduce-scatter", "scatter") else n
    inputs = [[float(i) for i in range(length)] for _ in range(n)]
    _, trace = S.simulate(collective, inputs, algorithm, root=root)
    mine = []
    for step in trace:
        for t in step.transfers:
            if t.src == rank:
                mine.append((step.index, "send", t.dst, t.chunk))
            if t.dst == rank:
                mine.append((step.index, "recv", t.src, t.chunk))
    return sorted(mine, key=lambda e: (e[0], e[1] != "send"))


SIM_OF = {
    "ring_all_reduce": ("all-reduce", "ring"),
    "ring_all_gather": ("all-gather", "ring"),
    "ring_reduce_scatter": ("reduce-scatter", "ring"),
    "tree_reduce": ("reduce", "tree"),
    "tree_broadcast": ("broadcast", "tree"),
    "tree_all_reduce": ("all-reduce", "tree"),
    "tree_gather": ("gather", "tree"),
    "tree_scatter": ("scatter", "tree"),
}


@pytest.mark.parametrize("n", [2, 3, 4])
def test_send_recv_implementations_equal_torch_distributed(pools, n):
    per_rank = pools(n).run(check_real_collectives, n)
    chunk = 2 * n * 3 // n
    for rank, out in enumerate(per_rank):
        for name, (mine, ref, counts, events) in out.items():
            assert mine == ref, f"rank {rank}: {name} differs from torch.distributed"
            if counts is None:
                continue
            # nothing but point-to-point messages on the tp group
            assert set(counts) <= {("send", "tp"), ("recv", "tp")}, (name, counts)
            # the same messages, in the same steps, as the simulation
            base, _, root = name.rpartition("_") if name.startswith("tree") else (name, None, "0")
            collective, algorithm = SIM_OF[base]
            expected = _sim_messages(collective, algorithm, n, int(root), rank)
            got = sorted(((e.step, e.kind, e.peer, e.chunk) for e in events), key=lambda e: (e[0], e[1] != "send"))
            assert got == expected, (rank, name)
            sends = counts.get(("send", "tp"), (0, 0))
            assert sends[0] == sum(1 for e in expected if e[1] == "send")
            assert counts.get(("recv", "tp"), (0, 0))[0] == sum(1 for e in expected if e[1] == "recv")
        # ring all-reduce: 2(N-1) messages of 1/N of the tensor each way, per rank
        counts = out["ring_all_reduce"][2]
        ring = (2 * (n - 1), 2 * (n - 1) * chunk)
        assert counts == {("send", "tp"): ring, ("recv", "tp"): ring}
        assert out["ring_reduce_scatter"][2][("send", "tp")] == (n - 1, (n - 1) * chunk)
        assert out["ring_all_gather"][2][("send", "tp")] == (n - 1, (n - 1) * 6)


def check_on_a_subgroup():
    """tp=2 groups inside a world of 4: group ranks are not global ranks, and the two groups run side by side."""
    m = mesh(tp=2, dp=2)
    g = m.tp_group
    x = _inputs(4, (4, 3), 5)[g.global_rank]
    mine = C.ring_all_reduce(x.clone(), g)
    gathered = C.tree_gather(x, g, root=1)
    ops = set(m.stats.snapshot())
    return (_lists(mine), _lists(g.all_reduce(x.clone())), _lists(gathered), _lists(g.gather(x, dst=1)), ops)


def test_on_a_subgroup(pools):
    for mine, ref, gathered, gathered_ref, ops in pools(4).run(check_on_a_subgroup):
        assert mine == ref and gathered == gathered_ref
        assert ops == {("send", "tp"), ("recv", "tp")}
