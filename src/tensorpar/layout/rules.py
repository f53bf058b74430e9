"""Every rule a parallel layout must satisfy, in one place: `layout_problems` says why a `ParallelLayout` cannot
run a model at a sequence length and batch, in the order a user should fix them. The trainer, eval, generate and
the dry run raise the first problem as their one-line error; the planner records its reason for an infeasible
candidate. The layers check their own shapes when they are built with the same functions (`kv_heads_per_rank`,
`experts_per_rank`, ...), a second line of defence for code that builds them directly.

A layout is duck-typed here (`tensorpar.layout.parallel_layout.ParallelLayout`, which imports this module), and a
model config is anything with ModelConfig's fields.
"""

from __future__ import annotations

import os

from tensorpar.errors import TensorparError
from tensorpar.layout.problem import Problem, divisibility, require
from tensorpar.layout.stages import schedule_problem


def kv_problem(num_kv_heads: int, tp: int) -> Problem | None:
    """Why `num_kv_heads` KV heads cannot be laid on `tp` ranks (split when there are at least as many heads as
    ranks, else each head replicated on tp / num_kv_heads ranks), or None."""
    if num_kv_heads >= tp:
        return divisibility(num_kv_heads, tp, "num_kv_heads")
    if tp % num_kv_heads:
        return Problem(f"num_kv_heads = {num_kv_heads} and the tensor-parallel size {tp} do not fit: with fewer KV "
                       f"heads than ranks, TP must be a multiple of num_kv_heads")
    return None


def kv_heads_per_rank(num_kv_heads: int, tp: int) -> tuple[int, int]:
    """(KV heads per rank, ranks sharing each KV head) for this TP size."""
    require(kv_problem(num_kv_heads, tp))
    return (num_kv_heads // tp, 1) if num_kv_heads >= tp else (1, tp // num_kv_heads)


def experts_problem(num_experts: int, ep: int) -> Problem | None:
    if num_experts % ep == 0:
        return None
    valid = [d for d in range(1, num_experts + 1) if num_experts % d == 0]
    return Problem(f"num_experts = {num_experts} is not divisible by the expert-parallel size {ep}",
                   f"each EP rank holds num_experts / ep experts; EP sizes that divide it: {valid}")


def experts_per_rank(num_experts: int, ep: int) -> int:
    """num_experts / ep, or a LayoutError naming the EP sizes that divide num_experts."""
    require(experts_problem(num_experts, ep))
    return num_experts // ep


def expert_width_problem(expert_ffn_size: int, expert_tp: int) -> Problem | None:
    return divisibility(expert_ffn_size, expert_tp, "expert_ffn_size", "expert-TP", "expert-TP")


def expert_width_per_rank(expert_ffn_size: int, expert_tp: int) -> int:
    """expert_ffn_size / expert_tp (each expert-TP rank's slice of every expert's width), or a LayoutError."""
    require(expert_width_problem(expert_ffn_size, expert_tp))
    return expert_ffn_size // expert_tp


def context_split_problem(seq_len: int, cp: int) -> Problem | None:
    """Why a sequence of `seq_len` cannot be cut into the 2 x cp equal chunks context parallelism deals, or None."""
    if cp > 1 and seq_len % (2 * cp):
        return Problem(f"sequence length {seq_len} is not divisible by 2 x cp = {2 * cp}",
                       f"context parallelism cuts the sequence into 2 x cp equal chunks (zigzag); use a multiple of "
                       f"{2 * cp} (not padded: padding would train on tokens you did not give)")
    return None


def fold_problem(tp: int, cp: int, dp: int, ep: int, expert_tp: int = 1, num_experts: int | None = None,
                 expert_ffn_size: int | None = None) -> Problem | None:
    """Why ep x expert-TP does not fold onto the tp x cp x dp ranks of a pipeline stage, or None. With the model's
    `num_experts` (`expert_ffn_size`) the sizes offered instead are only those that also divide it."""
    stage = tp * cp * dp
    if stage % ep:
        valid = [d for d in range(1, stage + 1) if stage % d == 0 and (num_experts is None or num_experts % d == 0)]
        return Problem(f"ep={ep} does not fold onto the {stage} ranks of a pipeline stage (tp={tp} x cp={cp} x "
                       f"dp={dp}): it does not divide tp x cp x dp = {stage}",
                       f"expert parallelism regroups those ranks, so ep must divide {stage}; valid: {valid}")
    if stage % (ep * expert_tp):
        valid = [d for d in range(1, stage // ep + 1)
                 if (stage // ep) % d == 0 and (expert_ffn_size is None or expert_ffn_size % d == 0)]
        return Problem(f"expert_tp={expert_tp} x ep={ep} = {ep * expert_tp} does not fold onto the {stage} ranks of "
                       f"a pipeline stage (tp={tp} x cp={cp} x dp={dp})",
                       f"expert-TP x EP must divide {stage}; valid --expert-tp at ep={ep}: {valid}")
    return None


def hsdp_problem(dp: int, dp_replicate: int, ep: int) -> Problem | None:
    """Why HSDP's `dp_replicate` replicas cannot split the DP ranks (or are combined with EP), or None."""
    if dp % dp_replicate:
        valid = [r for r in range(1, dp + 1) if dp % r == 0]
        return Problem(f"--dp-replicate {dp_replicate} must divide the data-parallel size {dp}",
                       f"each replica holds dp / dp-replicate shards; valid: {valid}")
    if dp_replicate > 1 and ep > 1:
        return Problem("--dp-replicate (HSDP) is not combined with expert parallelism",
                       "the routed experts are sharded over their own expert-DP group; drop --dp-replicate or --ep")
    return None


def hsdp_zero_problem(dp_replicate: int, zero: int) -> Problem | None:
    """HSDP splits ZeRO's sharding into replicas: it needs ZeRO 1-3."""
    if dp_replicate > 1 and zero == 0:
        return Problem(f"--dp-replicate {dp_replicate} splits ZeRO's sharding into replicas, and --zero 0 shards "
                       f"nothing", "give --zero 1, 2 or 3 (or drop --dp-replicate)")
    return None


def batch_problem(global_batch: int, dp: int, micro_batch_size: int) -> Problem | None:
    """Why a global batch of `global_batch` rows does not split into dp ranks x whole micro-batches, or None."""
    if micro_batch_size >= 1 and global_batch % (dp * micro_batch_size) == 0:
        return None
    if global_batch < 1:
        return Problem(f"global batch size must be positive, got {global_batch}")
    if global_batch % dp:  # no micro-batch size can help: name none (the default one was worked out from it)
        below = global_batch // dp * dp
        nearby = [m for m in (below, below + dp) if m >= 1]
        return Problem(f"global batch size {global_batch} is not a multiple of dp {dp}",
                       f"the global batch must be a multiple of dp {dp}: nearby multiples {nearby}")
    per_rank = global_batch // dp if global_batch % dp == 0 else 0
    valid = [m for m in range(1, per_rank + 1) if per_rank % m == 0]
    hint = (f"valid micro-batch sizes: {', '.join(map(str, valid))}" if valid
            else f"the global batch must be a multiple of dp {dp}")
    return Problem(f"global batch size {global_batch} does not divide into dp {dp} x micro-batch size "
                   f"{micro_batch_size}", hint)


def require_model_config(cfg) -> None:
    """A TensorparError for what is no model config (a preset's name, a path, a dict), naming how to get one."""
    if isinstance(cfg, (str, bytes, dict, os.PathLike)) or not hasattr(cfg, "num_layers"):
        raise TensorparError(f"expected a model config (tensorpar.models.ModelConfig: get_config('tiny'), or "
                             f"load_hf_folder(path)[0] for a Hugging Face folder), got {type(cfg).__name__} "
                             f"{str(cfg)[:60]!r}")


def layout_problems(layout, cfg, *, seq_len: int | None = None, global_batch: int | None = None,
                    micro_batch_size: int | None = None, fp8: bool = False) -> list[Problem]:
    """Every reason `layout` cannot run model `cfg` (the sequence and batch rules only when `seq_len`,
    `global_batch` and `micro_batch_size` are given; `fp8`: the GEMMs run in fp8), first what to fix first."""
    require_model_config(cfg)
    found = _model_problems(layout, cfg)
    if seq_len is not None:
        found += _sequence_problems(layout, cfg, seq_len)
    if global_batch is not None and micro_batch_size is not None:
        found.append(batch_problem(global_batch, layout.dp, micro_batch_size))
    found.append(hsdp_problem(layout.dp, layout.dp_replicate, layout.ep if cfg.is_moe else 1))
    found.append(hsdp_zero_problem(layout.dp_replicate, layout.zero))
    found += _expert_problems(layout, cfg, seq_len, micro_batch_size)
    found += _pipeline_problems(layout, cfg, global_batch, micro_batch_size, fp8)
    return [p for p in found if p is not None]


def _model_problems(layout, cfg) -> list[Problem | None]:
    return [divisibility(cfg.num_heads, layout.tp, "num_heads"), kv_problem(cfg.kv_heads, layout.tp),
            divisibility(cfg.ffn_hidden_size, layout.tp, "ffn_hidden_size")]


def _sequence_problems(layout, cfg, seq_len: int) -> list[Problem | None]:
    if seq_len < 1:
        return [Problem(f"sequence length must be positive, got {seq_len}")]
    return [positions_problem(cfg, seq_len), context_split_problem(seq_len, layout.cp),
            sequence_parallel_problem(seq_len, layout.tp, layout.cp) if layout.sequence_parallel else None]


def positions_problem(cfg, seq_len: int) -> Problem | None:
    """A sequence longer than a model with learned positions has, or None."""
    if cfg.position == "learned" and seq_len > cfg.max_seq_len:
        return Problem(f"sequence length {seq_len} exceeds the model's {cfg.max_seq_len} learned positions")
    return None


def sequence_parallel_problem(seq_len: int, tp: int, cp: int = 1) -> Problem | None:
    """Why sequence parallelism cannot split each CP rank's seq_len / cp positions evenly over `tp` ranks, or None."""
    if (seq_len // cp) % tp == 0:
        return None
    what = f"sequence length {seq_len}" + (f" / cp {cp} = {seq_len // cp}" if cp > 1 else "")
    return Problem(f"{what} is not divisible by the tensor-parallel size {tp}",
                   f"sequence parallelism splits the sequence evenly: use a multiple of {tp * cp} or drop "
                   f"--sequence-parallel")


def _expert_problems(layout, cfg, seq_len: int | None, micro_batch_size: int | None) -> list[Problem | None]:
    tp, cp, ep = layout.tp, layout.cp, layout.ep
    if not cfg.is_moe:
        dense = "needs a mixture-of-experts model (num_experts > 0); this one is dense"
        return [Problem(f"--ep {ep} {dense}") if ep != 1 else None,
                Problem(f"--expert-tp {layout.expert_tp} {dense}") if layout.expert_tp != 1 else None]
    fold = fold_problem(tp, cp, layout.dp, ep, layout.expert_tp, cfg.num_experts, cfg.expert_ffn_size)
    found = [fold, experts_problem(cfg.num_experts, ep), expert_width_problem(cfg.expert_ffn_size, layout.expert_tp)]
    if cfg.num_shared_experts:
        found.append(divisibility(cfg.num_shared_experts * cfg.expert_ffn_size, tp, "the shared experts' width"))
    tokens = micro_batch_size * seq_len // cp if micro_batch_size and seq_len else None
    if tp > 1 and not layout.sequence_parallel and tokens is not None and tokens % tp:
        found.append(Problem(f"an MoE layer splits a micro-batch's {tokens} tokens (per CP rank) over the {tp} TP ranks",
                             f"use a micro-batch size x sequence length divisible by {tp * cp}, or --sequence-parallel"))
    return found


def _pipeline_problems(layout, cfg, global_batch, micro_batch_size, fp8: bool) -> list[Problem | None]:
    if layout.pp == 1:
        if layout.virtual_stages > 1:
            return [Problem(f"--virtual-stages {layout.virtual_stages} interleaves model chunks over pipeline stages, "
                            f"and there is one", "give --pp > 1, or --virtual-stages 1")]
        return []
    m = (layout.num_micro_batches(global_batch, micro_batch_size)
         if global_batch is not None and micro_batch_size else None)
    found = [_zero_bubble_problem(layout, fp8)]
    found.append(schedule_problem(layout.schedule, layout.pp, m, layout.virtual_stages))
    found.append(layout.split(cfg.num_layers).problem())
    return found


def _zero_bubble_problem(layout, fp8: bool) -> Problem | None:
    """The combinations a split backward (zb-h1, zbv) cannot run: ZeRO-3 and fp8 GEMMs."""
    if not layout.splits_backward:
        return None
    if layout.zero == 3:
        return Problem(f"--schedule {layout.schedule} leaves weight gradients for later, which ZeRO-3's per-layer "
                       f"gather and free do not allow", "use --zero 0, 1 or 2 with it, or another schedule")
    if fp8:
        return Problem(f"--dtype fp8 cannot run under --schedule {layout.schedule} (a split backward leaves weight "
                       f"gradients for later, which the fp8 GEMMs compute with the input gradient)",
                       "use 1f1b or interleaved")
    return None
