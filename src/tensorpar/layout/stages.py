"""The pipeline split, in one place: which layers each virtual stage holds, which rank holds which chunk, which
ranks hold the two ends, and what each schedule asks of the micro-batches.

The layers are cut into pp x c virtual stages (c chunks per rank: 1, the interleaved schedule's
--virtual-stages, or zbv's 2), evenly or by the counts of --pipeline-layers (one per pipeline stage, or one
per virtual stage). Chunk k of rank r is virtual stage k pp + r; in a V (zbv) rank r holds stages r and
2 pp - 1 - r, so rank 0 holds both the first stage (the embedding) and the last (the head and the loss).
The runner, the training session, the planner and the validation all read this module's `PipelineSplit`.
"""

from __future__ import annotations

import dataclasses
import functools

from tensorpar.config.choices import PIPELINE_SCHEDULES, SPLIT_BACKWARD_SCHEDULES, V_SHAPED_SCHEDULES
from tensorpar.errors import LayoutError
from tensorpar.layout.problem import Problem, require


def parse_pipeline_layers(text) -> tuple[int, ...] | None:
    """The layer counts of `--pipeline-layers` ("4,6,6,4", or a sequence of ints), or None when it is not given."""
    if text is None or str(text).strip() == "":
        return None
    if isinstance(text, (list, tuple)):
        return tuple(int(n) for n in text)
    try:
        return tuple(int(part) for part in str(text).split(","))
    except ValueError:
        raise LayoutError(f"--pipeline-layers must be comma-separated layer counts such as 4,6,6,4, "
                          f"got '{text}'") from None


def balanced_split(num_layers: int, stages: int) -> list[int]:
    """The most balanced layer counts of `stages` stages: the extra layers go to the middle stages, so the
    first and the last stage (embedding, LM head) hold fewer when the split cannot be even."""
    base, extra = divmod(num_layers, stages)
    middle_first = sorted(range(stages), key=lambda s: abs(2 * s - (stages - 1)))
    bigger = set(middle_first[:extra])
    return [base + (s in bigger) for s in range(stages)]


def is_v_shaped(schedule: str) -> bool:
    """Whether `schedule` places its two chunks per rank in a V (rank 0 holds the first and the last stage)."""
    return str(schedule).lower() in V_SHAPED_SCHEDULES


def splits_backward(schedule: str) -> bool:
    """Whether `schedule` splits each backward into B (input gradient) and W (weight gradients)."""
    return str(schedule).lower() in SPLIT_BACKWARD_SCHEDULES


def chunks_per_rank(schedule: str, virtual_stages: int | None = 1) -> int:
    """Model chunks per rank that `schedule` runs: 2 for zbv (a V), else `virtual_stages`."""
    return 2 if is_v_shaped(schedule) else (virtual_stages or 1)


def stage_of(rank: int, chunk: int, pp: int, v_shape: bool = False) -> int:
    """The virtual stage of chunk `chunk` on rank `rank`: ``chunk * pp + rank``, or in a V (two chunks) ``rank``
    for chunk 0 and ``2 * pp - 1 - rank`` for chunk 1."""
    if v_shape:
        return rank if chunk == 0 else 2 * pp - 1 - rank
    return chunk * pp + rank


def rank_of(stage: int, pp: int, v_shape: bool = False) -> tuple[int, int]:
    """(rank, chunk) that holds virtual stage `stage`: the inverse of `stage_of`."""
    if v_shape:
        return (stage, 0) if stage < pp else (2 * pp - 1 - stage, 1)
    return stage % pp, stage // pp


def schedule_problem(schedule: str, pp: int, microbatches: int | None, virtual_stages: int = 1) -> Problem | None:
    """What `schedule` cannot do with `microbatches` micro-batches per step on `pp` ranks (None: whatever the
    micro-batches; `virtual_stages`: the chunks per rank the user gave, zbv runs 2 whatever it is), or None."""
    key, m, v = str(schedule).lower(), microbatches, virtual_stages
    if key not in PIPELINE_SCHEDULES:
        return Problem(f"unknown pipeline schedule {schedule!r}", f"valid names: {', '.join(PIPELINE_SCHEDULES)}")
    if key == "interleaved":
        if m is not None and m % pp:
            good = [k * pp for k in range(max(1, m // pp), m // pp + 2)]
            return Problem(f"the interleaved schedule needs the number of microbatches ({m}) to be a multiple of the "
                           f"pipeline-parallel size {pp}", f"nearby multiples: {good}")
        return None
    if key == "zbv":
        if v not in (1, 2):
            return Problem(f"schedule 'zbv' runs two model chunks per rank (a V); virtual_stages={v} is not 2")
        if m is not None and m < 2 * pp - 1:
            return Problem(f"the zbv schedule needs at least 2 * pp - 1 = {2 * pp - 1} micro-batches per step (pp "
                           f"{pp}), got {m}", "raise the global batch size or lower the micro-batch size")
        return None
    if v != 1:
        return Problem(f"schedule {key!r} has one model chunk per rank; virtual_stages={v} needs the 'interleaved' "
                       f"schedule")
    return None


@dataclasses.dataclass(frozen=True)
class PipelineSplit:
    """How `num_layers` layers lie on `pp` pipeline ranks holding `chunks` model chunks each (`counts`: the layers
    of each pipeline stage (chunks 1) or of each virtual stage; None: an even split)."""

    num_layers: int
    pp: int = 1
    chunks: int = 1
    v_shape: bool = False
    counts: tuple[int, ...] | None = None

    @property
    def stages(self) -> int:
        """Virtual stages: pp x chunks."""
        return self.pp * self.chunks

    def problem(self) -> Problem | None:
        """Why the layers cannot be split this way, or None."""
        return _split_problem(self.num_layers, self.pp, self.chunks, self.counts)

    @property
    def stage_counts(self) -> tuple[int, ...]:
        """The layers of each virtual stage (a LayoutError when the split cannot be made)."""
        require(self.problem())
        return self.counts if self.counts is not None else (self.num_layers // self.stages,) * self.stages

    def stage_layers(self) -> list[list[int]]:
        """The global layer indices of each virtual stage."""
        return [list(r) for r in _stage_ranges(self.stage_counts)]

    def rank_layers(self, rank: int) -> list[list[int]]:
        """The layers of each of `rank`'s chunks, in chunk order."""
        ranges = _stage_ranges(self.stage_counts)
        return [list(ranges[self.stage_of(rank, c)]) for c in range(self.chunks)]

    def layers_of(self, rank: int) -> list[int]:
        """Every layer `rank` holds (its chunks' layers in chunk order)."""
        return [i for chunk in self.rank_layers(rank) for i in chunk]

    def stage_of(self, rank: int, chunk: int) -> int:
        return stage_of(rank, chunk, self.pp, self.v_shape)

    def rank_of(self, stage: int) -> tuple[int, int]:
        return rank_of(stage, self.pp, self.v_shape)

    @property
    def last_rank(self) -> int:
        """The rank that holds the last stage (the final norm, the head and the loss): pp - 1, or 0 in a V."""
        return self.rank_of(self.stages - 1)[0]

    def holds_ends(self, rank: int) -> tuple[bool, bool]:
        """(whether `rank` holds the first stage, whether it holds the last)."""
        return rank == 0, rank == self.last_rank

    def busiest_candidates(self) -> list[int]:
        """The ranks that can be the most loaded (in memory or time): the ends' ranks, and with uneven stages the
        first rank holding each distinct layer count (an earlier rank holds at least as many micro-batches in
        flight, so it dominates a later one of the same size)."""
        return list(_candidates(self))


def _split_problem(num_layers: int, pp: int, chunks: int, counts) -> Problem | None:
    stages = pp * chunks
    if counts is None:
        if num_layers % stages == 0:
            return None
        # One count per pipeline stage, or with several chunks per rank (interleaved, zbv) one per virtual stage.
        hint = (f"; or give uneven stages with --pipeline-layers {','.join(map(str, balanced_split(num_layers, stages)))}"
                if num_layers >= stages else "")
        return Problem(f"{num_layers} layers cannot be split evenly into pp={pp} x virtual stages={chunks} = {stages} "
                       f"pipeline stages", f"use a layout whose pp x virtual stages divides {num_layers}{hint}")
    given = ",".join(map(str, counts))
    if len(counts) not in (pp, stages) or (len(counts) == pp and chunks > 1):
        if chunks == 1:
            return Problem(f"--pipeline-layers {given} has {len(counts)} entries; it needs one per pipeline stage "
                           f"(--pp {pp})", f"e.g. {','.join(map(str, balanced_split(num_layers, pp)))}")
        return Problem(f"--pipeline-layers {given} has {len(counts)} entries: one per pipeline stage needs "
                       f"--virtual-stages 1, and {chunks} chunks per rank need one per virtual stage (pp x {chunks} = "
                       f"{stages})", f"e.g. {','.join(map(str, balanced_split(num_layers, stages)))}")
    if min(counts) <= 0:
        return Problem(f"--pipeline-layers {given}: every pipeline stage needs at least one layer")
    if sum(counts) != num_layers:
        return Problem(f"--pipeline-layers {given} sums to {sum(counts)} layers but the model has {num_layers}")
    return None


@functools.lru_cache(maxsize=65536)
def _stage_ranges(counts: tuple[int, ...]) -> tuple[range, ...]:
    starts = [sum(counts[:s]) for s in range(len(counts))]
    return tuple(range(start, start + n) for start, n in zip(starts, counts))


@functools.lru_cache(maxsize=65536)
def _candidates(split: PipelineSplit) -> tuple[int, ...]:
    out = {0, split.last_rank, split.pp - 1}
    if split.counts is not None:
        seen = set()
        for rank in range(split.pp):
            n = len(split.layers_of(rank))
            if n not in seen:
                seen.add(n)
                out.add(rank)
    return tuple(sorted(out))
