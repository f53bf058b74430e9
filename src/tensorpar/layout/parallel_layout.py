"""The parallel layout of a run, as one value: what `tensorpar train`, eval, generate, the dry run, the planner
and the checkpoints share.

A `ParallelLayout` says how a world of tp x cp x dp x pp ranks splits the model and the work: the sizes of the
dimensions, how MoE layers fold the ranks of a stage (ep x expert-TP), ZeRO's stage and HSDP's replicas, the
pipeline schedule and its split, and sequence parallelism. It is validated in two steps: its own fields when
it is made (types, choices), and against a model, a sequence length and a batch by `problems()`, the one place
that holds every rule a layout must satisfy (`tensorpar.layout.rules`). The facts derived from it (the ranks
of a pipeline stage, the sequence shard, the pipeline split, the groups' sizes and spans) are its properties,
so that no module works them out again.

Ranks are laid out as Megatron-Core orders them: TP fastest, then CP, then DP, then PP
(``rank = ((pp_rank * dp + dp_rank) * cp + cp_rank) * tp + tp_rank``); the MoE layers fold a stage's
tp x cp x dp ranks into expert-TP (fastest) x EP x expert-DP. See `tensorpar.distributed.mesh`.
"""

from __future__ import annotations

import dataclasses

from tensorpar.config.choices import PIPELINE_SCHEDULES, ZERO_STAGES
from tensorpar.errors import LayoutError
from tensorpar.layout.problem import Problem
from tensorpar.layout.rules import layout_problems
from tensorpar.layout.stages import (PipelineSplit, chunks_per_rank, is_v_shaped, parse_pipeline_layers,
                                     splits_backward)

_SIZES = ("tp", "cp", "pp", "dp", "dp_replicate", "ep", "expert_tp", "virtual_stages")


@dataclasses.dataclass(frozen=True)
class ParallelLayout:
    """How the ranks split the model: see the module docstring. Made from the flags by `from_options`."""

    tp: int = 1
    cp: int = 1
    pp: int = 1
    dp: int = 1
    dp_replicate: int = 1  # HSDP: ZeRO shards within dp / dp_replicate DP ranks, all-reduced across the replicas
    ep: int = 1  # expert parallelism (MoE models): the experts split over ep of a stage's tp x cp x dp ranks
    expert_tp: int = 1  # each expert's MLP split over this many ranks (MoE models)
    zero: int = 0
    schedule: str | None = None  # None: "1f1b", or "interleaved" with virtual_stages > 1; "1f1b" without pp > 1
    virtual_stages: int = 1  # --virtual-stages: model chunks per rank of the interleaved schedule (zbv runs 2)
    pipeline_layers: tuple[int, ...] | None = None  # layers of each pipeline (or virtual) stage; None: even
    sequence_parallel: bool = False  # in effect only with tp > 1 (set to False otherwise)

    def __post_init__(self):
        for name in _SIZES:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise LayoutError(f"{name} must be a positive integer, got {value!r}")
        if self.zero not in ZERO_STAGES:
            raise LayoutError(f"zero must be one of {list(ZERO_STAGES)}, got {self.zero!r}")
        schedule = self.schedule
        if schedule is None or self.pp == 1:  # a pipeline of one stage has no schedule to speak of
            schedule = "interleaved" if self.virtual_stages > 1 else "1f1b"
        schedule = str(schedule).lower()
        if schedule not in PIPELINE_SCHEDULES:
            raise LayoutError(f"unknown pipeline schedule {self.schedule!r}; valid names: "
                              f"{', '.join(PIPELINE_SCHEDULES)}")
        object.__setattr__(self, "schedule", schedule)
        object.__setattr__(self, "pipeline_layers", parse_pipeline_layers(self.pipeline_layers))
        object.__setattr__(self, "sequence_parallel", bool(self.sequence_parallel) and self.tp > 1)

    @classmethod
    def from_options(cls, options, world_size: int) -> "ParallelLayout":
        """The layout a command's options (TrainOptions, EvalOptions, ...) describe on `world_size` ranks, dp
        defaulting to what tp x cp x pp leaves of the world. Options a command does not have take the defaults."""
        get = lambda name, default: getattr(options, name, default)  # noqa: E731
        tp, cp, pp = options.tp, get("cp", 1), get("pp", 1)
        dp = resolve_dp(world_size, tp, cp, pp, get("dp", None))
        return cls(tp=tp, cp=cp, pp=pp, dp=dp, dp_replicate=get("dp_replicate", 1), ep=get("ep", 1),
                   expert_tp=get("expert_tp", 1), zero=get("zero", 0), schedule=get("schedule", None),
                   virtual_stages=get("virtual_stages", 1), pipeline_layers=get("pipeline_layers", None),
                   sequence_parallel=get("sequence_parallel", False))

    def replace(self, **changes) -> "ParallelLayout":
        """This layout with `changes`; a new virtual-stage count picks 1f1b or interleaved again unless the schedule
        is given (or is a zero-bubble one)."""
        if "virtual_stages" in changes and "schedule" not in changes and self.schedule in ("1f1b", "interleaved"):
            changes["schedule"] = None
        return dataclasses.replace(self, **changes)

    # -- sizes of the world and its groups ---------------------------------------------------------------

    @property
    def world(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    @property
    def stage_ranks(self) -> int:
        """The ranks of one pipeline stage: tp x cp x dp (what the MoE layers regroup into expert-TP x EP x
        expert-DP)."""
        return self.tp * self.cp * self.dp

    @property
    def replicas(self) -> int:
        """The ranks that hold the same parameters and see other tokens (DP x CP): their gradients are averaged."""
        return self.dp * self.cp

    @property
    def shards(self) -> int:
        """The ranks ZeRO shards over: every replica (DP x CP), or under HSDP the ranks of one replica."""
        return self.replicas // self.dp_replicate

    @property
    def expert_dp(self) -> int:
        """The ranks that hold the same expert shards (expert-DP): a stage's ranks over ep x expert-TP."""
        return max(self.stage_ranks // (self.ep * self.expert_tp), 1)

    def expert_parallel(self, moe: bool) -> int | None:
        """The expert-parallel size the mesh folds (`init_mesh(ep=...)`), or None for a dense model, whose mesh
        has no expert groups."""
        return self.ep if moe else None

    def group_size(self, group: str) -> int:
        """The size of the mesh's group `group` ("tp", "cp", "dp", "dp_cp", "pp", "embed", "ep", "edp",
        "dp_shard", "dp_replicate")."""
        return {"tp": self.tp, "cp": self.cp, "dp": self.dp, "dp_cp": self.replicas, "pp": self.pp,
                "embed": 2 if self.pp > 1 else 1, "ep": self.ep, "edp": self.expert_dp, "dp_shard": self.shards,
                "dp_replicate": self.dp_replicate}[group]

    def group_span(self, group: str) -> int:
        """How many consecutive global ranks the members of `group` spread over (TP fastest, then CP, DP, PP; EP
        groups are consecutive ranks of a stage, expert-DP groups span the stage)."""
        tp, cp, stage = self.tp, self.cp, self.stage_ranks
        return {"tp": tp, "cp": tp * cp, "dp": stage, "dp_cp": stage, "pp": self.world, "embed": self.world,
                "ep": self.ep * self.expert_tp, "edp": stage, "dp_shard": stage // self.dp_replicate,
                "dp_replicate": stage}[group]

    @property
    def gradient_group(self) -> str:
        """The group parameter gradients are averaged over, as the mesh names it."""
        return "dp_cp" if self.cp > 1 else "dp"

    @property
    def shard_group(self) -> str:
        """The group ZeRO shards over, as the mesh names it: the gradient group, or under HSDP "dp_shard"."""
        return "dp_shard" if self.dp_replicate > 1 else self.gradient_group

    # -- the sequence ---------------------------------------------------------------------------------------

    def seq_shard(self, seq_len: int) -> int:
        """The positions of a sequence of `seq_len` one rank holds outside the TP regions: its CP chunks, and of
        those its TP rank's shard under sequence parallelism."""
        return seq_len // self.cp // (self.tp if self.sequence_parallel else 1)

    # -- the pipeline -----------------------------------------------------------------------------------------

    @property
    def chunks(self) -> int:
        """Model chunks per pipeline rank: the interleaved schedule's virtual stages, zbv's 2, else 1."""
        return chunks_per_rank(self.schedule, self.virtual_stages)

    @property
    def v_shaped(self) -> bool:
        return self.pp > 1 and is_v_shaped(self.schedule)

    @property
    def splits_backward(self) -> bool:
        """Whether the schedule leaves weight gradients for later (zb-h1, zbv)."""
        return self.pp > 1 and splits_backward(self.schedule)

    def split(self, num_layers: int) -> PipelineSplit:
        """How `num_layers` layers lie on the pipeline ranks (`tensorpar.layout.stages`)."""
        return PipelineSplit(num_layers, self.pp, self.chunks, self.v_shaped, self.pipeline_layers)

    def num_micro_batches(self, global_batch: int, micro_batch_size: int) -> int:
        """Micro-batches per step on each DP replica."""
        return global_batch // (self.dp * micro_batch_size)

    # -- its rules ----------------------------------------------------------------------------------------------

    def problems(self, cfg, *, seq_len: int | None = None, global_batch: int | None = None,
                 micro_batch_size: int | None = None, fp8: bool = False) -> list[Problem]:
        """Every reason this layout cannot run model `cfg` (`tensorpar.layout.rules.layout_problems`)."""
        return layout_problems(self, cfg, seq_len=seq_len, global_batch=global_batch,
                               micro_batch_size=micro_batch_size, fp8=fp8)

    def check(self, cfg, **run) -> "ParallelLayout":
        """This layout, or a LayoutError of its first problem (the one-line error every command raises);
        `run`: `problems`' keywords."""
        found = self.problems(cfg, **run)
        if found:
            raise LayoutError(str(found[0]))
        return self

    # -- how it reads -------------------------------------------------------------------------------------------

    def as_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out["pipeline_layers"] = list(self.pipeline_layers) if self.pipeline_layers is not None else None
        return out

    def describe(self) -> str:
        """'tp=2 pp=2 dp=1 zero-1 1f1b +sequence-parallel': what a run's summary line prints."""
        parts = [f"tp={self.tp}"] + ([f"cp={self.cp}"] if self.cp > 1 else []) + [f"pp={self.pp}", f"dp={self.dp}"]
        parts += [f"ep={self.ep}"] if self.ep > 1 else []
        parts += [f"expert-tp={self.expert_tp}"] if self.expert_tp > 1 else []
        parts += [f"zero-{self.zero}"] if self.zero else []
        parts += [f"hsdp {self.dp_replicate}x{self.dp // self.dp_replicate}"] if self.dp_replicate > 1 else []
        if self.pp > 1:
            parts.append(self.schedule + (f" v={self.virtual_stages}" if self.virtual_stages > 1 else ""))
        parts += [f"layers={','.join(map(str, self.pipeline_layers))}"] if self.pipeline_layers else []
        parts += ["+sequence-parallel"] if self.sequence_parallel else []
        return " ".join(parts)


def resolve_dp(world_size: int, tp: int, cp: int = 1, pp: int = 1, dp: int | None = None) -> int:
    """The data-parallel size of tp x cp x pp x dp on `world_size` ranks (`dp` None: what is left of the world), or
    a LayoutError when the product is not the world."""
    for name, value in (("tp", tp), ("pp", pp), ("dp", dp), ("cp", cp)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise LayoutError(f"{name} must be a positive integer, got {value!r}")
    named = f"tp={tp}" + (f" x cp={cp}" if cp > 1 else "") + f" x pp={pp}"
    product = "tp*" + ("cp*" if cp > 1 else "") + "pp"
    fixed = tp * cp * pp
    if dp is None:
        if world_size % fixed:
            raise LayoutError(f"layout {named} does not fit world size {world_size}: "
                              f"{world_size} is not divisible by {product}={fixed}")
        dp = world_size // fixed
    if fixed * dp != world_size:
        raise LayoutError(f"layout {named} x dp={dp} = {fixed * dp} processes, but the world has {world_size}; "
                          f"the product must equal the world size")
    return dp
