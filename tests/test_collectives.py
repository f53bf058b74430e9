"""Reference ring / tree collectives: the simulation, the send/recv implementations and `tensorpar explain`."""

import os
import random
import re
import subprocess
import sys

import pytest
import torch

from harness import mesh
from tensorpar.errors import TensorparError
from tensorpar.distributed import collective_algorithms as C
from tensorpar.distributed import collective_simulation as S

BLOG_INPUTS = [[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12], [13, 14, 15, 16]]

# -- the simulation -------------------------------------------------------------------------------


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


# -- the send/recv implementations on real process groups ------------------------------------------


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


# -- tensorpar explain ------------------------------------------------------------------------------


def _tensorpar(*args):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "tensorpar", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)


def test_explain_reduce_scatter_prints_the_blog_example():
    proc = _tensorpar("explain", "reduce-scatter", "--ranks", "4")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    final = [re.match(r"\s*rank (\d): \[(.*)\]", ln) for ln in lines[-4:]]
    assert all(final), lines[-5:]
    assert [(int(f.group(1)), f.group(2)) for f in final] == [(0, "28"), (1, "32"), (2, "36"), (3, "40")]
    assert lines[-5].startswith("result")
    out = proc.stdout
    assert "ring" in out and "N-1 = 3 steps" in out
    assert "rank 0: [1 | 2 | 3 | 4]" in out and "rank 3: [13 | 14 | 15 | 16]" in out
    assert "rank 0 -> rank 1: chunk 3 [4]" in out  # the first message of the ring
    assert [ln for ln in lines if ln.startswith("step ")] == [f"step {i} of 3 (reduce-scatter):" for i in (1, 2, 3)]


def test_explain_bad_input_is_one_line():
    proc = _tensorpar("explain", "all-to-all")
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("tensorpar: error:") and "all-to-all" in lines[0], proc.stderr


@pytest.mark.parametrize(
    "args,needle",
    [
        (["reduce", "--ranks", "1"], "at least 2"),
        (["reduce", "--ranks", "x"], "whole number"),
        (["reduce-scatter", "--algorithm", "tree"], "no 'tree' algorithm"),
        (["gather", "--root", "4"], "--root 4"),
        (["all-gather", "--root", "1"], "no root"),
        (["all-reduce", "--values", "1,2;3,x"], "not a number"),
    ],
)
def test_explain_errors_in_process(capsys, args, needle):
    from tensorpar.cli import main

    assert main(["explain", *args]) == 2
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("tensorpar: error:") and needle in lines[0], err


@pytest.mark.parametrize("collective", list(S.COLLECTIVES) + ["all_reduce --algorithm tree"])
def test_explain_every_collective(capsys, collective):
    from tensorpar.cli import main

    name, *rest = collective.split()
    assert main(["explain", name, "--ranks", "3", *rest]) == 0
    out = capsys.readouterr().out
    norm = S.normalize(name)
    algorithm = rest[-1] if rest else S.ALGORITHMS[norm][0]
    values = [[r * 3 + i + 1 for i in range(3)] for r in range(3)]
    outputs, trace = S.simulate(norm, values, algorithm)
    assert sum(ln.startswith("step ") for ln in out.splitlines()) == len(trace)
    tail = out.strip().splitlines()[-3:]
    for r, (line, want) in enumerate(zip(tail, outputs)):
        shown = "-" if want is None else "[" + ", ".join(str(v) for v in want) + "]"
        assert line.strip().startswith(f"rank {r}: {shown}"), (line, want)
    if (norm, algorithm) == ("all-reduce", "ring"):
        assert "2(N-1) = 4 steps" in out and "every rank 4 messages, 4 values = 16 bytes" in out


def test_explain_values_and_ranks():
    from tensorpar.commands.explain import explain

    lines = explain("all-reduce", values=[[1, 2], [3, 4], [5, 6]])
    assert lines[-3:] == ["  rank 0: [9, 12]", "  rank 1: [9, 12]", "  rank 2: [9, 12]"]
    with pytest.raises(TensorparError, match="--ranks 4 but --values gives 3"):
        explain("all-reduce", ranks=4, values=[[1], [2], [3]])


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
