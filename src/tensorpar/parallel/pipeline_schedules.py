"""Pipeline-parallel schedules as pure data, their simulation, and their ideal bubble.

A schedule is ``list[list[Action]]``: one list per pipeline rank, in the order that rank executes
its actions. Nothing here communicates; the executor runs these lists with real send/recv.

The contract (the executor relies on it)
-----------------------------------------
- ``Action(kind, microbatch, chunk)``: ``kind`` is ``"F"`` (forward) or ``"B"`` (backward),
  ``microbatch`` is 0-based, ``chunk`` is the model chunk on this rank (0-based, 0 unless
  interleaved).
- With ``pp`` ranks and ``v`` chunks per rank the model's layers are cut into ``S = pp * v``
  virtual stages in model order; rank ``r`` holds virtual stages ``r, r + pp, r + 2*pp, ...`` as
  chunks ``0, 1, ..., v - 1``: chunk ``c`` of rank ``r`` is stage ``s = c * pp + r``
  (:func:`stage_of`).
- Dependencies: ``F(mb, s)`` needs ``F(mb, s - 1)`` (for ``s > 0``); ``B(mb, s)`` needs
  ``F(mb, s)`` and, for ``s < S - 1``, ``B(mb, s + 1)``; on the last stage ``B(mb, S - 1)``
  needs only ``F(mb, S - 1)`` (the loss is computed there). A dependency on a stage of another
  rank is a point-to-point transfer: an activation forward, an activation gradient backward.
- Every rank's list holds each ``F(mb, c)`` and each ``B(mb, c)`` exactly once, for every
  microbatch ``mb < m`` and chunk ``c < v`` (:func:`validate_schedule`).

Schedules
---------
- :func:`afab` (all-forward-all-backward, GPipe): every rank runs ``F0 .. F(m-1)`` then
  ``B0 .. B(m-1)``. Peak activations in flight: ``m`` microbatches on every rank.
- :func:`one_f_one_b` (PipeDream-flush, Megatron-LM's non-interleaved schedule): rank ``r``
  runs ``w = min(pp - r - 1, m)`` warmup forwards, then ``m - w`` steady-state pairs
  (forward ``w + i``, then backward ``i``), then the ``w`` remaining backwards; backwards in
  microbatch order. Peak in flight: ``min(pp - r, m)`` on rank ``r``.
- :func:`interleaved` (Megatron-LM's interleaved 1F1B, ``forward_backward_pipelining_with_
  interleaving``): the ``m * v`` forward steps of a rank run in groups of ``pp`` microbatches
  per chunk: forward step ``k`` is chunk ``(k // pp) % v`` of microbatch
  ``(k // (pp * v)) * pp + k % pp``; backward step ``k`` is the same microbatch on chunk
  ``v - 1 - (k // pp) % v``. Warmup forwards: all ``m * v`` when ``m == pp``, else
  ``min(2 * (pp - r - 1) + (v - 1) * pp, m * v)``; then steady-state pairs (forward step
  ``warmup + i``, backward step ``i``), then the remaining backwards. ``m`` must be a multiple
  of ``pp`` (as Megatron-LM requires).

Ideal bubble (:func:`theoretical_bubble`)
-----------------------------------------
With ``t_f``, ``t_b`` the forward and backward time of one microbatch through one rank's whole
share of the model, and no communication time:

- AFAB and 1F1B: the first microbatch needs ``pp - 1`` forward steps to reach the last rank and
  the last gradient ``pp - 1`` backward steps to come back, so each rank idles
  ``(pp - 1) * (t_f + t_b)`` of a makespan ``(m + pp - 1) * (t_f + t_b)``:
  ``bubble = (pp - 1) / (m + pp - 1)``, whatever ``t_f`` and ``t_b``.
- Interleaved with ``v`` chunks: a chunk's forward and backward take ``t_f / v`` and ``t_b / v``;
  fill and drain cost ``(pp - 1)`` chunk-steps, i.e. ``(pp - 1) * (t_f + t_b) / v``, against
  ``m * (t_f + t_b)`` of work (Narayanan et al., 2021, "Efficient Large-Scale Language Model
  Training on GPU Clusters Using Megatron-LM", section 2.2.2: the bubble time shrinks by ``v``):
  ``bubble = ((pp - 1) / v) / (m + (pp - 1) / v) = (pp - 1) / (v * m + pp - 1)``.

``bubble`` here is the fraction of the pipeline's rank-time that is idle:
``1 - busy / (pp * makespan)``, the quantity :func:`simulate` reports.
:func:`simulate` reproduces these values exactly with ``forward_time=1, backward_time=2``
(``tests/test_pipeline_schedules.py`` checks a grid). In :func:`simulate` the times are per action, i.e.
per chunk for interleaved schedules; the bubble fraction does not depend on that scale.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tensorpar.config.choices import PIPELINE_SCHEDULES
from tensorpar.errors import LayoutError, TensorparError


@dataclass(frozen=True)
class Action:
    """One step of one pipeline rank: ``kind`` "F" (forward) or "B" (backward) of ``microbatch``
    (0-based) on model chunk ``chunk`` of this rank (0-based; the virtual stage is
    ``chunk * pp + rank``)."""

    kind: str
    microbatch: int
    chunk: int = 0

    def __str__(self) -> str:
        return f"{self.kind}{self.microbatch}" + (f"/chunk {self.chunk}" if self.chunk else "")


def stage_of(rank: int, chunk: int, pp: int) -> int:
    """The virtual stage of chunk ``chunk`` on rank ``rank``: ``chunk * pp + rank``."""
    return chunk * pp + rank


def _check_int(name: str, value, minimum: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise LayoutError(f"{name} must be an integer, got {value!r}")
    if value < minimum:
        raise LayoutError(f"{name} must be >= {minimum}, got {value}")


# --------------------------------------------------------------------------- schedules


def afab(pp: int, microbatches: int) -> list[list[Action]]:
    """All-forward-all-backward (GPipe): every rank runs F0..F(m-1), then B0..B(m-1)."""
    _check_int("pp", pp)
    _check_int("microbatches", microbatches)
    m = microbatches
    return [
        [Action("F", i) for i in range(m)] + [Action("B", i) for i in range(m)] for _ in range(pp)
    ]


def one_f_one_b(pp: int, microbatches: int) -> list[list[Action]]:
    """1F1B (PipeDream-flush, Megatron-LM non-interleaved): rank r runs min(pp - r - 1, m) warmup
    forwards, then alternates one forward and one backward, then runs the remaining backwards."""
    _check_int("pp", pp)
    _check_int("microbatches", microbatches)
    m = microbatches
    out = []
    for r in range(pp):
        warmup = min(pp - r - 1, m)
        acts = [Action("F", i) for i in range(warmup)]
        for i in range(m - warmup):
            acts.append(Action("F", warmup + i))
            acts.append(Action("B", i))
        acts.extend(Action("B", i) for i in range(m - warmup, m))
        out.append(acts)
    return out


def interleaved(pp: int, microbatches: int, virtual_stages: int) -> list[list[Action]]:
    """Megatron-LM's interleaved 1F1B with ``virtual_stages`` model chunks per rank (see the module
    docstring for the exact order). Raises LayoutError unless ``microbatches`` is a multiple of
    ``pp``."""
    _check_int("pp", pp)
    _check_int("microbatches", microbatches)
    _check_int("virtual_stages", virtual_stages)
    m, v = microbatches, virtual_stages
    if m % pp != 0:
        good = [k * pp for k in range(max(1, m // pp), m // pp + 2)]
        raise LayoutError(
            f"the interleaved schedule needs the number of microbatches ({m}) to be a multiple of "
            f"the pipeline-parallel size {pp}; nearby multiples: {good}"
        )
    total = m * v
    group = pp * v

    def step(k: int, forward: bool) -> Action:
        chunk = (k // pp) % v
        if not forward:
            chunk = v - 1 - chunk
        return Action("F" if forward else "B", (k // group) * pp + k % pp, chunk)

    out = []
    for r in range(pp):
        if m == pp:
            warmup = total  # Megatron-LM: all forwards first when m == pp
        else:
            warmup = min((pp - r - 1) * 2 + (v - 1) * pp, total)
        acts = [step(k, True) for k in range(warmup)]
        for k in range(total - warmup):
            acts.append(step(warmup + k, True))
            acts.append(step(k, False))
        acts.extend(step(k, False) for k in range(total - warmup, total))
        out.append(acts)
    return out


def build_schedule(name: str, pp: int, microbatches: int, virtual_stages: int = 1) -> list[list[Action]]:
    """The schedule called ``name``: "afab", "1f1b" or "interleaved" (``virtual_stages`` chunks
    per rank; the other two take only ``virtual_stages=1``)."""
    if virtual_stages is None:
        virtual_stages = 1
    key = str(name).lower()
    if key not in PIPELINE_SCHEDULES:
        raise TensorparError(f"unknown pipeline schedule {name!r}; valid names: {', '.join(PIPELINE_SCHEDULES)}")
    if key == "interleaved":
        return interleaved(pp, microbatches, virtual_stages)
    _check_int("virtual_stages", virtual_stages)
    if virtual_stages != 1:
        raise LayoutError(
            f"schedule {key!r} has one model chunk per rank; virtual_stages={virtual_stages} "
            "needs the 'interleaved' schedule"
        )
    return afab(pp, microbatches) if key == "afab" else one_f_one_b(pp, microbatches)


def theoretical_bubble(name: str, pp: int, m: int, v: int = 1) -> float:
    """Ideal bubble fraction: (pp-1)/(m+pp-1) for "afab" and "1f1b"; (pp-1)/(v*m+pp-1) for
    "interleaved" (Narayanan et al. 2021). See the module docstring for the derivation."""
    key = str(name).lower()
    if key not in PIPELINE_SCHEDULES:
        raise TensorparError(f"unknown pipeline schedule {name!r}; valid names: {', '.join(PIPELINE_SCHEDULES)}")
    _check_int("pp", pp)
    _check_int("microbatches", m)
    _check_int("virtual_stages", v)
    if key == "interleaved":
        return (pp - 1) / (v * m + pp - 1)
    return (pp - 1) / (m + pp - 1)


# --------------------------------------------------------------------------- checks


def schedule_shape(schedule: list[list[Action]]) -> tuple[int, int, int]:
    """(pp, microbatches, virtual_stages) of a schedule: its rank count, 1 + its largest
    microbatch and 1 + its largest chunk."""
    if not schedule or not all(schedule):
        raise TensorparError("a schedule needs at least one rank, and every rank at least one action")
    pp = len(schedule)
    m = 1 + max(a.microbatch for acts in schedule for a in acts)
    v = 1 + max(a.chunk for acts in schedule for a in acts)
    return pp, m, v


def validate_schedule(schedule: list[list[Action]]) -> tuple[int, int, int]:
    """Check that every rank runs each F(mb, chunk) and B(mb, chunk) exactly once and nothing
    else; returns (pp, microbatches, virtual_stages). Raises TensorparError naming the first
    problem. Says nothing about order (see :func:`simulate` for deadlocks)."""
    pp, m, v = schedule_shape(schedule)
    for r, acts in enumerate(schedule):
        seen = set()
        for i, a in enumerate(acts):
            if not isinstance(a, Action) or a.kind not in ("F", "B"):
                raise TensorparError(f"rank {r}, position {i}: {a!r} is not an Action of kind 'F' or 'B'")
            for fname in ("microbatch", "chunk"):
                val = getattr(a, fname)
                if isinstance(val, bool) or not isinstance(val, int) or val < 0:
                    raise TensorparError(f"rank {r}, position {i}: {fname} must be an integer >= 0 in {a!r}")
            key = (a.kind, a.microbatch, a.chunk)
            if key in seen:
                raise TensorparError(f"rank {r} runs {a} twice (second time at position {i})")
            seen.add(key)
        want = 2 * m * v
        if len(seen) != want:
            missing = [
                Action(k, mb, c) for c in range(v) for mb in range(m) for k in ("F", "B") if (k, mb, c) not in seen
            ]
            raise TensorparError(
                f"rank {r} misses {len(missing)} of its {want} actions (microbatches 0..{m - 1}, "
                f"chunks 0..{v - 1}), first {', '.join(map(str, missing[:4]))}"
            )
    return pp, m, v


def _deps(a: Action, rank: int, pp: int, n_stages: int) -> list[tuple[str, int, int]]:
    """(kind, microbatch, stage) of what ``a`` on ``rank`` waits for."""
    s = stage_of(rank, a.chunk, pp)
    if a.kind == "F":
        return [("F", a.microbatch, s - 1)] if s > 0 else []
    deps = [("F", a.microbatch, s)]
    if s < n_stages - 1:
        deps.append(("B", a.microbatch, s + 1))
    return deps


def _name(kind: str, mb: int, stage: int, pp: int) -> str:
    return f"{kind}{mb} of stage {stage} (rank {stage % pp}, chunk {stage // pp})"


# --------------------------------------------------------------------------- simulation


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


def simulate(
    schedule: list[list[Action]],
    forward_time: float = 1.0,
    backward_time: float = 2.0,
    p2p_time: float = 0.0,
    *,
    name: str | None = None,
) -> Timeline:
    """Run ``schedule`` on an ideal machine: each rank executes its actions strictly in list order,
    one at a time; an action starts when its rank is free and each dependency has ended
    (+ ``p2p_time`` when the dependency ran on another rank). Times are per action (per chunk for
    interleaved schedules). ``name`` (optional) is kept in the Timeline for pictures.

    Raises TensorparError for a malformed schedule and for an order that deadlocks, naming what
    each stuck rank waits for.
    """
    for label, t in (("forward_time", forward_time), ("backward_time", backward_time)):
        if not t > 0:
            raise TensorparError(f"simulate: {label} must be > 0, got {t!r}")
    if not p2p_time >= 0:
        raise TensorparError(f"simulate: p2p_time must be >= 0, got {p2p_time!r}")
    pp, m, v = validate_schedule(schedule)
    n_stages = pp * v
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
                start = free[r]
                ready = True
                for dep in _deps(a, r, pp, n_stages):
                    end = done.get(dep)
                    if end is None:
                        ready = False
                        break
                    if dep[2] % pp != r:
                        end += p2p_time
                    start = max(start, end)
                if not ready:
                    break
                end = start + (forward_time if a.kind == "F" else backward_time)
                done[(a.kind, a.microbatch, stage_of(r, a.chunk, pp))] = end
                events[r].append((a, start, end))
                free[r] = end
                pos[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise TensorparError(_deadlock_message(schedule, pos, done, pp, n_stages))
    makespan = max(free)
    busy = [sum(e - s for _, s, e in evs) for evs in events]
    bubble = 1.0 - sum(busy) / (pp * makespan)
    return Timeline(
        pp=pp, microbatches=m, virtual_stages=v, events=events, makespan=makespan,
        bubble_fraction=bubble, forward_time=forward_time, backward_time=backward_time,
        p2p_time=p2p_time, name=name, busy=busy,
    )


def _deadlock_message(schedule, pos, done, pp, n_stages) -> str:
    where = {}
    for r, acts in enumerate(schedule):
        for i, a in enumerate(acts):
            where[(a.kind, a.microbatch, stage_of(r, a.chunk, pp))] = (r, i)
    lines = []
    for r, acts in enumerate(schedule):
        if pos[r] >= len(acts):
            continue
        a = acts[pos[r]]
        waits = []
        for dep in _deps(a, r, pp, n_stages):
            if dep in done:
                continue
            dr, di = where[dep]
            if dr == r:
                waits.append(f"{_name(*dep, pp)}, which comes later in its own order (position {di})")
            else:
                waits.append(f"{_name(*dep, pp)} (position {di} of rank {dr}, which is stuck at {pos[dr]})")
        lines.append(f"rank {r} at position {pos[r]} ({a}) waits for " + " and ".join(waits))
    return "pipeline schedule deadlocks: " + "; ".join(lines)


# --------------------------------------------------------------------------- memory


def peak_in_flight(schedule: list[list[Action]]) -> list[int]:
    """Per rank, the largest number of (microbatch, chunk) pairs whose forward has run and whose
    backward has not started yet: the activations a rank holds at its worst moment (for
    interleaved schedules each unit is one chunk, 1/v of the rank's layers)."""
    validate_schedule(schedule)
    peaks = []
    for acts in schedule:
        live = peak = 0
        for a in acts:
            if a.kind == "F":
                live += 1
                peak = max(peak, live)
            else:
                live -= 1
        peaks.append(peak)
    return peaks
