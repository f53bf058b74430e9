"""Step time: compute at the achievable fraction of peak, plus what communication and the pipeline expose.

Per micro-batch and pipeline stage (all FLOPs divided evenly over the stage's TP ranks):

- compute: the stage's training and recomputation FLOPs (`tensorpar.planning.compute`) at
  peak x ``mfu_ceiling``.
- TP/SP communication: every collective of `comm.model_collectives` on the TP group, timed with
  the alpha-beta model (the faster of ring and tree) on NVLink if the TP group fits in a node,
  and not overlapped: it sits on the critical path (the Playbook's point about TP).
- PP: the point-to-point sends of the stage, also exposed.
- EP (mixture-of-experts models): the all-to-alls of every MoE layer (dispatch and combine, forward and
  backward, `communication.moe_collectives`) on the EP group's link, exposed: each waits for the router
  before it and the experts wait for it. The compute counts a token's active parameters only (its top-k
  experts, the router and the shared experts), with routing assumed balanced.

The pipeline runs m micro-batches through p stages: ``(m + (p - 1)/v) * t_stage`` with
t_stage the slowest stage's per-micro-batch time, i.e. a bubble of (p-1)/(m+p-1) of the step
(interleaved with v chunks: (p-1)/(v m + p - 1)). Data-parallel traffic (`comm.step_collectives`
on the DP group) overlaps with backward compute: at most ``overlap`` of it hides, and never more
than the backward time it can hide behind (the last micro-batch's backward for gradient
buckets; every micro-batch's forward and backward for ZeRO-3's gathers); the parameter
all-gather after a ZeRO-1/2 optimizer step is exposed. The optimizer step itself is memory-bound:
about 28 bytes of HBM traffic per (local) optimizer element.

Memory levers (`levers`, `tensorpar.planning.offload_time`): --optimizer-offload steps on the host instead (the
gradients out, AdamW at the host's bandwidth, the masters back); --activation-offload adds, per micro-batch and
stage, what its copies to and from host memory do not hide behind the forward and the backward. bf16 moments
are timed as fp32 ones: the lent H200 measured them 6% slower, not faster (their casts).

LoRA (`lora`): the frozen base computes no weight gradients (its backward is its input gradients, about one
forward), the adapters add their r-wide GEMMs (`tensorpar.planning.lora_adapters.adapter_gemms`: forward, input and weight
gradient), the optimizer steps the adapters alone, and MFU counts the FLOPs such a step needs (the model's less
the base's weight gradients); the data-parallel traffic reduces the adapters' gradients alone (ZeRO-3 still gathers
the frozen base: `comm.step_collectives`); the TP collectives are the adapters' own (r / h of the base's) and the
frozen base's less its parameters' gradients (`tensorpar.planning.lora_traffic`).

Outputs: step time, tokens/s (the whole cluster), MFU (model FLOPs of `models.flops`, no
recomputation, over step time x GPUs x peak), and the achieved hardware FLOP/s per GPU
counting recomputation (the figure Megatron-LM's papers report).
"""

from __future__ import annotations

import dataclasses

from tensorpar.config.memory_levers import MemoryLevers
from tensorpar.models.flops import train_flops_per_token
from tensorpar.planning.collective_cost import collectives_time
from tensorpar.planning.communication import model_collectives, step_collectives
from tensorpar.planning.compute import flop_parts, stage_flops
from tensorpar.planning.devices import optimizer_bytes_per_element
from tensorpar.planning.kernels import gemms_time, optimizer_time, stage_compute_time
from tensorpar.planning.lora_adapters import adapter_gemms
from tensorpar.planning.memory import moved_activation_bytes
from tensorpar.planning.offload_time import activation_copy_time, offloaded_optimizer_time
from tensorpar.planning.candidates import Candidate, candidate_stages, stage_layers
from tensorpar.planning.params import layout_summary
from tensorpar.planning.precision_recipes import Precision, get_precision
from tensorpar.tensor_parallel.lora import LoraSpec
from tensorpar.tensor_parallel.tp_overlap import DEFAULT_CHUNKS, sp_pieces



@dataclasses.dataclass
class StepTime:
    step_time_s: float
    compute_s: float  # the whole step's compute on the slowest stage (m micro-batches), recomputation included
    recompute_s: float
    tp_comm_s: float
    pp_comm_s: float
    cp_comm_s: float  # the context-parallel ring, where it is longer than the attention it overlaps
    bubble_s: float
    dp_comm_s: float  # exposed data-parallel / ZeRO communication
    optimizer_s: float
    num_micro_batches: int
    bubble_fraction: float
    tokens_per_s: float
    mfu: float
    model_flops: float  # per step, the whole model (models.flops accounting)
    hardware_flops_per_gpu_s: float  # achieved, recomputation included
    ep_comm_s: float = 0.0  # the expert-parallel all-to-alls (MoE), exposed
    offload_s: float = 0.0  # --activation-offload: the copies to and from host memory that compute does not hide

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _lora_compute(cfg, layout, cluster, b, s, stage, prec, lora, wgrad: float) -> tuple[float, float, float]:
    """(forward, backward, weight gradients) seconds LoRA changes one micro-batch's by on one rank of `stage`: less
    the base's weight gradients (`wgrad`), plus the adapters' GEMMs."""
    n = stage_layers(cfg, layout, stage)[2]
    f, dg, wg = gemms_time(adapter_gemms(cfg, layout.tp, b * s // layout.cp, lora), cluster, prec.compute_dtype,
                           prec.matmul_bytes)
    return n * f, n * (dg + wg) - wgrad, n * wg - wgrad


def _stage_time(cfg, layout, cluster, b, s, stage, prec, algorithm, flash=True, lora: LoraSpec | None = None):
    """(forward, backward, weight-gradient part of backward, recompute, tp comm, pp comm, exposed cp ring, ep
    all-to-alls) seconds of one micro-batch on one stage. Compute: every kernel timed on the device
    (`kernels.stage_compute_time`), or with a flat ``cluster.mfu_ceiling`` all FLOPs at that fraction of peak,
    shared by the stage's tp x cp ranks. The context-parallel ring hides behind the attention it feeds; what is
    longer than that attention is exposed. TP collectives are exposed but for ``cluster.tp_overlap``, the
    interleaved schedule's sends but for ``cluster.pp_overlap``."""
    ranks = layout.tp * layout.cp
    if cluster.mfu_ceiling is not None:
        rate = cluster.peak(prec.compute_dtype) * cluster.mfu_ceiling
        train, recompute = stage_flops(cfg, layout, b, s, stage, prec)
        train, recompute = train / ranks / rate, recompute / ranks / rate
        attention = 3.0 * stage_layers(cfg, layout, stage)[2] * 4.0 * b * s * s * cfg.hidden_size / ranks / rate
        fwd, bwd, wgrad = train / 3.0, train * 2.0 / 3.0, train / 3.0
        if lora is not None:  # the base's weight gradients: its matmuls' forward FLOPs once more
            first, last, n = stage_layers(cfg, layout, stage)
            layer_p, head_p = flop_parts(cfg)
            wgrad = 2.0 * b * s * (n * layer_p + (head_p if last else 0.0)) / ranks / rate
    else:
        fwd, bwd, wgrad, recompute, attention = stage_compute_time(cfg, layout, b, s, stage, prec, cluster, flash)
    if lora is not None:
        df, db, dw = _lora_compute(cfg, layout, cluster, b, s, stage, prec, lora, wgrad)
        fwd, bwd, wgrad = fwd + df, bwd + db, wgrad + dw
    # tensorpar trains with its TP overlap on, whose chunked collectives pay the latency once per piece (the
    # counts tp_overlap's code uses: under SP `sp_pieces`, else the row product's DEFAULT_CHUNKS row blocks); the
    # zero-bubble schedules' split backward turns it off
    if prec.activations != "tensorpar" or layout.schedule in ("zb-h1", "zbv"):
        pieces = 1
    elif layout.sequence_parallel:
        pieces = sp_pieces(b, s // layout.cp // layout.tp)
    else:
        pieces = min(DEFAULT_CHUNKS, b * s // layout.cp)
    colls = model_collectives(cfg, layout, b, s, act_bytes=prec.act_bytes, matmul_bytes=prec.matmul_bytes,
                              grad_bytes=prec.grad_bytes, stage=stage if layout.pp > 1 else None,
                              scatter_gather=prec.activations == "playbook",
                              tp_pieces=1 if prec.fp8_recipe else pieces,  # fp8 GEMMs: plain TP collectives
                              fp8_recipe=prec.fp8_recipe, lora=lora)
    tp = [c for c in colls if c.group == "tp"]
    sends = [c for c in colls if c.group == "pp" and c.op == "send"]
    ring = collectives_time([c for c in colls if c.group == "cp" and c.op == "send"], cluster, layout, algorithm)
    ep = collectives_time([c for c in colls if c.group == "ep"], cluster, layout, algorithm)
    tp_time = collectives_time(tp, cluster, layout, algorithm) * (1.0 - cluster.tp_overlap)
    pp_time = collectives_time(sends, cluster, layout, algorithm) * (2 if layout.schedule == "zbv" else 1)
    if layout.virtual_stages > 1:
        pp_time *= 1.0 - cluster.pp_overlap
    return StageTime(fwd, bwd, wgrad, recompute, tp_time, pp_time,
                     max(0.0, ring - attention), ep)


@dataclasses.dataclass(frozen=True)
class StageTime:
    """Seconds of one micro-batch on one rank of a stage (backward includes its weight-gradient part)."""

    forward: float
    backward: float
    wgrad: float
    recompute: float
    tp: float
    pp: float
    cp: float
    ep: float
    offload: float = 0.0  # --activation-offload: its exposed copies

    @property
    def total(self) -> float:
        return self.forward + self.backward + self.recompute + self.tp + self.pp + self.cp + self.ep + self.offload


def pipeline_bubble(layout: Candidate, st: StageTime) -> float:
    """Seconds the pipeline's fill and drain leave idle, from each schedule's published bubble: 1F1B (p - 1) x
    the stage time, interleaved (p - 1) / v of it (Narayanan et al. 2021); ZB-H1 (p - 1)(T_F + T_B - T_W) and
    ZB-V (p - 1)(T_F + T_B - 2 T_W) / 2 (each rank holds two half-size chunks) with T_W the weight-gradient part
    of the backward, T_B the rest (recomputation included) and T_F the forward (Qi et al. 2024, "Zero Bubble
    Pipeline Parallelism" and "Pipeline Parallelism with Controllable Memory"); communication counts with the
    forward and backward it belongs to."""
    p = layout.pp
    if p == 1:
        return 0.0
    comm = st.tp + st.pp + st.cp + st.ep + st.offload
    t_f = st.forward + comm / 3.0
    t_w = st.wgrad
    t_b = st.backward - st.wgrad + st.recompute + comm * 2.0 / 3.0
    if layout.schedule == "zb-h1":
        return (p - 1) * max(t_f + t_b - t_w, 0.0)
    if layout.schedule == "zbv":
        return (p - 1) * max(t_f + t_b - 2.0 * t_w, 0.0) / 2.0
    return (p - 1) / layout.virtual_stages * st.total


def lora_model_flops(cfg, tokens: int, lora: LoraSpec | None) -> float:
    """The base's weight-gradient FLOPs a LoRA step skips (0 without LoRA): its matmuls' forward once more."""
    if lora is None:
        return 0.0
    layer_p, head_p = flop_parts(cfg)
    return 2.0 * tokens * (cfg.num_blocks * layer_p + head_p)


def _busiest_dp_stage(cfg, layout: Candidate) -> int:
    """The pipeline stage with the most parameters to reduce and update (stage 0 when the stages are even)."""
    if layout.pipeline_layers is None:
        return 0
    def numel(st):
        return layout_summary(cfg, layout, st).numel

    return max(candidate_stages(cfg, layout), key=numel)


def predict_step_time(cfg, layout: Candidate, cluster, seq_len: int, global_batch: int,
                      precision: Precision | str = "tensorpar-bf16", *, algorithm: str = "best",
                      flash: bool = True, lora: LoraSpec | None = None,
                      levers: MemoryLevers = MemoryLevers()) -> StepTime:
    """The step time of `layout` (`lora`: LoRA fine-tuning, the base frozen; `levers`: the memory levers; see the
    module docstring)."""
    prec = get_precision(precision)
    b, s = layout.micro_batch_size, seq_len
    m = max(layout.num_micro_batches(global_batch), 1)
    pp = layout.pp
    stages = candidate_stages(cfg, layout) if pp > 1 else [None]
    per_stage = {st: _stage_time(cfg, layout, cluster, b, s, st, prec, algorithm, flash, lora) for st in stages}
    if levers.activation_offload:
        per_stage = {st: _with_offload(cfg, layout, cluster, s, st, t, precision, flash, levers, lora)
                     for st, t in per_stage.items()}
    slowest = max(per_stage, key=lambda st: per_stage[st].total)
    st_time = per_stage[slowest]
    comp, recomp = st_time.forward + st_time.backward, st_time.recompute
    bubble = pipeline_bubble(layout, st_time)
    pipeline = m * st_time.total + bubble
    dp_stage = _busiest_dp_stage(cfg, layout) if pp > 1 else None
    dp_exposed = _exposed_dp_time(cfg, layout, cluster, s, m, prec, algorithm, dp_stage, st_time, lora)
    optimizer = _optimizer_step_time(cfg, layout, cluster, dp_stage, lora,
                                     prec.param_bytes if levers.optimizer_offload else 0, levers.state_bytes)

    step = pipeline + dp_exposed + optimizer
    tokens = global_batch * seq_len
    model_flops = train_flops_per_token(cfg, seq_len) * tokens - lora_model_flops(cfg, tokens, lora)
    total_recompute = _recompute_flops(cfg, layout, b, s, m, prec)
    peak = cluster.peak(prec.compute_dtype)
    gpus = layout.world
    return StepTime(
        step_time_s=step,
        compute_s=m * comp + m * recomp,
        recompute_s=m * recomp,
        tp_comm_s=m * st_time.tp,
        pp_comm_s=m * st_time.pp,
        cp_comm_s=m * st_time.cp,
        bubble_s=bubble,
        dp_comm_s=dp_exposed,
        optimizer_s=optimizer,
        num_micro_batches=m,
        bubble_fraction=bubble / pipeline if pipeline else 0.0,
        tokens_per_s=tokens / step,
        mfu=model_flops / (step * gpus * peak),
        model_flops=model_flops,
        hardware_flops_per_gpu_s=(model_flops + total_recompute) / (step * gpus),
        ep_comm_s=m * st_time.ep,
        offload_s=m * st_time.offload,
    )


def _with_offload(cfg, layout: Candidate, cluster, s: int, stage: int | None, st: StageTime, precision, flash: bool,
                  levers: MemoryLevers, lora: LoraSpec | None) -> StageTime:
    """`st` with what its activations' copies to and from host memory leave exposed (`offload_time`)."""
    moved, layers = moved_activation_bytes(cfg, layout, s, precision, stage or 0, flash, levers, lora)
    exposed = activation_copy_time(moved, levers.offloaded_layers(layers), layers, st.forward,
                                   st.backward + st.recompute, cluster)
    return dataclasses.replace(st, offload=exposed)


def _exposed_dp_time(cfg, layout: Candidate, cluster, s: int, m: int, prec: Precision, algorithm: str,
                     dp_stage: int | None, st_time: StageTime, lora: LoraSpec | None = None) -> float:
    """Seconds of stage `dp_stage`'s data-parallel traffic that compute does not hide: of the per-micro-batch
    collectives (ZeRO-3 gathers, ZeRO-2 reduce-scatters) and of the step's gradient reductions, what exceeds
    ``cluster.overlap`` of them or the compute they can hide behind; the step's other collectives entirely."""
    colls = step_collectives(cfg, layout, s, m, act_bytes=prec.act_bytes, matmul_bytes=prec.matmul_bytes,
                             grad_bytes=prec.grad_bytes, param_bytes=prec.gather_bytes, stage=dp_stage,
                             zero2_per_micro_batch=not prec.zero2_full_grads_at_peak, fp8_recipe=prec.fp8_recipe,
                             lora=lora)
    replica_groups = ("dp", "dp_cp", "edp", "dp_shard", "dp_replicate")
    dp_colls = [c for c in colls if c.group in replica_groups + ("embed",)
                or (c.phase == "step" and c.group not in replica_groups)]
    comp, recomp = st_time.forward + st_time.backward, st_time.recompute
    backward = st_time.backward + recomp  # one micro-batch's backward (and recomputation)
    dp_exposed = 0.0
    per_mb = [c for c in dp_colls if c.phase in ("forward", "backward")]  # ZeRO-3 gathers, ZeRO-2 per micro-batch
    after = [c for c in dp_colls if c.phase == "step"]
    if per_mb:
        t = collectives_time(per_mb, cluster, layout, algorithm)
        window = m * (comp + recomp) if any(c.phase == "forward" for c in per_mb) else m * backward
        dp_exposed += t - min(t * cluster.overlap, window)
    is_grad = [c.op in ("all_reduce", "reduce_scatter") and c.group in replica_groups and c.nbytes > 4 for c in after]
    grads = [c for c, g in zip(after, is_grad) if g]
    rest = [c for c, g in zip(after, is_grad) if not g]
    t = collectives_time(grads, cluster, layout, algorithm)
    dp_exposed += t - min(t * cluster.overlap, backward)
    dp_exposed += collectives_time(rest, cluster, layout, algorithm)
    return dp_exposed


def _optimizer_step_time(cfg, layout: Candidate, cluster, dp_stage: int | None, lora: LoraSpec | None = None,
                         offloaded_param_bytes: int = 0, state_bytes: int = 4) -> float:
    """Seconds of the optimizer step on one rank of `dp_stage`: its trained elements, 1/replicas of them under ZeRO
    (routed experts' 1/expert-DP), at `optimizer_bytes_per_element` (moments of `state_bytes`) of HBM traffic each;
    offloaded (--optimizer-offload, parameters of `offloaded_param_bytes`): on the host, with the copies there and
    back."""
    summary = layout_summary(cfg, layout, dp_stage or 0, lora)
    dense, expert = summary.trained_numel - summary.trained_expert_numel, summary.trained_expert_numel
    sharded = layout.zero >= 1 and layout.shards > 1
    opt_elems = dense / layout.shards + expert / layout.expert_dp if sharded else dense + expert
    if offloaded_param_bytes:
        return offloaded_optimizer_time(opt_elems, cluster, optimizer_bytes_per_element(state_bytes),
                                        offloaded_param_bytes)
    return optimizer_time(opt_elems, cluster, optimizer_bytes_per_element(state_bytes))


def _recompute_flops(cfg, layout: Candidate, b: int, s: int, m: int, prec: Precision) -> float:
    """The whole cluster's recomputation FLOPs in one step: every stage's, m micro-batches, dp replicas."""
    pp = layout.pp
    # The head is never recomputed: the stages' recomputation (pp x one stage's when they hold as many layers).
    if layout.pipeline_layers is not None and pp > 1 and layout.recompute != "none":
        return sum(stage_flops(cfg, layout, b, s, st, prec)[1] for st in range(pp)) * m * layout.dp
    return pp * stage_flops(cfg, layout, b, s, 0 if pp > 1 else None, prec)[1] * m * layout.dp
