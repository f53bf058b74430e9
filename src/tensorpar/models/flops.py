"""Model FLOPs per trained token (PaLM's accounting), for MFU and the planner.

FLOPs per trained token: 6 x (parameters that take part in a matmul) + 12 x (query heads x head size) x the keys
each query's layer attends to, summed over the layers (attention scores and their use, forward and backward): the
sequence, or a sliding layer's window when shorter (PaLM's 12 x layers x hidden x sequence for a model whose heads
span the hidden size and attend to the whole sequence); latent attention's heads 6 x (key width + value width) in
place of 12 x head size, its keys (qk_nope + qk_rope) wider than its values. Multi-token prediction modules count as
layers, and each uses the head once more. Embedding lookups are not matmuls; a tied output head is counted once, as
the matmul it is.
"""

from __future__ import annotations


def matmul_params(cfg) -> int:
    """Parameters of the dense model that take part in a matmul (learned positions and an untied input
    embedding are lookups); of a mixture of experts, those one token uses (its top-k routed experts)."""
    n = cfg.num_parameters(active=True)
    if cfg.position == "learned":
        n -= cfg.max_seq_len * cfg.hidden_size
    if not cfg.tie_embeddings:
        n -= cfg.vocab_size * cfg.hidden_size  # the input embedding is a lookup; the head stays counted
    return n


def attention_flops_per_token(cfg, seq_len: int) -> float:
    """12 x heads x head size x the keys a query attends to, summed over the layers and multi-token prediction
    modules (a window caps them; latent attention: 6 x heads x (key + value width))."""
    width = cfg.num_heads * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim + cfg.v_head_dim) / 2 if cfg.is_mla \
        else cfg.num_heads * cfg.head_dim
    if cfg.sliding_window is None:  # no layer has a window (the planner asks this for every candidate it times)
        keys = cfg.num_layers * seq_len
    else:
        keys = sum(min(seq_len, cfg.attention_window(i) or seq_len) for i in range(cfg.num_layers))
    return 12.0 * width * (keys + cfg.num_mtp_layers * seq_len)


def train_flops_per_token(cfg, seq_len: int) -> float:
    head_again = cfg.num_mtp_layers * cfg.vocab_size * cfg.hidden_size  # each MTP module uses the head once more
    return 6.0 * (matmul_params(cfg) + head_again) + attention_flops_per_token(cfg, seq_len)
