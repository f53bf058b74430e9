"""Pipeline schedules (`tensorpar.pipeline_parallel.schedules`) run on an ideal machine: when each action starts
and ends, the makespan and the bubble fraction, and for an order that deadlocks, what each stuck rank waits for.

Each rank executes its actions strictly in list order, one at a time; an action starts when its rank is free
and each action it depends on (the contract in `tensorpar.pipeline_parallel.schedules`) has ended, plus a
point-to-point time when that action ran on another rank. With ``forward_time=1, backward_time=2`` and no
point-to-point time the bubble fraction equals the schedules' published ideal bubble
(`tensorpar.pipeline_parallel.schedules.theoretical_bubble`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tensorpar.errors import TensorparError
from tensorpar.layout.stages import rank_of, stage_of
from tensorpar.pipeline_parallel.schedules import Action, is_v_shaped, validate_schedule


@dataclass
class Timeline:
    """A simulated (or measured) run of a schedule.

    ``events[r]`` lists rank r's ``(action, start, end)`` in execution order; ``makespan`` is the
    end of the last action (the run starts at 0); ``bubble_fraction = 1 - busy / (pp * makespan)``.
    """

    pp: int
    microbatches: int
    virtual_stages: int
    events: list[list[tuple[Action, float, float]]]
    makespan: float
    bubble_fraction: float
    forward_time: float = 1.0
    backward_time: float = 2.0
    p2p_time: float = 0.0
    name: str | None = None
    busy: list[float] = field(default_factory=list)  # per rank
    weight_time: float | None = None  # the W share of backward_time in a split schedule, else None
    v_shape: bool = False


def simulate(
    schedule: list[list[Action]],
    forward_time: float = 1.0,
    backward_time: float = 2.0,
    p2p_time: float = 0.0,
    *,
    name: str | None = None,
    weight_time: float | None = None,
) -> Timeline:
    """Run ``schedule`` on an ideal machine: each rank executes its actions strictly in list order,
    one at a time; an action starts when its rank is free and each dependency has ended
    (+ ``p2p_time`` when the dependency ran on another rank). Times are per action (per chunk for
    interleaved and V-shaped schedules). ``name`` (optional) is kept in the Timeline for pictures.
    ``backward_time`` is a whole backward; in a schedule with W actions, W takes ``weight_time``
    (default: half of it) and B the rest, so that schedules of the same model compare.

    Raises TensorparError for a malformed schedule and for an order that deadlocks, naming what
    each stuck rank waits for.
    """
    _check_times(forward_time, backward_time, p2p_time)
    pp, m, v = validate_schedule(schedule)
    v_shape = is_v_shaped(schedule)
    split = any(a.kind == "W" for acts in schedule for a in acts)
    if split:
        weight_time = _split_weight_time(backward_time, weight_time)
    duration = {"F": forward_time, "B": backward_time - weight_time if split else backward_time, "W": weight_time}
    events = _execute(schedule, duration, p2p_time, pp, pp * v, v_shape)
    makespan = max(evs[-1][2] for evs in events)  # every rank runs at least one action (validate_schedule)
    busy = [sum(e - s for _, s, e in evs) for evs in events]
    bubble = 1.0 - sum(busy) / (pp * makespan)
    return Timeline(
        pp=pp, microbatches=m, virtual_stages=v, events=events, makespan=makespan,
        bubble_fraction=bubble, forward_time=forward_time, backward_time=backward_time,
        p2p_time=p2p_time, name=name, busy=busy, weight_time=weight_time if split else None, v_shape=v_shape,
    )


def _check_times(forward_time: float, backward_time: float, p2p_time: float) -> None:
    """Raise TensorparError unless the forward and backward times are positive and the p2p time is not negative."""
    for label, t in (("forward_time", forward_time), ("backward_time", backward_time)):
        if not t > 0:
            raise TensorparError(f"simulate: {label} must be > 0, got {t!r}")
    if not p2p_time >= 0:
        raise TensorparError(f"simulate: p2p_time must be >= 0, got {p2p_time!r}")


def _split_weight_time(backward_time: float, weight_time: float | None) -> float:
    """The time of a W action in a split schedule: ``weight_time``, or half of ``backward_time`` when None;
    raises TensorparError unless it lies strictly between 0 and ``backward_time``."""
    weight_time = backward_time / 2 if weight_time is None else weight_time
    if not 0 < weight_time < backward_time:
        raise TensorparError(f"simulate: weight_time must be between 0 and backward_time ({backward_time}), "
                             f"got {weight_time!r}")
    return weight_time


def _execute(schedule: list[list[Action]], duration: dict[str, float], p2p_time: float, pp: int, n_stages: int,
             v_shape: bool) -> list[list[tuple[Action, float, float]]]:
    """Every rank's ``(action, start, end)`` when each rank runs its list in order, every action as soon as its
    rank is free and its dependencies have ended; raises TensorparError naming what each stuck rank waits for
    when the order deadlocks."""
    done: dict[tuple[str, int, int], float] = {}  # (kind, mb, stage) -> end time
    events: list[list[tuple[Action, float, float]]] = [[] for _ in range(pp)]
    free = [0.0] * pp
    pos = [0] * pp
    remaining = sum(len(acts) for acts in schedule)
    while remaining:
        progressed = False
        for r in range(pp):
            acts = schedule[r]
            while pos[r] < len(acts):
                a = acts[pos[r]]
                start = _start_time(a, r, free[r], done, p2p_time, pp, n_stages, v_shape)
                if start is None:
                    break
                end = start + duration[a.kind]
                done[(a.kind, a.microbatch, stage_of(r, a.chunk, pp, v_shape))] = end
                events[r].append((a, start, end))
                free[r] = end
                pos[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise TensorparError(_deadlock_message(schedule, pos, done, pp, n_stages, v_shape))
    return events


def _start_time(a: Action, rank: int, free: float, done: dict[tuple[str, int, int], float], p2p_time: float,
                pp: int, n_stages: int, v_shape: bool) -> float | None:
    """When ``a`` can start on ``rank``, which is free from ``free`` on: once each of its dependencies has ended
    (+ ``p2p_time`` for one that ran on another rank); None while one of them has not run yet."""
    start = free
    for dep in _deps(a, rank, pp, n_stages, v_shape):
        end = done.get(dep)
        if end is None:
            return None
        if rank_of(dep[2], pp, v_shape)[0] != rank:
            end += p2p_time
        start = max(start, end)
    return start


def _deps(a: Action, rank: int, pp: int, n_stages: int, v_shape: bool = False) -> list[tuple[str, int, int]]:
    """(kind, microbatch, stage) of what ``a`` on ``rank`` waits for."""
    s = stage_of(rank, a.chunk, pp, v_shape)
    if a.kind == "F":
        return [("F", a.microbatch, s - 1)] if s > 0 else []
    if a.kind == "W":
        return [("B", a.microbatch, s)]
    deps = [("F", a.microbatch, s)]
    if s < n_stages - 1:
        deps.append(("B", a.microbatch, s + 1))
    return deps


def _name(kind: str, mb: int, stage: int, pp: int, v_shape: bool = False) -> str:
    rank, chunk = rank_of(stage, pp, v_shape)
    return f"{kind}{mb} of stage {stage} (rank {rank}, chunk {chunk})"


def _deadlock_message(schedule, pos, done, pp, n_stages, v_shape=False) -> str:
    where = {}
    for r, acts in enumerate(schedule):
        for i, a in enumerate(acts):
            where[(a.kind, a.microbatch, stage_of(r, a.chunk, pp, v_shape))] = (r, i)
    lines = []
    for r, acts in enumerate(schedule):
        if pos[r] >= len(acts):
            continue
        a = acts[pos[r]]
        waits = []
        for dep in _deps(a, r, pp, n_stages, v_shape):
            if dep in done:
                continue
            dr, di = where[dep]
            if dr == r:
                waits.append(f"{_name(*dep, pp, v_shape)}, which comes later in its own order (position {di})")
            else:
                waits.append(f"{_name(*dep, pp, v_shape)} (position {di} of rank {dr}, which is stuck at {pos[dr]})")
        lines.append(f"rank {r} at position {pos[r]} ({a}) waits for " + " and ".join(waits))
    return "pipeline schedule deadlocks: " + "; ".join(lines)
