"""The layout search: every candidate of `tensorpar.planning.candidates.enumerate_candidates` for a model on a
cluster, ranked by predicted throughput, with the reason each infeasible candidate fails.

Feasible layouts come first, best predicted tokens/s first (ties: less memory); then the
infeasible ones, those closest to fitting first.
"""

from __future__ import annotations

import dataclasses

from tensorpar.config.hardware import GiB
from tensorpar.config.memory_levers import MemoryLevers
from tensorpar.errors import TensorparError
from tensorpar.planning.cluster import Cluster
from tensorpar.planning.candidates import Candidate, candidate_problem, enumerate_candidates
from tensorpar.planning.latent import kv_cache_bytes
from tensorpar.planning.lora_adapters import check_lora
from tensorpar.planning.memory import MemoryBreakdown, layout_memory
from tensorpar.planning.offload_fit import fewest_offloaded_layers
from tensorpar.planning.precision_recipes import get_precision
from tensorpar.planning.step_time import StepTime, predict_step_time
from tensorpar.tensor_parallel.lora import LoraSpec


@dataclasses.dataclass
class Plan:
    candidate: Candidate
    feasible: bool
    reason: str = ""
    memory: MemoryBreakdown | None = None
    time: StepTime | None = None
    excess_bytes: int = 0  # how far over the GPU's memory (infeasible for memory)
    kv_cache_bytes_per_token: int = 0  # one token's bf16 KV cache on one rank, all layers (for serving at this tp)
    lora: LoraSpec | None = None  # LoRA fine-tuning: the adapters planned, the base frozen
    levers: MemoryLevers | None = None  # this layout's own memory levers (--activation-offload-fit), else None

    @property
    def offloaded_layers(self) -> int | None:
        """Under --activation-offload-fit, the layers whose saved tensors this layout moves (0: none; None: every
        layer, the plain --activation-offload)."""
        if self.levers is None or not self.levers.activation_offload:
            return 0
        return self.levers.activation_offload_layers

    def to_dict(self) -> dict:
        cand, lay = self.candidate, self.candidate.layout
        out = {
            "tp": lay.tp, "cp": lay.cp, "ep": lay.ep, "pp": lay.pp, "dp": lay.dp, "zero": lay.zero,
            "dp_replicate": lay.dp_replicate, "sequence_parallel": lay.sequence_parallel,
            "micro_batch_size": cand.micro_batch_size, "recompute": cand.recompute,
            "virtual_stages": lay.virtual_stages, "chunks_per_rank": lay.chunks, "schedule": lay.schedule,
            "pipeline_layers": list(lay.pipeline_layers) if lay.pipeline_layers is not None else None,
            "feasible": self.feasible, "reason": self.reason,
            "memory": self.memory.gib() if self.memory else None,
            "host_memory": self.memory.host_gib() if self.memory else None,
            "step_time_s": self.time.step_time_s if self.time else None,
            "tokens_per_s": self.time.tokens_per_s if self.time else None,
            "mfu": self.time.mfu if self.time else None,
            "kv_cache_bytes_per_token": self.kv_cache_bytes_per_token,
            "lora": self.lora.as_dict() if self.lora is not None else None,
        }
        if self.levers is not None:
            out["activation_offload_layers"] = self.offloaded_layers
        if self.time:
            t = self.time
            out["num_micro_batches"] = t.num_micro_batches
            out["breakdown_s"] = {"compute": t.compute_s - t.recompute_s, "recompute": t.recompute_s,
                                  "tp_comm": t.tp_comm_s, "pp_comm": t.pp_comm_s, "cp_comm": t.cp_comm_s,
                                  "ep_comm": t.ep_comm_s, "bubble": t.bubble_s,
                                  "dp_comm": t.dp_comm_s, "optimizer": t.optimizer_s, "offload": t.offload_s}
            out["bubble_fraction"] = t.bubble_fraction
            out["hardware_tflops_per_gpu"] = t.hardware_flops_per_gpu_s / 1e12
        return out


def evaluate(cfg, layout: Candidate, cluster: Cluster, seq_len: int, global_batch: int,
             precision="tensorpar-bf16", *, flash_attention: bool = True, levers: MemoryLevers = MemoryLevers(),
             lora: LoraSpec | None = None, fit_offload: bool = False) -> Plan:
    """Memory and time of one candidate (with the memory `levers`; `lora`: LoRA fine-tuning; `fit_offload`: with
    the fewest layers' activations offloaded that make it fit, `offload_fit`), or why it cannot run."""
    if fit_offload:
        return _evaluate_fitting(cfg, layout, cluster, seq_len, global_batch, precision, flash_attention, levers, lora)
    reason = candidate_problem(cfg, layout, cluster, seq_len, global_batch,
                               fp8=bool(get_precision(precision).fp8_recipe))
    reason = reason or next(iter(levers.problems(recompute=layout.recompute)), "")
    if reason:
        return Plan(layout, False, reason, lora=lora)
    mem = layout_memory(cfg, layout, seq_len, global_batch, precision, flash_attention, levers, lora)
    excess = mem.total - cluster.memory_bytes
    kv = kv_cache_bytes(cfg, layout.tp)
    host = mem.host_optimizer + mem.host_activations
    if host > cluster.host_memory_bytes and excess <= 0:
        return Plan(layout, False, f"exceeds host memory by {(host - cluster.host_memory_bytes) / GiB:.1f} GiB per GPU "
                                   f"({host / GiB:.1f} of {cluster.host_memory_bytes / GiB:.0f} GiB offloaded)",
                    mem, None, host - cluster.host_memory_bytes, kv, lora)
    if excess > 0:  # no step time for a layout that cannot run (the search is then ~3x faster at scale)
        return Plan(layout, False, f"exceeds memory by {excess / GiB:.1f} GiB ({mem.total / GiB:.1f} of "
                                   f"{cluster.memory_bytes / GiB:.0f} GiB, pipeline stage {mem.stage})",
                    mem, None, excess, kv, lora)
    time = predict_step_time(cfg, layout, cluster, seq_len, global_batch, precision, flash=flash_attention, lora=lora,
                             levers=levers)
    return Plan(layout, True, "", mem, time, kv_cache_bytes_per_token=kv, lora=lora)


def _evaluate_fitting(cfg, layout: Candidate, cluster: Cluster, seq_len: int, global_batch: int, precision,
                      flash_attention: bool, levers: MemoryLevers, lora: LoraSpec | None) -> Plan:
    """`evaluate` with this layout's own activation offload: none where it fits the GPU without (or cannot run for
    another reason, or recomputes fully, which leaves nothing to move), else the fewest layers that fit."""
    kept = dataclasses.replace(levers, activation_offload=False, activation_offload_layers=None)
    plan = evaluate(cfg, layout, cluster, seq_len, global_batch, precision, flash_attention=flash_attention,
                    levers=kept, lora=lora)
    if plan.feasible or not plan.reason.startswith("exceeds memory") or layout.recompute == "full":
        return dataclasses.replace(plan, levers=kept)
    moved = fewest_offloaded_layers(cfg, layout, cluster, seq_len, global_batch, precision, flash_attention, levers,
                                    lora)
    plan = evaluate(cfg, layout, cluster, seq_len, global_batch, precision, flash_attention=flash_attention,
                    levers=moved, lora=lora)
    return dataclasses.replace(plan, levers=moved)


def search(cfg, cluster: Cluster, seq_len: int, global_batch: int, precision="tensorpar-bf16", *,
           flash_attention: bool = True, levers: MemoryLevers = MemoryLevers(), lora: LoraSpec | None = None,
           fit_offload: bool = False, **space) -> list[Plan]:
    """Every candidate of the search space (keywords of `enumerate_candidates`), ranked best first; the memory
    `levers` on every candidate (`fit_offload`: each with the fewest layers' activations offloaded that make it
    fit); `lora`: LoRA fine-tuning (a model the adapters do not fit is refused, as train refuses it)."""
    check_lora(cfg, lora, get_precision(precision))
    if cfg.position == "learned" and seq_len > cfg.max_seq_len:
        raise TensorparError(f"sequence length {seq_len} exceeds the model's {cfg.max_seq_len} learned positions")
    if seq_len < 1 or global_batch < 1:
        raise TensorparError("the sequence length and the global batch size must be positive")
    plans = [evaluate(cfg, lay, cluster, seq_len, global_batch, precision, flash_attention=flash_attention,
                      levers=levers, lora=lora, fit_offload=fit_offload)
             for lay in enumerate_candidates(cfg, cluster, global_batch, **space)]
    return rank(plans)


def rank(plans: list[Plan]) -> list[Plan]:
    feasible = sorted((p for p in plans if p.feasible),
                      key=lambda p: (-round(p.time.tokens_per_s, 6), p.memory.total, p.candidate.zero, p.candidate.tp,
                                     p.candidate.pp, p.candidate.sequence_parallel))
    memory = sorted((p for p in plans if not p.feasible and p.memory is not None), key=lambda p: p.excess_bytes)
    other = [p for p in plans if not p.feasible and p.memory is None]
    return feasible + memory + other


def best_by_mesh(plans: list[Plan]) -> dict[tuple[int, int], Plan]:
    """The best feasible plan for each (tp, pp): the Playbook's heatmap."""
    out: dict[tuple[int, int], Plan] = {}
    for p in plans:
        if p.feasible:
            key = (p.candidate.tp, p.candidate.pp)
            if key not in out or p.time.tokens_per_s > out[key].time.tokens_per_s:
                out[key] = p
    return out


def find(plans: list[Plan], **fields) -> tuple[int, Plan] | None:
    """(0-based rank, plan) of the first plan whose candidate has these field values."""
    for i, p in enumerate(plans):
        if all(p.candidate.as_dict()[k] == v for k, v in fields.items()):
            return i, p
    return None
