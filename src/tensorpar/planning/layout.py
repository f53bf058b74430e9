"""Layouts for the planner: one way to run a model (tp x pp x dp and the knobs that change memory and
time), the groups it forms and the links they use, and the enumeration of every layout of a search.

Ranks are laid out as in `tensorpar.distributed.mesh` (TP fastest, then DP, then PP), so a TP
group spans ``tp`` consecutive ranks, a DP group ``tp * dp`` and a PP group the whole world; a
group whose ranks lie within one node uses NVLink, a group spanning nodes the inter-node link.

Enumerated by `enumerate_layouts`:

- tp: powers of two up to the node size (TP across nodes puts every layer's collectives on the
  slow link); those that do not fit the model's heads / KV heads / FFN are kept, infeasible;
- pp: every divisor of gpus / tp (those that do not divide the layers are kept, infeasible);
- dp = gpus / (tp * pp); the global batch must divide by dp;
- micro-batch size: every divisor of global_batch / dp up to `max_micro_batch`;
- sequence parallelism off / on (on only with tp > 1; the sequence must divide by tp);
- recomputation none / selective / full; ZeRO 0 / 1 / 2 / 3 (ZeRO > 0 only with dp > 1);
- interleaved pipeline chunks v from `virtual_stages` (v > 1 only with pp > 1, the layers dividing
  by pp * v and the micro-batches by pp, as Megatron-LM requires);
- expert parallelism ep (mixture-of-experts models; dense models: 1): every divisor of num_experts
  that also divides tp * cp * dp, the ranks of a pipeline stage that EP folds onto. Within a stage the
  EP group is ``ep`` consecutive ranks and the expert-DP group (expert gradients) ``tp * cp * dp / ep``
  ranks ``ep`` apart (`tensorpar.distributed.mesh`); expert-TP is 1.

`structural_problem` says why a layout cannot run at all (sizes that do not divide).
"""

from __future__ import annotations

import dataclasses
import functools

from tensorpar.config.choices import PLANNED_SCHEDULES, PLANNED_ZERO_STAGES, RECOMPUTE_MODES
from tensorpar.config.hardware import Link
from tensorpar.errors import TensorparError
from tensorpar.models.layout_checks import check_model_layout, check_moe_layout
from tensorpar.pipeline_parallel.runner import balanced_split, rank_layers
from tensorpar.planning.cluster import Cluster


@dataclasses.dataclass(frozen=True)
class Layout:
    """One way to run a model: the tp x cp x dp x pp mesh and the knobs that change memory and time."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    sequence_parallel: bool = False
    micro_batch_size: int = 1
    recompute: str = "none"
    zero: int = 0
    virtual_stages: int = 1
    cp: int = 1  # context parallelism: each sequence split over cp ranks (ring attention)
    ep: int = 1  # expert parallelism (MoE models): the experts split over ep of a stage's tp x cp x dp ranks
    pipeline_layers: tuple[int, ...] | None = None  # layers of each pipeline stage (--pipeline-layers; None: even)
    schedule: str = "1f1b"  # 1f1b | interleaved (virtual_stages > 1) | zb-h1 | zbv (zero-bubble, Qi et al.)
    dp_replicate: int = 1  # HSDP: ZeRO shards within dp / dp_replicate DP ranks, all-reduced across the replicas

    def __post_init__(self):
        if self.schedule in ("1f1b", "interleaved"):  # v > 1 is Megatron-LM's interleaved 1F1B, v = 1 plain 1F1B
            object.__setattr__(self, "schedule", "interleaved" if self.virtual_stages > 1 else "1f1b")
        if self.schedule not in PLANNED_SCHEDULES:
            raise TensorparError(f"layout: schedule must be one of {PLANNED_SCHEDULES}, got {self.schedule!r}")
        if (self.schedule == "interleaved") != (self.virtual_stages > 1):
            raise TensorparError(f"layout: the interleaved schedule and only it has virtual_stages > 1 "
                                 f"(schedule {self.schedule!r}, virtual_stages {self.virtual_stages})")
        for name in ("tp", "pp", "dp", "micro_batch_size", "virtual_stages", "cp", "ep", "dp_replicate"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise TensorparError(f"layout: {name} must be a positive integer, got {getattr(self, name)!r}")
        if self.recompute not in RECOMPUTE_MODES:
            raise TensorparError(f"layout: recompute must be one of {RECOMPUTE_MODES}, got {self.recompute!r}")
        if self.zero not in PLANNED_ZERO_STAGES:
            raise TensorparError(f"layout: zero must be 0, 1, 2 or 3, got {self.zero!r}")

    @property
    def world(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    @property
    def replicas(self) -> int:
        """The ranks that hold the same parameters and see other tokens: their gradients are averaged."""
        return self.dp * self.cp

    @property
    def shards(self) -> int:
        """The ranks ZeRO shards over: every replica (DP x CP), or under HSDP the ranks of one replica."""
        return self.replicas // self.dp_replicate

    @property
    def expert_dp(self) -> int:
        """The ranks that hold the same experts (expert-DP): a stage's tp x cp x dp ranks over ep."""
        return max(self.tp * self.cp * self.dp // self.ep, 1)

    @property
    def sp(self) -> bool:
        """Sequence parallelism in effect (it needs TP > 1)."""
        return self.sequence_parallel and self.tp > 1

    def num_micro_batches(self, global_batch: int) -> int:
        """Micro-batches per step on each DP replica."""
        return global_batch // (self.dp * self.micro_batch_size)

    def label(self) -> str:
        parts = [f"tp={self.tp}"] + ([f"cp={self.cp}"] if self.cp > 1 else []) + [f"pp={self.pp}", f"dp={self.dp}"]
        if self.ep > 1:
            parts.append(f"ep={self.ep}")
        if self.virtual_stages > 1:
            parts.append(f"v={self.virtual_stages}")
        if self.schedule in ("zb-h1", "zbv"):
            parts.append(f"schedule={self.schedule}")
        if self.pipeline_layers is not None:
            parts.append(f"layers={','.join(map(str, self.pipeline_layers))}")
        parts += [f"mbs={self.micro_batch_size}", f"sp={'on' if self.sp else 'off'}",
                  f"recompute={self.recompute}", f"zero={self.zero}"]
        return " ".join(parts)


def stage_layers(cfg, layout: Layout, stage: int | None) -> tuple[bool, bool, int]:
    """(first stage?, last stage?, layers held) of pipeline rank `stage` (None: the whole model)."""
    if stage is None or layout.pp == 1:
        return True, True, cfg.num_layers
    if not 0 <= stage < layout.pp:
        raise TensorparError(f"stage {stage} is outside the pipeline of {layout.pp} stages")
    if layout.pipeline_layers is not None:
        return stage == 0, stage == layout.pp - 1, len(stage_layer_indices(cfg, layout, stage))
    if cfg.num_layers % layout.pp:
        raise TensorparError(f"num_layers = {cfg.num_layers} is not divisible by the pipeline-parallel size "
                             f"{layout.pp}")
    return stage == 0, stage == layout.pp - 1, cfg.num_layers // layout.pp


def stage_layer_indices(cfg, layout: Layout, stage: int | None) -> list[int]:
    """Global indices of the layers pipeline rank `stage` holds (None: the whole model); with v virtual stages
    those of chunks stage, stage + pp, ... (tensorpar.pipeline_parallel.runner.rank_layers, which also applies
    the layout's --pipeline-layers split)."""
    if stage is None or layout.pp == 1:
        return list(range(cfg.num_layers))
    if not 0 <= stage < layout.pp:
        raise TensorparError(f"stage {stage} is outside the pipeline of {layout.pp} stages")
    return list(_layer_indices(cfg.num_layers, layout.pp, layout.virtual_stages, layout.pipeline_layers, stage))


@functools.lru_cache(maxsize=65536)
def _layer_indices(num_layers: int, pp: int, v: int, pipeline_layers, stage: int) -> tuple[int, ...]:
    """`stage_layer_indices`, cached: the search asks for the same split thousands of times."""
    split = list(pipeline_layers) if pipeline_layers is not None else None
    if split is not None and v > 1 and len(split) == pp * v:  # planning only: uneven virtual stages (chunk c: c pp + rank)
        if sum(split) != num_layers or min(split) < 1:
            raise TensorparError(f"uneven interleaved stages need pp x v = {pp * v} positive counts summing to "
                                 f"{num_layers}, got {','.join(map(str, split))}")
        starts = [sum(split[:i]) for i in range(pp * v)]
        return tuple(i for c in range(v)
                     for i in range(starts[c * pp + stage], starts[c * pp + stage] + split[c * pp + stage]))
    chunks = rank_layers(num_layers, pp, stage, v, split)
    return tuple(i for chunk in chunks for i in chunk)


def candidate_stages(cfg, layout: Layout) -> list[int]:
    """The pipeline ranks that can be the most loaded (in memory or time): the first and the last, and with
    uneven stages the first rank holding each distinct layer count (an earlier rank holds at least as many
    micro-batches in flight, so it dominates a later one of the same size)."""
    if layout.pp == 1:
        return [0]
    return list(_candidates(cfg.num_layers, layout.pp, layout.virtual_stages, layout.pipeline_layers))


@functools.lru_cache(maxsize=65536)
def _candidates(num_layers: int, pp: int, v: int, pipeline_layers) -> tuple[int, ...]:
    out = {0, pp - 1}
    if pipeline_layers is not None:
        seen = set()
        for st in range(pp):
            n = len(_layer_indices(num_layers, pp, v, pipeline_layers, st))
            if n not in seen:
                seen.add(n)
                out.add(st)
    return tuple(sorted(out))


def group_size(layout: Layout, group: str) -> int:
    return {"tp": layout.tp, "cp": layout.cp, "dp": layout.dp, "dp_cp": layout.dp * layout.cp, "pp": layout.pp,
            "embed": 2 if layout.pp > 1 else 1, "ep": layout.ep, "edp": layout.expert_dp, "dp_shard": layout.shards,
            "dp_replicate": layout.dp_replicate}[group]


def group_span(layout: Layout, group: str) -> int:
    """How many consecutive global ranks the group's members spread over (TP fastest, then CP, DP, PP; EP
    groups are consecutive ranks of a stage, expert-DP groups span the stage)."""
    tp, cp = layout.tp, layout.cp
    return {"tp": tp, "cp": tp * cp, "dp": tp * cp * layout.dp, "dp_cp": tp * cp * layout.dp, "pp": layout.world,
            "embed": layout.world, "ep": layout.ep, "edp": tp * cp * layout.dp,
            "dp_shard": tp * cp * layout.dp // layout.dp_replicate, "dp_replicate": tp * cp * layout.dp}[group]


def gradient_group(layout: Layout) -> str:
    """The group parameter gradients are averaged over, as `mesh.dp_cp_group` names it."""
    return "dp_cp" if layout.cp > 1 else "dp"


def shard_group(layout: Layout) -> str:
    """The group ZeRO shards over, as the mesh names it: the gradient group, or under HSDP "dp_shard"."""
    return "dp_shard" if layout.dp_replicate > 1 else gradient_group(layout)


def group_link(cluster, layout: Layout, group: str) -> Link:
    return cluster.link_for_span(group_span(layout, group))


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def structural_problem(cfg, layout: Layout, cluster: Cluster, seq_len: int, global_batch: int) -> str:
    """Why this layout cannot run at all (sizes that do not divide), or ''."""
    tp, pp, dp, cp = layout.tp, layout.pp, layout.dp, layout.cp
    if layout.world != cluster.gpus:
        return f"tp x cp x pp x dp = {layout.world} is not the {cluster.gpus} GPUs"
    try:
        check_model_layout(cfg, tp)
    except TensorparError as e:
        return str(e).split(";")[0]
    if layout.pipeline_layers is not None:
        try:
            stage_layer_indices(cfg, layout, 0)
        except TensorparError as e:
            return str(e)
    elif cfg.num_layers % pp:
        return f"num_layers = {cfg.num_layers} is not divisible by pp = {pp}"
    if global_batch % dp:
        return f"global batch {global_batch} is not divisible by dp = {dp}"
    if (global_batch // dp) % layout.micro_batch_size:
        return f"micro-batch {layout.micro_batch_size} does not divide the {global_batch // dp} sequences per replica"
    if cp > 1 and seq_len % (2 * cp):
        return f"sequence length {seq_len} is not divisible by 2 x cp = {2 * cp} (context parallelism)"
    if layout.sp and (seq_len // cp) % tp:
        return f"sequence length {seq_len} is not divisible by tp = {tp} (sequence parallelism)"
    if layout.zero and layout.replicas == 1:
        return "ZeRO needs dp x cp > 1"
    if layout.dp_replicate > 1 and (dp % layout.dp_replicate or not layout.zero or layout.ep > 1):
        return f"HSDP with {layout.dp_replicate} replicas needs ZeRO, no EP, and dp divisible by them"
    if cfg.is_moe or layout.ep > 1:
        reason = _moe_problem(cfg, layout, seq_len)
        if reason:
            return reason
    if layout.schedule in ("zb-h1", "zbv") and pp == 1:
        return f"the {layout.schedule} schedule needs pp > 1"
    if layout.schedule == "zbv":
        if layout.pipeline_layers is not None:
            return "zbv places two chunks per rank in a V: uneven stages are not modelled with it"
        if cfg.num_layers % (2 * pp):
            return f"num_layers = {cfg.num_layers} is not divisible by 2 x pp = {2 * pp} (zbv: two chunks per rank)"
    v = layout.virtual_stages
    if v > 1:
        if pp == 1:
            return "interleaving needs pp > 1"
        if cfg.num_layers % (pp * v) and layout.pipeline_layers is None:
            return f"num_layers = {cfg.num_layers} is not divisible by pp x v = {pp * v}"
        if layout.num_micro_batches(global_batch) % pp:
            m = layout.num_micro_batches(global_batch)
            return f"{m} micro-batches are not a multiple of pp = {pp} (interleaving)"
    if tp > cluster.gpus_per_node:
        return f"tp = {tp} spans nodes (more than {cluster.gpus_per_node} GPUs per node)"
    return ""


def expert_parallel_sizes(cfg, stage_ranks: int, ep=None) -> list[int]:
    """The EP sizes to try on a pipeline stage of `stage_ranks` (tp x cp x dp) ranks: `ep` if given, else those that
    divide both num_experts and `stage_ranks` (dense models: 1)."""
    if ep is not None:
        return list(ep)
    if not cfg.is_moe:
        return [1]
    return [e for e in _divisors(cfg.num_experts) if stage_ranks % e == 0]


def _moe_problem(cfg, layout: Layout, seq_len: int) -> str:
    """Why an expert-parallel layout cannot run (the rules of `check_moe_layout`, stated briefly), or ''."""
    ep, stage = layout.ep, layout.tp * layout.cp * layout.dp
    if not cfg.is_moe:
        return f"ep = {ep} needs a mixture-of-experts model"
    if stage % ep:
        return f"ep = {ep} does not divide tp x cp x dp = {stage} (the ranks of a pipeline stage)"
    if cfg.num_experts % ep:
        return f"num_experts = {cfg.num_experts} is not divisible by ep = {ep}"
    try:  # what is left: the shared experts' width and the tokens an MoE layer splits over TP
        check_moe_layout(cfg, layout.tp, layout.cp, layout.dp, ep, sequence_parallel=layout.sp,
                         micro_batch_size=layout.micro_batch_size, seq_len=seq_len)
    except TensorparError as e:
        return str(e).split(";")[0].split(": use")[0]
    return ""


def _replica_counts(cluster: Cluster, tp: int, cp: int, dp: int, zero: int, ep: int, given) -> list[int]:
    """HSDP replica counts to try for one layout (see `enumerate_layouts`)."""
    if not zero or ep > 1:
        return [1]
    if given is not None:
        return [r for r in given if dp % r == 0]
    per_node = cluster.gpus_per_node // (tp * cp)  # DP ranks on one node
    nodes = dp // per_node if per_node >= 1 and dp % per_node == 0 else 1
    return [1, nodes] if nodes > 1 else [1]


def enumerate_layouts(cfg, cluster: Cluster, global_batch: int, *, tp=None, pp=None, zero=PLANNED_ZERO_STAGES,
                      recompute=RECOMPUTE_MODES, sequence_parallel=(False, True), virtual_stages=(1,),
                      max_micro_batch: int = 64, micro_batch_sizes=None, cp=(1,), ep=None,
                      pipeline_layers: tuple[int, ...] | None = None, schedules=None,
                      uneven: bool = True, dp_replicate=None) -> list[Layout]:
    """`ep`: the expert-parallel sizes to try (None: for an MoE model every divisor of num_experts that divides
    the layout's tp x cp x dp, for a dense one 1; given sizes that do not divide are kept, infeasible).
    `pipeline_layers`: uneven stages of these layer counts (pp = their number, no interleaving); without it, a pp
    (x v) that does not divide the layers gets the most balanced uneven split (`pipeline_parallel.runner.balanced_split`:
    the first and last stages, which hold the embedding and the head, get the fewer layers - as Llama 3 did).
    `schedules`: the pipeline schedules to try with pp > 1 (None: 1f1b, and interleaved for each v > 1 of
    `virtual_stages`; "interleaved" takes its v from `virtual_stages`, "zb-h1" and "zbv" have v = 1).
    `uneven=False`: no automatic uneven split (a pp x v that does not divide the layers stays infeasible).
    `dp_replicate`: the HSDP replica counts to try with ZeRO (None: 1, and one replica per node where the DP group
    spans several nodes: sharded within a node, replicated across nodes)."""
    if pipeline_layers is not None:
        pp, virtual_stages = (len(pipeline_layers),), (1,)
    if schedules is None:
        pipes = [("1f1b" if v == 1 else "interleaved", v) for v in virtual_stages]
    else:
        pipes = ([("1f1b", 1)] if "1f1b" in schedules else [])
        pipes += [("interleaved", v) for v in virtual_stages if v > 1 and "interleaved" in schedules]
        pipes += [(sc, 1) for sc in ("zb-h1", "zbv") if sc in schedules]
    gpus = cluster.gpus
    tps = list(tp) if tp is not None else [t for t in (1, 2, 4, 8, 16, 32, 64)
                                           if t <= min(gpus, cluster.gpus_per_node) and gpus % t == 0]
    out = []
    for c in cp:
        for t in tps:
            if gpus % (t * c):
                continue
            pps = list(pp) if pp is not None else _divisors(gpus // (t * c))
            for p in pps:
                if (gpus // (t * c)) % p:
                    continue
                d = gpus // (t * c * p)
                if global_batch % d:
                    mbs_list = [1]
                elif micro_batch_sizes is not None:
                    mbs_list = [m for m in micro_batch_sizes if (global_batch // d) % m == 0]
                else:
                    mbs_list = [m for m in _divisors(global_batch // d) if m <= max_micro_batch]
                for mbs in mbs_list:
                    for sp in (sequence_parallel if t > 1 else (False,)):
                        for rc in recompute:
                            for z in (zero if d * c > 1 else (0,)):
                                for sched, v in (pipes if p > 1 else [("1f1b", 1)]):
                                    split = pipeline_layers if p > 1 else None
                                    if split is None and uneven and p > 1 and cfg.num_layers % (p * v) \
                                            and cfg.num_layers >= p * v and sched != "zbv":
                                        split = tuple(balanced_split(cfg.num_layers, p * v))
                                    for e in expert_parallel_sizes(cfg, t * c * d, ep):
                                        for r in _replica_counts(cluster, t, c, d, z, e, dp_replicate):
                                            out.append(Layout(t, p, d, sp, mbs, rc, z, v, c, e, split, sched, r))
    return out
