"""Check that a model fits a TP layout before any process or process group exists.

The layers check the same conditions when they are built (a second line of defence); this
gives the user one clear line in the launching process instead of an error on every rank.
"""

from __future__ import annotations

from tensorpar.errors import LayoutError
from tensorpar.layers.attention import kv_layout
from tensorpar.layers.ring_attention import check_context_split
from tensorpar.layers.sharding import divide


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
