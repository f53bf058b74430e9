"""The ring / tree collective algorithms simulated step by step (tensorpar.distributed.collective_simulation)."""

import random

import pytest

from tensorpar.distributed import collective_simulation as S
from tensorpar.errors import TensorparError

BLOG_INPUTS = [[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12], [13, 14, 15, 16]]


def _expected(collective, inputs, root):
    """What each collective must leave on each rank, computed directly."""
    n = len(inputs)
    total = [sum(col) for col in zip(*inputs)]
    concat = [x for values in inputs for x in values]
    if collective == "all-reduce":
        return [total] * n
    if collective == "all-gather":
        return [concat] * n
    if collective == "reduce-scatter":
        m = len(total) // n
        return [total[r * m : (r + 1) * m] for r in range(n)]
    if collective == "reduce":
        return [total if r == root else None for r in range(n)]
    if collective == "broadcast":
        return [inputs[root]] * n
    if collective == "gather":
        return [concat if r == root else None for r in range(n)]
    if collective == "scatter":
        m = len(inputs[root]) // n
        return [inputs[root][r * m : (r + 1) * m] for r in range(n)]
    raise AssertionError(collective)


def _lengths(collective, n):
    if collective in ("reduce-scatter", "scatter"):
        return (n, 3 * n)  # must divide by n
    return (1, 7, 2 * n)  # 1 < n and 7: chunks of unequal sizes, some empty, for the ring all-reduce


CASES = [(c, a) for c in S.COLLECTIVES for a in S.ALGORITHMS[c]]


@pytest.mark.parametrize("n", [2, 3, 4, 5])
@pytest.mark.parametrize("collective,algorithm", CASES, ids=[f"{c}-{a}" for c, a in CASES])
def test_simulation_equals_direct_computation(collective, algorithm, n):
    rng = random.Random(f"{collective}{algorithm}{n}")
    roots = sorted({0, n - 1, n // 2}) if algorithm == "tree" else [0]
    for length in _lengths(collective, n):
        for root in roots:
            ints = [[rng.randint(-99, 99) for _ in range(length)] for _ in range(n)]
            outputs, trace = S.simulate(collective, ints, algorithm, root=root)
            assert outputs == _expected(collective, ints, root), (length, root)
            floats = [[rng.uniform(-1, 1) for _ in range(length)] for _ in range(n)]
            outputs, _ = S.simulate(collective, floats, algorithm, root=root)
            for got, want in zip(outputs, _expected(collective, floats, root)):
                assert (got is None and want is None) or got == pytest.approx(want, rel=1e-12, abs=1e-12)


@pytest.mark.parametrize("n", [2, 3, 4, 5])
def test_ring_traces_have_the_textbook_shape(n):
    length = 3 * n
    inputs = [[float(r * length + i) for i in range(length)] for r in range(n)]
    for collective, steps in (("all-reduce", 2 * (n - 1)), ("reduce-scatter", n - 1), ("all-gather", n - 1)):
        _, trace = S.simulate(collective, inputs)
        assert [s.index for s in trace] == list(range(1, steps + 1))
        for step in trace:
            # every rank sends exactly one chunk, to the next rank on the ring, every step
            assert sorted((t.src, t.dst) for t in step.transfers) == [(r, (r + 1) % n) for r in range(n)]
            size = 3 if collective != "all-gather" else length  # all-gather blocks are whole inputs
            assert all(len(t.values) == size for t in step.transfers)
            for t in step.transfers:
                assert t.result == step.buffers[t.dst]
    _, trace = S.simulate("all-reduce", inputs)
    assert [s.phase for s in trace] == ["reduce-scatter"] * (n - 1) + ["all-gather"] * (n - 1)


@pytest.mark.parametrize("n", [2, 3, 4, 5, 8])
def test_tree_traces_are_binomial_trees(n):
    k = S.tree_steps(n)
    assert 2 ** (k - 1) < n <= 2**k
    inputs = [[r, r + 1] for r in range(n)]
    for root in range(n):
        for collective in ("reduce", "broadcast", "gather", "scatter"):
            _, trace = S.simulate(collective, inputs if collective != "scatter" else
                                  [[float(i) for i in range(2 * n)]] * n, root=root)
            assert len(trace) == k
            for step in trace:  # each rank takes part in at most one message per step
                ends = [t.src for t in step.transfers] + [t.dst for t in step.transfers]
                assert len(ends) == len(set(ends))
            transfers = [t for s in trace for t in s.transfers]
            assert len(transfers) == n - 1  # a spanning tree: one edge per non-root rank
            if collective in ("reduce", "gather"):
                assert sorted(t.src for t in transfers) == [r for r in range(n) if r != root]
            else:
                assert sorted(t.dst for t in transfers) == [r for r in range(n) if r != root]
        _, trace = S.simulate("all-reduce", inputs, "tree", root=root)
        assert [s.phase for s in trace] == ["reduce"] * k + ["broadcast"] * k


def test_blog_reduce_scatter_example_ends_with_28_32_36_40():
    outputs, trace = S.simulate("reduce-scatter", BLOG_INPUTS)
    assert outputs == [[28], [32], [36], [40]]
    assert len(trace) == 3
    final = trace[-1].buffers
    assert [final[r][r] for r in range(4)] == [28, 32, 36, 40]  # rank r owns chunk r
    first = {t.src: t for t in trace[0].transfers}
    assert (first[0].dst, first[0].chunk, first[0].values, first[0].result) == (1, 3, (4,), (5, 6, 7, 12))
    assert S.simulate("all_reduce", BLOG_INPUTS)[0] == [[28, 32, 36, 40]] * 4


def test_simulation_refuses_bad_input():
    with pytest.raises(TensorparError, match="unknown collective"):
        S.simulate("all-to-all", BLOG_INPUTS)
    with pytest.raises(TensorparError, match="at least 2 ranks"):
        S.simulate("all-reduce", [[1, 2]])
    with pytest.raises(TensorparError, match="one length"):
        S.simulate("all-reduce", [[1, 2], [3]])
    with pytest.raises(TensorparError, match="divisible"):
        S.simulate("reduce-scatter", [[1, 2, 3], [4, 5, 6]])
    with pytest.raises(TensorparError, match="no 'tree' algorithm"):
        S.simulate("all-gather", BLOG_INPUTS, "tree")
    with pytest.raises(TensorparError, match="root"):
        S.simulate("reduce", BLOG_INPUTS, root=4)
    assert S.normalize("REDUCE_SCATTER") == S.normalize("reducescatter") == "reduce-scatter"
