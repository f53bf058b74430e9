"""Every collective of the communication module against what it must compute, and what it counts."""

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from harness import mesh


def _rank_tensor(rank, shape=(2, 3)):
    """A tensor that is different on every rank: rank*100 + position."""
    return torch.arange(int(torch.tensor(shape).prod()), dtype=torch.float32).reshape(shape) + 100.0 * rank


def check_collectives(tp, dp):
    m = mesh(tp=tp, dp=dp)
    g = m.tp_group
    members = g.ranks
    out = {}

    x = _rank_tensor(g.global_rank)
    out["all_reduce"] = torch.equal(g.all_reduce(x.clone()), sum(_rank_tensor(r) for r in members))
    out["all_reduce_max"] = torch.equal(g.all_reduce(x.clone(), op="max"), _rank_tensor(max(members)))

    for dim in (0, 1):
        expected = torch.cat([_rank_tensor(r) for r in members], dim)
        out[f"all_gather_dim{dim}"] = torch.equal(g.all_gather(x, dim=dim), expected)

    # reduce-scatter: every rank holds a [2*size, 3] (or [2, 3*size]) tensor; the sum is split.
    for dim in (0, 1):
        shape = (2 * g.size, 3) if dim == 0 else (2, 3 * g.size)
        full_sum = sum(_rank_tensor(r, shape) for r in members)
        expected = full_sum.chunk(g.size, dim)[g.rank]
        out[f"reduce_scatter_dim{dim}"] = torch.equal(g.reduce_scatter(_rank_tensor(g.global_rank, shape), dim=dim), expected)

    b = g.broadcast(x.clone(), src=g.size - 1)
    out["broadcast"] = torch.equal(b, _rank_tensor(members[-1]))

    r = g.reduce(x.clone(), dst=0)
    out["reduce"] = (not g.rank == 0) or torch.equal(r, sum(_rank_tensor(rr) for rr in members))

    full = torch.arange(4.0 * g.size).reshape(g.size * 2, 2)
    sc = g.scatter(full if g.rank == 0 else None, src=0, shape=(2, 2), dtype=torch.float32)
    out["scatter"] = torch.equal(sc, full.chunk(g.size, 0)[g.rank])

    ga = g.gather(x, dst=0, dim=0)
    out["gather"] = torch.equal(ga, torch.cat([_rank_tensor(r) for r in members])) if g.rank == 0 else ga is None

    # ring send/recv: each rank sends to the next, receives from the previous
    nxt, prv = (g.rank + 1) % g.size, (g.rank - 1) % g.size
    buf = torch.empty_like(x)
    if g.rank % 2 == 0:
        g.send(x, nxt)
        g.recv(buf, prv)
    else:
        g.recv(buf, prv)
        g.send(x, nxt)
    out["send_recv"] = torch.equal(buf, _rank_tensor(members[prv]))

    out["objects"] = g.all_gather_object(g.global_rank) == members
    counts = {k: (v.calls, v.elements, v.bytes) for k, v in m.stats.snapshot().items()}
    return out, counts, g.size


@pytest.mark.parametrize("world,tp,dp", [(2, 2, 1), (3, 3, 1), (4, 4, 1), (4, 2, 2)])
def test_collectives_compute_and_count(pools, world, tp, dp):
    for out, counts, size in pools(world).run(check_collectives, tp, dp):
        failed = [k for k, ok in out.items() if not ok]
        assert not failed, f"wrong results: {failed}"
        n = 6  # elements of the [2, 3] rank tensor
        assert counts[("all_reduce", "tp")] == (2, 2 * n, 2 * n * 4)
        # two all-gathers of [2,3] inputs: outputs of size*6 elements each
        assert counts[("all_gather", "tp")] == (2, 2 * size * n, 2 * size * n * 4)
        assert counts[("reduce_scatter", "tp")] == (2, 2 * size * n, 2 * size * n * 4)
        assert counts[("broadcast", "tp")] == (1, n, n * 4)
        assert counts[("reduce", "tp")] == (1, n, n * 4)
        assert counts[("scatter", "tp")] == (1, 4 * size, 16 * size)
        assert counts[("gather", "tp")] == (1, n * size, n * size * 4)
        assert counts[("send", "tp")] == (1, n, n * 4)
        assert counts[("recv", "tp")] == (1, n, n * 4)
        assert not any(group != "tp" for (_, group) in counts), "nothing should run on the dp or pp groups"


def check_single_rank_group_is_free():
    m = mesh(tp=1, dp=2)
    g = m.tp_group
    x = torch.randn(3)
    same = g.all_reduce(x) is x and g.all_gather(x) is x and g.reduce_scatter(x) is x
    return same, m.stats.calls()


def test_one_rank_group_communicates_nothing(pools):
    for same, calls in pools(2).run(check_single_rank_group_is_free):
        assert same and calls == 0


def check_timeout_names_rank_op_and_group():
    """Rank 0 waits on an all-reduce that rank 1 never joins: the error must say who, what and where."""
    from tensorpar.distributed.comm import Group
    from tensorpar.errors import CollectiveError

    pg = dist.new_group([0, 1], timeout=timedelta(seconds=2))
    g = Group("tp", [0, 1], pg, global_rank=dist.get_rank(), timeout=timedelta(seconds=2))
    pg_async = dist.new_group([0, 1], timeout=timedelta(seconds=2))
    g_async = Group("tp", [0, 1], pg_async, global_rank=dist.get_rank(), timeout=timedelta(seconds=2))
    messages = [None, None]
    if dist.get_rank() == 0:
        try:
            g.all_reduce(torch.ones(4))
        except CollectiveError as e:
            messages[0] = str(e)
        try:  # started asynchronously (as the TP overlap does): the error comes from wait()
            g_async.reduce_scatter_async(torch.empty(2), torch.ones(4)).wait()
        except CollectiveError as e:
            messages[1] = str(e)
    return messages


def test_timeout_error_names_rank_operation_and_group():
    """Run in a pool of its own: a timed-out gloo group is left unusable."""
    from harness import WorkerPool

    pool = WorkerPool(2)
    try:
        messages = pool.run(check_timeout_names_rank_op_and_group, timeout=60)[0]
    finally:
        pool.close()
    for message, op in zip(messages, ("all_reduce", "reduce_scatter")):
        assert message is not None, f"the {op} did not fail"
        assert "rank 0" in message and op in message and "'tp'" in message and "[0, 1]" in message, message
        assert "(timeout 2s)" in message, message
