"""Check that a model fits a TP layout before any process or process group exists.

The layers check the same conditions when they are built (a second line of defence); this
gives the user one clear line in the launching process instead of an error on every rank.
"""

from __future__ import annotations

from tensorpar.context_parallel.ring_attention import check_context_split
from tensorpar.distributed.mesh import check_expert_layout
from tensorpar.distributed.sharding import divide
from tensorpar.errors import LayoutError
from tensorpar.expert_parallel import experts_per_rank
from tensorpar.expert_parallel.experts import expert_width_per_rank
from tensorpar.layers.attention import kv_layout


def check_model_layout(cfg, tp: int, sequence_parallel: bool = False, seq_len: int | None = None,
                       cp: int = 1) -> None:
    divide(cfg.num_heads, tp, "num_heads")
    kv_layout(cfg.kv_heads, tp)
    divide(cfg.ffn_hidden_size, tp, "ffn_hidden_size")
    if seq_len is not None:
        if seq_len < 1:
            raise LayoutError(f"sequence length must be positive, got {seq_len}")
        if cfg.position == "learned" and seq_len > cfg.max_seq_len:
            raise LayoutError(f"sequence length {seq_len} exceeds the model's {cfg.max_seq_len} learned positions")
        check_context_split(seq_len, cp)
        if sequence_parallel and tp > 1 and (seq_len // cp) % tp:
            what = f"sequence length {seq_len}" + (f" / cp {cp} = {seq_len // cp}" if cp > 1 else "")
            raise LayoutError(
                f"{what} is not divisible by the tensor-parallel size {tp}; sequence parallelism "
                f"splits the sequence evenly: use a multiple of {tp * cp} or drop --sequence-parallel"
            )


def check_moe_layout(cfg, tp: int, cp: int, dp: int, ep: int, *, sequence_parallel: bool = False,
                     micro_batch_size: int | None = None, seq_len: int | None = None, expert_tp: int = 1) -> None:
    """Refuse an expert-parallel layout that cannot work, before any process group exists (every rank runs it)."""
    if not cfg.is_moe:
        if ep != 1:
            raise LayoutError(f"--ep {ep} needs a mixture-of-experts model (num_experts > 0); this one is dense")
        if expert_tp != 1:
            raise LayoutError(f"--expert-tp {expert_tp} needs a mixture-of-experts model (num_experts > 0); this one "
                              f"is dense")
        return
    check_expert_layout(tp, cp, dp, ep, expert_tp)
    experts_per_rank(cfg.num_experts, ep)
    expert_width_per_rank(cfg.expert_ffn_size, expert_tp)
    if cfg.num_shared_experts:
        divide(cfg.num_shared_experts * cfg.expert_ffn_size, tp, "the shared experts' width")
    if tp > 1 and not sequence_parallel and micro_batch_size and seq_len and (micro_batch_size * seq_len // cp) % tp:
        raise LayoutError(f"an MoE layer splits a micro-batch's {micro_batch_size * seq_len // cp} tokens (per CP "
                          f"rank) over the {tp} TP ranks: use a micro-batch size x sequence length divisible by "
                          f"{tp * cp}, or --sequence-parallel")
