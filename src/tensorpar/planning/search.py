"""The layout search: every (tp, pp, dp, micro-batch, SP, recomputation, ZeRO) for a model on a cluster,
ranked by predicted throughput, with the reason each infeasible layout fails.

Enumerated:

- tp: powers of two up to the node size (TP across nodes puts every layer's collectives on the
  slow link); those that do not fit the model's heads / KV heads / FFN are kept, infeasible;
- pp: every divisor of gpus / tp (those that do not divide the layers are kept, infeasible);
- dp = gpus / (tp * pp); the global batch must divide by dp;
- micro-batch size: every divisor of global_batch / dp up to `max_micro_batch`;
- sequence parallelism off / on (on only with tp > 1; the sequence must divide by tp);
- recomputation none / selective / full; ZeRO 0 / 1 / 2 / 3 (ZeRO > 0 only with dp > 1);
- interleaved pipeline chunks v from `virtual_stages` (v > 1 only with pp > 1, the layers dividing
  by pp * v and the micro-batches by pp, as Megatron-LM requires).

Feasible layouts come first, best predicted tokens/s first (ties: less memory); then the
infeasible ones, those closest to fitting first.
"""

from __future__ import annotations

import dataclasses

from tensorpar.errors import TensorparError
from tensorpar.planning.cost import RECOMPUTE, Layout
from tensorpar.planning.hardware import GiB, Cluster
from tensorpar.planning.memory import MemoryBreakdown, check_tp, get_precision, layout_memory
from tensorpar.planning.step_time import StepTime, predict_step_time


@dataclasses.dataclass
class Plan:
    layout: Layout
    feasible: bool
    reason: str = ""
    memory: MemoryBreakdown | None = None
    time: StepTime | None = None
    excess_bytes: int = 0  # how far over the GPU's memory (infeasible for memory)

    def to_dict(self) -> dict:
        lay = self.layout
        out = {
            "tp": lay.tp, "pp": lay.pp, "dp": lay.dp, "zero": lay.zero, "sequence_parallel": lay.sp,
            "micro_batch_size": lay.micro_batch_size, "recompute": lay.recompute,
            "virtual_stages": lay.virtual_stages, "feasible": self.feasible, "reason": self.reason,
            "memory": self.memory.gib() if self.memory else None,
            "step_time_s": self.time.step_time_s if self.time else None,
            "tokens_per_s": self.time.tokens_per_s if self.time else None,
            "mfu": self.time.mfu if self.time else None,
        }
        if self.time:
            t = self.time
            out["num_micro_batches"] = t.num_micro_batches
            out["breakdown_s"] = {"compute": t.compute_s - t.recompute_s, "recompute": t.recompute_s,
                                  "tp_comm": t.tp_comm_s, "pp_comm": t.pp_comm_s, "bubble": t.bubble_s,
                                  "dp_comm": t.dp_comm_s, "optimizer": t.optimizer_s}
            out["bubble_fraction"] = t.bubble_fraction
            out["hardware_tflops_per_gpu"] = t.hardware_flops_per_gpu_s / 1e12
        return out


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def evaluate(cfg, layout: Layout, cluster: Cluster, seq_len: int, global_batch: int,
             precision="tensorpar-bf16", *, flash_attention: bool = True) -> Plan:
    """Memory and time of one layout, or why it cannot run."""
    reason = structural_problem(cfg, layout, cluster, seq_len, global_batch)
    if reason:
        return Plan(layout, False, reason)
    mem = layout_memory(cfg, layout, seq_len, global_batch, precision, flash_attention)
    time = predict_step_time(cfg, layout, cluster, seq_len, global_batch, precision)
    excess = mem.total - cluster.memory_bytes
    if excess > 0:
        return Plan(layout, False, f"exceeds memory by {excess / GiB:.1f} GiB ({mem.total / GiB:.1f} of "
                                   f"{cluster.memory_bytes / GiB:.0f} GiB, pipeline stage {mem.stage})",
                    mem, time, excess)
    return Plan(layout, True, "", mem, time)


def structural_problem(cfg, layout: Layout, cluster: Cluster, seq_len: int, global_batch: int) -> str:
    """Why this layout cannot run at all (sizes that do not divide), or ''."""
    tp, pp, dp = layout.tp, layout.pp, layout.dp
    if layout.world != cluster.gpus:
        return f"tp x pp x dp = {layout.world} is not the {cluster.gpus} GPUs"
    try:
        check_tp(cfg, tp)
    except TensorparError as e:
        return str(e).split(";")[0]
    if cfg.num_layers % pp:
        return f"num_layers = {cfg.num_layers} is not divisible by pp = {pp}"
    if global_batch % dp:
        return f"global batch {global_batch} is not divisible by dp = {dp}"
    if (global_batch // dp) % layout.micro_batch_size:
        return f"micro-batch {layout.micro_batch_size} does not divide the {global_batch // dp} sequences per replica"
    if layout.sp and seq_len % tp:
        return f"sequence length {seq_len} is not divisible by tp = {tp} (sequence parallelism)"
    if layout.zero and dp == 1:
        return "ZeRO needs dp > 1"
    v = layout.virtual_stages
    if v > 1:
        if pp == 1:
            return "interleaving needs pp > 1"
        if cfg.num_layers % (pp * v):
            return f"num_layers = {cfg.num_layers} is not divisible by pp x v = {pp * v}"
        if layout.num_micro_batches(global_batch) % pp:
            m = layout.num_micro_batches(global_batch)
            return f"{m} micro-batches are not a multiple of pp = {pp} (interleaving)"
    if tp > cluster.gpus_per_node:
        return f"tp = {tp} spans nodes (more than {cluster.gpus_per_node} GPUs per node)"
    return ""


def enumerate_layouts(cfg, cluster: Cluster, global_batch: int, *, tp=None, pp=None, zero=(0, 1, 2, 3),
                      recompute=RECOMPUTE, sequence_parallel=(False, True), virtual_stages=(1,),
                      max_micro_batch: int = 64, micro_batch_sizes=None) -> list[Layout]:
    gpus = cluster.gpus
    tps = list(tp) if tp is not None else [t for t in (1, 2, 4, 8, 16, 32, 64)
                                           if t <= min(gpus, cluster.gpus_per_node) and gpus % t == 0]
    out = []
    for t in tps:
        if gpus % t:
            continue
        pps = list(pp) if pp is not None else _divisors(gpus // t)
        for p in pps:
            if (gpus // t) % p:
                continue
            d = gpus // (t * p)
            if global_batch % d:
                mbs_list = [1]
            elif micro_batch_sizes is not None:
                mbs_list = [m for m in micro_batch_sizes if (global_batch // d) % m == 0]
            else:
                mbs_list = [m for m in _divisors(global_batch // d) if m <= max_micro_batch]
            for mbs in mbs_list:
                for sp in (sequence_parallel if t > 1 else (False,)):
                    for rc in recompute:
                        for z in (zero if d > 1 else (0,)):
                            for v in (virtual_stages if p > 1 else (1,)):
                                out.append(Layout(t, p, d, sp, mbs, rc, z, v))
    return out


def search(cfg, cluster: Cluster, seq_len: int, global_batch: int, precision="tensorpar-bf16", *,
           flash_attention: bool = True, **space) -> list[Plan]:
    """Every layout of the search space (keywords of `enumerate_layouts`), ranked best first."""
    get_precision(precision)
    if cfg.position == "learned" and seq_len > cfg.max_seq_len:
        raise TensorparError(f"sequence length {seq_len} exceeds the model's {cfg.max_seq_len} learned positions")
    if seq_len < 1 or global_batch < 1:
        raise TensorparError("the sequence length and the global batch size must be positive")
    plans = [evaluate(cfg, lay, cluster, seq_len, global_batch, precision, flash_attention=flash_attention)
             for lay in enumerate_layouts(cfg, cluster, global_batch, **space)]
    return rank(plans)


def rank(plans: list[Plan]) -> list[Plan]:
    feasible = sorted((p for p in plans if p.feasible),
                      key=lambda p: (-round(p.time.tokens_per_s, 6), p.memory.total, p.layout.zero, p.layout.tp,
                                     p.layout.pp, p.layout.sp))
    memory = sorted((p for p in plans if not p.feasible and p.memory is not None), key=lambda p: p.excess_bytes)
    other = [p for p in plans if not p.feasible and p.memory is None]
    return feasible + memory + other


def best_by_mesh(plans: list[Plan]) -> dict[tuple[int, int], Plan]:
    """The best feasible plan for each (tp, pp): the Playbook's heatmap."""
    out: dict[tuple[int, int], Plan] = {}
    for p in plans:
        if p.feasible:
            key = (p.layout.tp, p.layout.pp)
            if key not in out or p.time.tokens_per_s > out[key].time.tokens_per_s:
                out[key] = p
    return out


def find(plans: list[Plan], **fields) -> tuple[int, Plan] | None:
    """(0-based rank, plan) of the first plan whose layout has these field values."""
    for i, p in enumerate(plans):
        if all(getattr(p.layout, k) == v for k, v in fields.items()):
            return i, p
    return None
