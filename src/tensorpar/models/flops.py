"""Model FLOPs per trained token (PaLM's accounting), for MFU and the planner.

FLOPs per trained token: 6 x (parameters that take part in a matmul) + 12 x layers x hidden x
sequence (attention scores and their use, forward and backward): per head 6 x sequence x (key width + value width),
which latent attention's wider keys (qk_nope + qk_rope) and narrower values make its own. Multi-token prediction
modules count as layers. Embedding lookups are not matmuls; a tied output head is counted once, as the matmul it is.
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


def train_flops_per_token(cfg, seq_len: int) -> float:
    key, value = ((cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.v_head_dim) if cfg.is_mla
                  else (cfg.head_dim, cfg.head_dim))
    head_again = cfg.num_mtp_layers * cfg.vocab_size * cfg.hidden_size  # each MTP module uses the head once more
    return 6.0 * (matmul_params(cfg) + head_again) + 6.0 * cfg.num_blocks * cfg.num_heads * (key + value) * seq_len
