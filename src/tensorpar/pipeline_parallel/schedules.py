"""Pipeline-parallel schedules as pure data and their ideal bubble (their simulation:
:mod:`tensorpar.pipeline_parallel.schedule_simulation`).

A schedule is ``list[list[Action]]``: one list per pipeline rank, in the order that rank executes
its actions. Nothing here communicates; the executor runs these lists with real send/recv.

The contract (the executor relies on it)
-----------------------------------------
- ``Action(kind, microbatch, chunk)``: ``kind`` is ``"F"`` (forward), ``"B"`` (backward) or
  ``"W"`` (weight gradients), ``microbatch`` is 0-based, ``chunk`` is the model chunk on this
  rank (0-based, 0 unless interleaved or V-shaped).
- In schedules without ``W`` actions, ``B`` is the whole backward. The zero-bubble schedules
  split it: ``B`` computes only the gradient of the stage's input (what the previous stage waits
  for) and queues the weight gradients, which ``W`` computes later
  (:mod:`tensorpar.pipeline_parallel.weight_grad`).
- With ``pp`` ranks and ``v`` chunks per rank the model's layers are cut into ``S = pp * v``
  virtual stages in model order; rank ``r`` holds virtual stages ``r, r + pp, r + 2*pp, ...`` as
  chunks ``0, 1, ..., v - 1``: chunk ``c`` of rank ``r`` is stage ``s = c * pp + r``
  (:func:`stage_of`). V-shaped schedules (``zbv``: ``v = 2``) place the chunks the other way
  back: chunk 0 of rank ``r`` is stage ``r`` and chunk 1 is stage ``2 * pp - 1 - r``, so rank 0
  holds the first and the last stage, and the turn (stage ``pp - 1`` to ``pp``) stays on rank
  ``pp - 1``. A schedule built by :func:`build_schedule` is a :class:`Schedule` (a list) that
  says which placement it uses.
- Dependencies: ``F(mb, s)`` needs ``F(mb, s - 1)`` (for ``s > 0``); ``B(mb, s)`` needs
  ``F(mb, s)`` and, for ``s < S - 1``, ``B(mb, s + 1)``; on the last stage ``B(mb, S - 1)``
  needs only ``F(mb, S - 1)`` (the loss is computed there); ``W(mb, s)`` needs ``B(mb, s)``.
  A dependency on a stage of another rank is a point-to-point transfer: an activation forward,
  an activation gradient backward.
- Every rank's list holds each ``F(mb, c)`` and each ``B(mb, c)`` exactly once, for every
  microbatch ``mb < m`` and chunk ``c < v``, and, in a split schedule, each ``W(mb, c)`` once
  too (:func:`validate_schedule`).

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
- :func:`zb_h1` (Qi et al., 2024, "Zero Bubble (Almost) Pipeline Parallelism", ZB-H1): the
  backward split into ``B`` and ``W``; ``F`` and ``B`` keep 1F1B's memory bound (at most
  ``pp - r`` micro-batches between their forward and their ``B`` on rank ``r``) and the ``W``
  passes wait for idle time, mostly the cool-down bubble. The order is list scheduling on an
  ideal machine (every action one time unit): a free rank runs a ready ``B``, else a ready
  ``F`` (if the bound allows, and if at most ``pp`` micro-batches then wait for their ``W``),
  else its oldest pending ``W``.
- :func:`zbv` (ZB-V of the same paper; the construction of PyTorch's
  ``ScheduleZBVZeroBubble``, which torchtitan runs): two chunks per rank in a V
  (see above); rank ``r`` runs ``2 * (pp - r) - 1`` chunk-0 forwards, then ``r`` pairs
  (chunk-1 forward, chunk-0 forward), then ``pp - r`` chunk-1 (F, B, W) triples, then steady
  state (chunk-0 F, B, W, chunk-1 F, B, W) until every forward ran; the cool-down runs the
  remaining ``B`` s with ``W`` s filling the gaps. Needs ``m >= 2 * pp - 1``.

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

- ZB-H1 with ``t_F = t_B = t_W`` (``B`` and ``W`` each half of a backward twice as long as the
  forward): the cool-down bubble is filled with ``W`` passes and what stays idle is
  ``(pp - 1) * (t_F + t_B - t_W)`` per rank (the paper's section 3.1), against
  ``m * (t_F + t_B + t_W)`` of work: ``bubble = (pp - 1) / (3 * m + pp - 1)``, a third of
  1F1B's idle time. The list schedule reaches it at ``pp`` 2 and 4 (the shapes the tests pin);
  at other ``pp`` it stays within a unit or two of it.
- ZB-V with chunk times ``t_F = t_B = t_W``: rank ``r`` waits ``r`` chunk forwards for its first
  micro-batch and finishes ``pp - 1 - r`` chunk steps before rank 0 does, so each rank idles
  ``(pp - 1)`` chunk steps against ``6 * m`` of work: ``bubble = (pp - 1) / (6 * m + pp - 1)``.

``bubble`` here is the fraction of the pipeline's rank-time that is idle:
``1 - busy / (pp * makespan)``, the quantity :func:`~tensorpar.pipeline_parallel.schedule_simulation.simulate` reports.
It reproduces these values exactly with ``forward_time=1, backward_time=2``
(``tests/test_pipeline_schedules.py`` checks a grid). In the simulation the times are per action, i.e.
per chunk for interleaved schedules; the bubble fraction does not depend on that scale.
"""

from __future__ import annotations

from dataclasses import dataclass

from tensorpar.config.choices import PIPELINE_SCHEDULES
from tensorpar.errors import LayoutError, TensorparError
from tensorpar.layout import require
from tensorpar.layout.stages import schedule_problem


ACTION_KINDS = ("F", "B", "W")


@dataclass(frozen=True)
class Action:
    """One step of one pipeline rank: ``kind`` "F" (forward), "B" (backward; in a split schedule only
    the input gradient) or "W" (the weight gradients queued by that B) of ``microbatch`` (0-based) on
    model chunk ``chunk`` of this rank (0-based; its virtual stage: :func:`stage_of`)."""

    kind: str
    microbatch: int
    chunk: int = 0

    def __str__(self) -> str:
        return f"{self.kind}{self.microbatch}" + (f"/chunk {self.chunk}" if self.chunk else "")


class Schedule(list):
    """A schedule: one list of Actions per rank, plus how the chunks sit on the ranks (``v_shape``:
    chunk 0 of rank r is stage r, chunk 1 is stage 2 * pp - 1 - r; else chunk c is stage c * pp + r)."""

    def __init__(self, ranks=(), *, v_shape: bool = False):
        super().__init__(ranks)
        self.v_shape = v_shape


def is_v_shaped(schedule) -> bool:
    """Whether the built ``schedule`` places its two chunks per rank in a V (see :class:`Schedule`)."""
    return bool(getattr(schedule, "v_shape", False))


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
    require(schedule_problem("interleaved", pp, m, v))
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


def zb_h1(pp: int, microbatches: int) -> list[list[Action]]:
    """ZB-H1 (Qi et al. 2024): 1F1B's forwards and input-gradient backwards (B), the weight-gradient
    passes (W) put off into idle time; list scheduling with unit times (see the module docstring)."""
    _check_int("pp", pp)
    _check_int("microbatches", microbatches)
    m = microbatches
    done: dict[tuple[str, int, int], int] = {}  # (kind, microbatch, rank) -> end time
    free, counts = [0] * pp, [{"F": 0, "B": 0, "W": 0} for _ in range(pp)]
    out: list[list[Action]] = [[] for _ in range(pp)]
    for _ in range(3 * m * pp):
        best = None  # (start, priority, rank, kind)
        for r in range(pp):
            n = counts[r]
            options = []
            if n["B"] < n["F"]:
                needs = [("F", n["B"], r)] + ([("B", n["B"], r + 1)] if r < pp - 1 else [])
                if all(d in done for d in needs):
                    options.append((max([free[r]] + [done[d] for d in needs]), 0, r, "B"))
            if n["F"] < m and n["F"] - n["B"] < pp - r and n["F"] - n["W"] <= pp:
                needs = [("F", n["F"], r - 1)] if r > 0 else []
                if all(d in done for d in needs):
                    options.append((max([free[r]] + [done[d] for d in needs]), 1, r, "F"))
            if n["W"] < n["B"]:
                options.append((free[r], 2, r, "W"))
            if options:
                start = min(o[0] for o in options)
                pick = min(o for o in options if o[0] == start)
                best = pick if best is None or (pick[0], pick[2]) < (best[0], best[2]) else best
        start, _, r, kind = best
        mb = counts[r][kind]
        counts[r][kind] += 1
        done[(kind, mb, r)] = free[r] = start + 1
        out[r].append(Action(kind, mb))
    return out


def zbv(pp: int, microbatches: int) -> list[list[Action]]:
    """ZB-V: two chunks per rank in a V (chunk 0 = stage r, chunk 1 = stage 2 * pp - 1 - r), backward
    split into B and W; PyTorch's ``ScheduleZBVZeroBubble`` order (see the module docstring). Raises
    LayoutError unless ``microbatches >= 2 * pp - 1``."""
    _check_int("pp", pp)
    _check_int("microbatches", microbatches)
    m = microbatches
    require(schedule_problem("zbv", pp, m))
    out = []
    for r in range(pp):
        acts: list[Action] = []
        n = {("F", 0): 0, ("F", 1): 0, ("B", 0): 0, ("B", 1): 0, ("W", 0): 0, ("W", 1): 0}

        def run(*steps):
            for kind, chunk in steps:
                acts.append(Action(kind, n[(kind, chunk)], chunk))
                n[(kind, chunk)] += 1

        run(*[("F", 0)] * (2 * (pp - r) - 1))
        for _ in range(r):
            run(("F", 1), ("F", 0))
        for _ in range(pp - r):
            run(("F", 1), ("B", 1), ("W", 1))
        while n[("F", 1)] < n[("F", 0)] or n[("F", 0)] < m:
            if n[("F", 0)] < m:
                run(("F", 0))
            run(("B", 0), ("W", 0), ("F", 1), ("B", 1), ("W", 1))
        for _ in range(r):
            run(("B", 0), ("B", 1))
        for _ in range(pp - r):
            run(("B", 0), ("W", 0))
        run(*[("W", 1)] * (m - n[("W", 1)]), *[("W", 0)] * (m - n[("W", 0)]))
        out.append(acts)
    return out


def build_schedule(name: str, pp: int, microbatches: int, virtual_stages: int = 1) -> Schedule:
    """The schedule called ``name``: "afab", "1f1b", "zb-h1" (one chunk per rank), "interleaved"
    (``virtual_stages`` chunks per rank) or "zbv" (two chunks per rank in a V; ``virtual_stages``
    1 or 2 both mean that)."""
    if virtual_stages is None:
        virtual_stages = 1
    key = str(name).lower()
    if key == "interleaved":
        return Schedule(interleaved(pp, microbatches, virtual_stages))
    _check_int("virtual_stages", virtual_stages)
    require(schedule_problem(key, pp, None, virtual_stages))
    if key == "zbv":
        return Schedule(zbv(pp, microbatches), v_shape=True)
    build = {"afab": afab, "1f1b": one_f_one_b, "zb-h1": zb_h1}[key]
    return Schedule(build(pp, microbatches))


def bubble_formula(name: str, pp: int, m: int, v: int = 1) -> tuple[str, float]:
    """(the published ideal bubble's formula with this shape's numbers, its value): (p-1)/(m+p-1) for
    "afab" and "1f1b"; (p-1)/(v*m+p-1) for "interleaved" (Narayanan et al. 2021); (p-1)/(3m+p-1) for
    "zb-h1" and (p-1)/(6m+p-1) for "zbv" at t_F = t_B = t_W (Qi et al. 2024). See the module docstring."""
    key = str(name).lower()
    if key not in PIPELINE_SCHEDULES:
        raise TensorparError(f"unknown pipeline schedule {name!r}; valid names: {', '.join(PIPELINE_SCHEDULES)}")
    _check_int("pp", pp)
    _check_int("microbatches", m)
    _check_int("virtual_stages", v)
    factor, text = {"interleaved": (v, "v*m"), "zb-h1": (3, "3m"), "zbv": (6, "6m")}.get(key, (1, "m"))
    return f"(p-1)/({text}+p-1) = {pp - 1}/{factor * m + pp - 1}", (pp - 1) / (factor * m + pp - 1)


def theoretical_bubble(name: str, pp: int, m: int, v: int = 1) -> float:
    """Ideal bubble fraction of schedule ``name`` (:func:`bubble_formula`'s value)."""
    return bubble_formula(name, pp, m, v)[1]


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
    """Check that every rank runs each F(mb, chunk) and B(mb, chunk) exactly once, and each W(mb, chunk)
    once if the schedule has W actions at all, and nothing else; returns (pp, microbatches,
    virtual_stages). Raises TensorparError naming the first problem. Says nothing about order (see
    :func:`tensorpar.pipeline_parallel.schedule_simulation.simulate` for deadlocks)."""
    pp, m, v = schedule_shape(schedule)
    kinds = ACTION_KINDS if any(a.kind == "W" for acts in schedule for a in acts) else ("F", "B")
    if is_v_shaped(schedule) and v != 2:
        raise TensorparError(f"a V-shaped schedule has two chunks per rank, this one {v}")
    for r, acts in enumerate(schedule):
        seen = set()
        for i, a in enumerate(acts):
            if not isinstance(a, Action) or a.kind not in ACTION_KINDS:
                raise TensorparError(f"rank {r}, position {i}: {a!r} is not an Action of kind 'F', 'B' or 'W'")
            for fname in ("microbatch", "chunk"):
                val = getattr(a, fname)
                if isinstance(val, bool) or not isinstance(val, int) or val < 0:
                    raise TensorparError(f"rank {r}, position {i}: {fname} must be an integer >= 0 in {a!r}")
            key = (a.kind, a.microbatch, a.chunk)
            if key in seen:
                raise TensorparError(f"rank {r} runs {a} twice (second time at position {i})")
            seen.add(key)
        want = len(kinds) * m * v
        if len(seen) != want:
            missing = [
                Action(k, mb, c) for c in range(v) for mb in range(m) for k in kinds if (k, mb, c) not in seen
            ]
            raise TensorparError(
                f"rank {r} misses {len(missing)} of its {want} actions (microbatches 0..{m - 1}, "
                f"chunks 0..{v - 1}), first {', '.join(map(str, missing[:4]))}"
            )
    return pp, m, v


# --------------------------------------------------------------------------- memory


def peak_in_flight(schedule: list[list[Action]]) -> list[int]:
    """Per rank, the largest number of (microbatch, chunk) pairs whose forward has run and whose
    backward has not started yet: the activations a rank holds at its worst moment (for
    interleaved schedules each unit is one chunk, 1/v of the rank's layers). In split schedules a
    pair whose B ran still holds what its W needs (each linear's input and output gradient) until
    its W runs; that is not counted here."""
    validate_schedule(schedule)
    peaks = []
    for acts in schedule:
        live = peak = 0
        for a in acts:
            if a.kind == "F":
                live += 1
                peak = max(peak, live)
            elif a.kind == "B":
                live -= 1
        peaks.append(peak)
    return peaks
