"""What the planner evaluates: a `Candidate` is a `ParallelLayout` (the one value training takes) plus what only the
planner varies (the micro-batch size, recomputation); `enumerate_candidates` lists a search's candidates and
`candidate_problem` says why one cannot run.

Enumerated:

- tp: powers of two up to the node size (TP across nodes puts every layer's collectives on the
  slow link); those that do not fit the model's heads / KV heads / FFN are kept, infeasible;
- pp: every divisor of gpus / tp (those that do not divide the layers get the most balanced uneven split);
- dp = gpus / (tp x cp x pp); the global batch must divide by dp;
- micro-batch size: every divisor of global_batch / dp up to `max_micro_batch`;
- sequence parallelism off / on (on only with tp > 1);
- recomputation none / selective / full; ZeRO 0 / 1 / 2 / 3 (ZeRO > 0 only with dp x cp > 1);
- the schedules 1f1b, interleaved (v > 1 from `virtual_stages`), zb-h1 and zbv with pp > 1;
- expert parallelism ep (mixture-of-experts models; dense models: 1): every divisor of num_experts
  that also divides tp x cp x dp, the ranks of a pipeline stage that EP folds onto; expert-TP is 1;
- HSDP replica counts with ZeRO (one replica per node where the DP group spans nodes).

A candidate is infeasible for the first of `ParallelLayout.problems` (the rules `tensorpar train` refuses it by,
with the same reason), for a TP group spanning nodes, or for memory (`tensorpar.planning.search`).
"""

from __future__ import annotations

import dataclasses

from tensorpar.config.choices import PLANNED_ZERO_STAGES, RECOMPUTE_MODES
from tensorpar.config.hardware import Link
from tensorpar.errors import TensorparError
from tensorpar.layout import ParallelLayout, balanced_split
from tensorpar.planning.cluster import Cluster


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One way to run a model that the planner evaluates: the layout, and the micro-batch size and recomputation.
    It reads as its layout too (`candidate.tp` is `candidate.layout.tp`)."""

    layout: ParallelLayout
    micro_batch_size: int = 1
    recompute: str = "none"

    def __post_init__(self):
        if isinstance(self.micro_batch_size, bool) or not isinstance(self.micro_batch_size, int) \
                or self.micro_batch_size < 1:
            raise TensorparError(f"micro_batch_size must be a positive integer, got {self.micro_batch_size!r}")
        if self.recompute not in RECOMPUTE_MODES:
            raise TensorparError(f"recompute must be one of {RECOMPUTE_MODES}, got {self.recompute!r}")

    @classmethod
    def of(cls, micro_batch_size: int = 1, recompute: str = "none", **layout) -> "Candidate":
        """`Candidate.of(tp=2, pp=4, micro_batch_size=2)`: a candidate of the layout these fields make."""
        return cls(ParallelLayout(**layout), micro_batch_size, recompute)

    def replace(self, **changes) -> "Candidate":
        """This candidate with `changes` to it or to its layout."""
        own = {k: changes.pop(k) for k in ("micro_batch_size", "recompute") if k in changes}
        return dataclasses.replace(self, layout=self.layout.replace(**changes) if changes else self.layout, **own)

    def as_dict(self) -> dict:
        """The layout's fields with the micro-batch size and recomputation, flat."""
        return {**self.layout.as_dict(), "micro_batch_size": self.micro_batch_size, "recompute": self.recompute}

    def __getattr__(self, name):  # the layout's fields and facts, read through the candidate
        if name.startswith("__"):
            raise AttributeError(name)
        value = getattr(self.layout, name)
        # kept on the candidate (the layout is frozen too): the planner reads them millions of times per search
        object.__setattr__(self, name, value)
        return value

    def num_micro_batches(self, global_batch: int) -> int:
        """Micro-batches per step on each DP replica."""
        return self.layout.num_micro_batches(global_batch, self.micro_batch_size)

    def label(self) -> str:
        lay = self.layout
        parts = [f"tp={lay.tp}"] + ([f"cp={lay.cp}"] if lay.cp > 1 else []) + [f"pp={lay.pp}", f"dp={lay.dp}"]
        parts += [f"ep={lay.ep}"] if lay.ep > 1 else []
        parts += [f"v={lay.virtual_stages}"] if lay.virtual_stages > 1 else []
        parts += [f"schedule={lay.schedule}"] if lay.schedule in ("zb-h1", "zbv") else []
        parts += [f"layers={','.join(map(str, lay.pipeline_layers))}"] if lay.pipeline_layers is not None else []
        parts += [f"mbs={self.micro_batch_size}", f"sp={'on' if lay.sequence_parallel else 'off'}",
                  f"recompute={self.recompute}", f"zero={lay.zero}"]
        return " ".join(parts)


def stage_layers(cfg, layout, stage: int | None) -> tuple[bool, bool, int]:
    """(holds the first stage?, holds the last?, layers held) of pipeline rank `stage` (None: the whole model)."""
    if stage is None or layout.pp == 1:
        return True, True, cfg.num_layers
    if not 0 <= stage < layout.pp:
        raise TensorparError(f"stage {stage} is outside the pipeline of {layout.pp} stages")
    split = layout.split(cfg.num_layers)
    return (*split.holds_ends(stage), len(split.layers_of(stage)))


def stage_layer_indices(cfg, layout, stage: int | None) -> list[int]:
    """Global indices of the layers pipeline rank `stage` holds (None: the whole model), its chunks in order."""
    if stage is None or layout.pp == 1:
        return list(range(cfg.num_layers))
    if not 0 <= stage < layout.pp:
        raise TensorparError(f"stage {stage} is outside the pipeline of {layout.pp} stages")
    return layout.split(cfg.num_layers).layers_of(stage)


def candidate_stages(cfg, layout) -> list[int]:
    """The pipeline ranks that can be the most loaded (in memory or time)."""
    return [0] if layout.pp == 1 else layout.split(cfg.num_layers).busiest_candidates()


def group_link(cluster, layout, group: str) -> Link:
    return cluster.link_for_span(layout.group_span(group))


def candidate_problem(cfg, candidate: Candidate, cluster: Cluster, seq_len: int, global_batch: int,
                      fp8: bool = False) -> str:
    """Why `candidate` cannot run at all on `cluster` (the first of its layout's problems, or a TP group spanning
    nodes), or ''."""
    lay = candidate.layout
    if lay.world != cluster.gpus:
        return f"tp x cp x pp x dp = {lay.world} is not the {cluster.gpus} GPUs"
    problems = lay.problems(cfg, seq_len=seq_len, global_batch=global_batch,
                            micro_batch_size=candidate.micro_batch_size, fp8=fp8)
    if problems:
        return problems[0].reason
    if lay.tp > cluster.gpus_per_node:
        return f"tp = {lay.tp} spans nodes (more than {cluster.gpus_per_node} GPUs per node)"
    return ""


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def expert_parallel_sizes(cfg, stage_ranks: int, ep=None) -> list[int]:
    """The EP sizes to try on a pipeline stage of `stage_ranks` (tp x cp x dp) ranks: `ep` if given, else those that
    divide both num_experts and `stage_ranks` (dense models: 1)."""
    if ep is not None:
        return list(ep)
    if not cfg.is_moe:
        return [1]
    return [e for e in _divisors(cfg.num_experts) if stage_ranks % e == 0]


def _replica_counts(cluster: Cluster, tp: int, cp: int, dp: int, zero: int, ep: int, given) -> list[int]:
    """HSDP replica counts to try for one layout (see `enumerate_candidates`)."""
    if not zero or ep > 1:
        return [1]
    if given is not None:
        return [r for r in given if dp % r == 0]
    per_node = cluster.gpus_per_node // (tp * cp)  # DP ranks on one node
    nodes = dp // per_node if per_node >= 1 and dp % per_node == 0 else 1
    return [1, nodes] if nodes > 1 else [1]


def _pipelines(schedules, virtual_stages) -> list[tuple[str, int]]:
    """The (schedule, virtual stages) pairs to try with pp > 1."""
    if schedules is None:
        return [("1f1b" if v == 1 else "interleaved", v) for v in virtual_stages]
    pipes = [("1f1b", 1)] if "1f1b" in schedules else []
    pipes += [("interleaved", v) for v in virtual_stages if v > 1 and "interleaved" in schedules]
    return pipes + [(sc, 1) for sc in ("zb-h1", "zbv") if sc in schedules]


def _micro_batch_sizes(global_batch: int, dp: int, given, max_micro_batch: int) -> list[int]:
    if global_batch % dp:
        return [1]
    if given is not None:
        return [m for m in given if (global_batch // dp) % m == 0]
    return [m for m in _divisors(global_batch // dp) if m <= max_micro_batch]


def _uneven_split(cfg, p: int, chunks: int, given, uneven: bool):
    """The --pipeline-layers counts of a pipeline of p ranks with `chunks` chunks each: as given, else the most
    balanced uneven split where the layers do not divide (`uneven`), else None (even)."""
    if p == 1:
        return None
    if given is not None:
        return given
    stages = p * chunks
    if uneven and cfg.num_layers % stages and cfg.num_layers >= stages:
        return tuple(balanced_split(cfg.num_layers, stages))
    return None


def enumerate_candidates(cfg, cluster: Cluster, global_batch: int, *, tp=None, pp=None, zero=PLANNED_ZERO_STAGES,
                         recompute=RECOMPUTE_MODES, sequence_parallel=(False, True), virtual_stages=(1,),
                         max_micro_batch: int = 64, micro_batch_sizes=None, cp=(1,), ep=None,
                         pipeline_layers: tuple[int, ...] | None = None, schedules=None,
                         uneven: bool = True, dp_replicate=None) -> list[Candidate]:
    """Every candidate of a search (see the module docstring). `ep`: the expert-parallel sizes to try (None: for
    an MoE model every divisor of num_experts that divides the layout's tp x cp x dp, for a dense one 1; given
    sizes that do not divide are kept, infeasible). `pipeline_layers`: uneven stages of these layer counts (pp =
    their number, one chunk per rank); without it, a pp (x chunks) that does not divide the layers gets the most
    balanced uneven split (`tensorpar.layout.balanced_split`: the first and last stages, which hold the embedding
    and the head, get the fewer layers, as Llama 3 did). `schedules`: the pipeline schedules to try with pp > 1
    (None: 1f1b, and interleaved for each v > 1 of `virtual_stages`; `tensorpar plan` tries every one of
    `config.choices.PLANNED_SCHEDULES`). `uneven=False`: no automatic uneven split.
    `dp_replicate`: the HSDP replica counts to try with ZeRO (None: 1, and one replica per node where the DP group
    spans several nodes: sharded within a node, replicated across nodes)."""
    if pipeline_layers is not None:
        pp, virtual_stages = (len(pipeline_layers),), (1,)
    gpus = cluster.gpus
    tps = list(tp) if tp is not None else [t for t in (1, 2, 4, 8, 16, 32, 64)
                                           if t <= min(gpus, cluster.gpus_per_node) and gpus % t == 0]
    out = []
    for c in cp:
        for t in (t for t in tps if gpus % (t * c) == 0):
            for p in (p for p in (list(pp) if pp is not None else _divisors(gpus // (t * c)))
                      if (gpus // (t * c)) % p == 0):
                d = gpus // (t * c * p)
                for mbs in _micro_batch_sizes(global_batch, d, micro_batch_sizes, max_micro_batch):
                    for sp in (sequence_parallel if t > 1 else (False,)):
                        for rc in recompute:
                            for z in (zero if d * c > 1 else (0,)):
                                for sched, v in (_pipelines(schedules, virtual_stages) if p > 1 else [("1f1b", 1)]):
                                    chunks = 2 if sched == "zbv" else v
                                    split = _uneven_split(cfg, p, chunks, pipeline_layers, uneven)
                                    for e in expert_parallel_sizes(cfg, t * c * d, ep):
                                        for r in _replica_counts(cluster, t, c, d, z, e, dp_replicate):
                                            lay = ParallelLayout(tp=t, cp=c, pp=p, dp=d, dp_replicate=r, ep=e,
                                                                 zero=z, schedule=sched, virtual_stages=v,
                                                                 pipeline_layers=split, sequence_parallel=sp)
                                            out.append(Candidate(lay, mbs, rc))
    return out
