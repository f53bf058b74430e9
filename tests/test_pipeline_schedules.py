"""Pipeline schedules as data: completeness, Megatron-LM's order, simulated bubble = formula,
activation memory, deadlock detection. In-process, no ranks.
"""

import pytest

from tensorpar.errors import LayoutError, TensorparError
from tensorpar.layout.stages import rank_of, stage_of
from tensorpar.pipeline_parallel.schedule_simulation import simulate
from tensorpar.pipeline_parallel.schedules import (
    Action,
    afab,
    build_schedule,
    interleaved,
    one_f_one_b,
    peak_in_flight,
    theoretical_bubble,
)


def F(mb, c=0):
    return Action("F", mb, c)


def B(mb, c=0):
    return Action("B", mb, c)


def _cases():
    for pp in range(1, 7):
        for m in range(1, 13):
            yield "afab", pp, m, 1
            yield "1f1b", pp, m, 1
    for pp in range(1, 6):
        for m in range(pp, 3 * pp + 1, pp):
            for v in range(1, 5):
                yield "interleaved", pp, m, v


def _check_dependencies(tl, p2p=0.0):
    """Every simulated action starts after what it depends on (+ p2p across ranks)."""
    pp, v = tl.pp, tl.virtual_stages
    S = pp * v
    end = {}
    for r, evs in enumerate(tl.events):
        for a, s, e in evs:
            end[(a.kind, a.microbatch, a.chunk * pp + r)] = (e, r)
    for r, evs in enumerate(tl.events):
        prev_end = 0.0
        for a, s, e in evs:
            assert s >= prev_end
            prev_end = e
            st = a.chunk * pp + r
            deps = []
            if a.kind == "F" and st > 0:
                deps.append(("F", a.microbatch, st - 1))
            if a.kind == "B":
                deps.append(("F", a.microbatch, st))
                if st < S - 1:
                    deps.append(("B", a.microbatch, st + 1))
            for d in deps:
                de, dr = end[d]
                assert s >= de + (p2p if dr != r else 0.0), (r, a, d)


def test_every_action_once_and_no_deadlock():
    for name, pp, m, v in _cases():
        sched = build_schedule(name, pp, m, v)
        assert len(sched) == pp
        want = sorted((k, mb, c) for k in "FB" for mb in range(m) for c in range(v))
        for acts in sched:
            assert sorted((a.kind, a.microbatch, a.chunk) for a in acts) == want, (name, pp, m, v)
        tl = simulate(sched)
        assert [len(e) for e in tl.events] == [2 * m * v] * pp
        _check_dependencies(tl)


def test_simulated_bubble_equals_formula():
    # forward 1, backward 2 per action: makespan (v*m + p - 1) * 3 exactly, bubble (p-1)/(v*m+p-1)
    for name, pp, m, v in list(_cases()) + [("1f1b", 8, 32, 1), ("interleaved", 8, 32, 4), ("afab", 8, 3, 1)]:
        tl = simulate(build_schedule(name, pp, m, v), forward_time=1.0, backward_time=2.0)
        assert tl.makespan == 3 * (v * m + pp - 1), (name, pp, m, v)
        theory = theoretical_bubble(name, pp, m, v)
        assert tl.bubble_fraction == pytest.approx(theory, abs=1e-12), (name, pp, m, v)
    assert theoretical_bubble("1f1b", 4, 8) == 3 / 11
    assert theoretical_bubble("afab", 4, 8) == 3 / 11
    assert theoretical_bubble("interleaved", 4, 8, 2) == 3 / 19


def test_one_f_one_b_order_is_megatrons():
    s = one_f_one_b(4, 8)
    assert s[0][:6] == [F(0), F(1), F(2), F(3), B(0), F(4)]
    assert s[1] == [F(0), F(1), F(2), B(0), F(3), B(1), F(4), B(2), F(5), B(3), F(6), B(4), F(7), B(5), B(6), B(7)]
    assert s[3][:4] == [F(0), B(0), F(1), B(1)]
    assert one_f_one_b(4, 2)[0] == [F(0), F(1), B(0), B(1)]  # m < pp: warmup capped at m
    assert afab(2, 3)[1] == [F(0), F(1), F(2), B(0), B(1), B(2)]


def test_interleaved_order_is_megatrons():
    s = interleaved(2, 4, 2)
    # rank 0: warmup 2*(2-0-1) + (2-1)*2 = 4 forwards; microbatches in groups of pp per chunk
    assert s[0] == [F(0, 0), F(1, 0), F(0, 1), F(1, 1),
                    F(2, 0), B(0, 1), F(3, 0), B(1, 1), F(2, 1), B(0, 0), F(3, 1), B(1, 0),
                    B(2, 1), B(3, 1), B(2, 0), B(3, 0)]
    # rank 1 (last): warmup (2-1)*2 = 2
    assert s[1] == [F(0, 0), F(1, 0),
                    F(0, 1), B(0, 1), F(1, 1), B(1, 1), F(2, 0), B(0, 0), F(3, 0), B(1, 0),
                    F(2, 1), B(2, 1), F(3, 1), B(3, 1),
                    B(2, 0), B(3, 0)]
    # m == pp: all forwards first (Megatron-LM's special case)
    s = interleaved(4, 4, 2)
    for acts in s:
        assert [a.kind for a in acts] == ["F"] * 8 + ["B"] * 8


def test_peak_in_flight():
    for pp in range(1, 7):
        for m in range(1, 13):
            peaks = peak_in_flight(one_f_one_b(pp, m))
            assert peaks == [min(pp - r, m) for r in range(pp)]
            assert max(peaks) <= pp
            assert peak_in_flight(afab(pp, m)) == [m] * pp
    # interleaved: 2*(pp-r-1) + (v-1)*pp + 1 chunk-microbatches on rank r (m > pp)
    assert peak_in_flight(interleaved(4, 8, 2)) == [11, 9, 7, 5]


def test_interleaved_needs_microbatches_multiple_of_pp():
    with pytest.raises(LayoutError, match=r"microbatches \(6\).*multiple.*pipeline-parallel size 4"):
        interleaved(4, 6, 2)
    with pytest.raises(LayoutError):
        build_schedule("interleaved", 3, 4, 2)


def test_build_schedule_errors():
    with pytest.raises(TensorparError, match="afab, 1f1b, interleaved, zb-h1, zbv"):
        build_schedule("zb-h2", 4, 8)
    with pytest.raises(LayoutError, match="two model chunks"):
        build_schedule("zbv", 4, 8, 3)
    with pytest.raises(LayoutError, match="at least 2 \\* pp - 1 = 7 micro-batches"):
        build_schedule("zbv", 4, 6)
    with pytest.raises(LayoutError, match="interleaved"):
        build_schedule("1f1b", 4, 8, 2)
    with pytest.raises(LayoutError, match="pp"):
        build_schedule("afab", 0, 8)
    with pytest.raises(TensorparError):
        theoretical_bubble("nope", 4, 8)


def test_p2p_time_and_timeline_fields():
    tl = simulate(one_f_one_b(2, 1), forward_time=1.0, backward_time=2.0, p2p_time=0.5)
    # F0 r0 [0,1], F0 r1 [1.5,2.5], B0 r1 [2.5,4.5], B0 r0 [5,7]
    assert tl.events[1] == [(F(0), 1.5, 2.5), (B(0), 2.5, 4.5)]
    assert tl.events[0][1] == (B(0), 5.0, 7.0)
    assert tl.makespan == 7.0
    assert tl.bubble_fraction == pytest.approx(1 - 6 / 14)
    _check_dependencies(simulate(interleaved(3, 6, 2), p2p_time=0.25), p2p=0.25)
    # pp == 1 with chunks: neighbouring stages share the rank, no p2p time
    assert simulate(interleaved(1, 2, 3), p2p_time=10.0).makespan == 2 * 3 * 3


def test_deadlock_is_detected():
    # rank 1 wants F1 before F0, but rank 0 only sends F1 after B0, which needs rank 1's B0
    bad = [[F(0), B(0), F(1), B(1)], [F(1), F(0), B(0), B(1)]]
    with pytest.raises(TensorparError, match=r"deadlocks: rank 0 at position 1 \(B0\) waits for B0 of stage 1"):
        simulate(bad)
    # a backward before its own forward
    with pytest.raises(TensorparError, match="later in its own order"):
        simulate([[B(0), F(0)]])
    # malformed: an action missing, or twice
    with pytest.raises(TensorparError, match="misses"):
        simulate([[F(0), F(1), B(0)]])
    with pytest.raises(TensorparError, match="twice"):
        simulate([[F(0), F(0), B(0)]])


# --------------------------------------------------------------------------- zero-bubble schedules


def W(mb, c=0):
    return Action("W", mb, c)


def _zero_bubble_cases():
    for pp in range(1, 7):
        for m in range(1, 13):
            yield "zb-h1", pp, m
            if m >= 2 * pp - 1:
                yield "zbv", pp, m


def test_zero_bubble_schedules_run_every_f_b_w_once_without_deadlock():
    for name, pp, m in _zero_bubble_cases():
        sched = build_schedule(name, pp, m)
        v = 2 if name == "zbv" else 1
        want = sorted((k, mb, c) for k in "FBW" for mb in range(m) for c in range(v))
        for acts in sched:
            assert sorted((a.kind, a.microbatch, a.chunk) for a in acts) == want, (name, pp, m)
            for i, a in enumerate(acts):  # a W after its own B
                if a.kind == "W":
                    assert B(a.microbatch, a.chunk) in acts[:i]
        tl = simulate(sched)
        assert [len(e) for e in tl.events] == [3 * m * v] * pp


def test_v_shape_places_both_ends_on_rank_0():
    assert [stage_of(r, c, 4, v_shape=True) for c in (0, 1) for r in range(4)] == [0, 1, 2, 3, 7, 6, 5, 4]
    assert all(rank_of(stage_of(r, c, 3, True), 3, True) == (r, c) for r in range(3) for c in (0, 1))
    assert all(rank_of(stage_of(r, c, 3), 3) == (r, c) for r in range(3) for c in range(4))
    sched = build_schedule("zbv", 2, 4)
    assert sched.v_shape and not build_schedule("1f1b", 2, 4).v_shape
    assert sched[0][:3] == [F(0), F(1), F(2)]  # rank 0: 2 * (pp - 0) - 1 chunk-0 forwards first
    assert sched[1][:5] == [F(0), F(0, 1), F(1), F(1, 1), B(0, 1)]  # the turn of the V stays on the last rank


def test_zero_bubble_simulated_bubble_and_memory():
    # t_F = t_B = t_W: zb-h1 reaches (p-1)/(3m+p-1) at pp 2 and 4 and zbv (p-1)/(6m+p-1) at every shape
    for pp, m in [(2, 4), (2, 8), (4, 8), (4, 12), (4, 16)]:
        tl = simulate(build_schedule("zb-h1", pp, m), forward_time=1.0, backward_time=2.0)
        assert tl.bubble_fraction == pytest.approx(theoretical_bubble("zb-h1", pp, m), abs=1e-12), (pp, m)
    for name, pp, m in _zero_bubble_cases():
        tl = simulate(build_schedule(name, pp, m), forward_time=1.0, backward_time=2.0)
        if name == "zbv":
            assert tl.bubble_fraction == pytest.approx(theoretical_bubble(name, pp, m), abs=1e-12), (pp, m)
        assert tl.bubble_fraction <= theoretical_bubble("1f1b", pp, m) + 1e-12, (name, pp, m)
    assert theoretical_bubble("zb-h1", 4, 8) == 3 / 27
    assert theoretical_bubble("zbv", 4, 8) == 3 / 51
    # the Done-when shape: zb-h1 at most 0.45x 1F1B's idle share, zbv at most zb-h1's
    one, h1, v = (simulate(build_schedule(n, 4, 8), 1.0, 2.0).bubble_fraction for n in ("1f1b", "zb-h1", "zbv"))
    assert h1 <= 0.45 * one and v <= h1
    # memory: zb-h1 keeps 1F1B's activations in flight; zbv holds pp micro-batches of half-stages on every rank
    for pp, m in [(4, 8), (3, 9), (2, 8)]:
        assert peak_in_flight(build_schedule("zb-h1", pp, m)) == peak_in_flight(one_f_one_b(pp, m))
        assert peak_in_flight(build_schedule("zbv", pp, m)) == [2 * pp] * pp


def test_split_schedules_simulate_w_after_b():
    tl = simulate(build_schedule("zb-h1", 2, 2), forward_time=1.0, backward_time=3.0, weight_time=1.0)
    ends = {(a.kind, a.microbatch, r): (s, e) for r, evs in enumerate(tl.events) for a, s, e in evs}
    assert ends[("B", 0, 1)] == (2.0, 4.0)  # B takes backward - weight = 2
    assert ends[("W", 0, 1)][1] - ends[("W", 0, 1)][0] == 1.0
    with pytest.raises(TensorparError, match="weight_time"):
        simulate(build_schedule("zb-h1", 2, 2), backward_time=2.0, weight_time=2.0)
    with pytest.raises(TensorparError, match="misses"):  # a split schedule with a W missing
        simulate([[F(0), B(0), W(0), F(1), B(1)]])
