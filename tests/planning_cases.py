"""Model configs shared by the planning tests (and tests/planning_report.py)."""

from __future__ import annotations

from tensorpar.models import get_config

WORLD = 4  # one pool of 4 gloo processes for every check: TP 2 runs as 2 TP groups x DP 2, TP 4 as one


GPT2_SHAPE = get_config("gpt2-124m").replace(num_layers=2)  # GPT-2 124M's widths and vocabulary, 2 layers


CONFIGS = {
    "tiny": get_config("tiny").replace(num_layers=2),  # Llama-style, 4 heads / 2 KV heads (replicated at TP 4)
    "tiny-gpt2": get_config("tiny-gpt2").replace(num_layers=2),  # LayerNorm, biases, learned positions, tied
    "gpt2-124m-2l": GPT2_SHAPE,
    # Gemma's layer (sandwich norms of (1 + w), per-head qk-norm, soft caps, a score scale, a window of 8 on the first
    # layer) and OLMo 2's (norms after the sublayers, qk-norm over the whole projection; its 2 KV heads replicated at
    # TP 4), at tiny's widths.
    "gemma-like": get_config("tiny").replace(
        num_layers=2, norm_placement="sandwich", norm_offset=1.0, qk_norm="head", attn_logit_softcap=20.0,
        final_logit_softcap=30.0, query_pre_attn_scalar=24.0, sliding_window=8,
        layer_types=("sliding_attention", "full_attention"), embedding_multiplier=8.0, head_size=48),
    "olmo-like": get_config("tiny").replace(num_layers=2, norm_placement="post", qk_norm="projection"),
    # DeepSeek-V3's latent attention in a dense 2-layer model: q and kv latents, rotary keys, values narrower than keys
    "tiny-mla": get_config("tiny-deepseek").replace(num_layers=2, num_experts=0, num_mtp_layers=0, n_group=1,
                                                    topk_group=1, expert_bias=False, bias_update_speed=0.0),
}
CONFIGS["tiny-mla-mtp"] = CONFIGS["tiny-mla"].replace(num_mtp_layers=1)  # and a multi-token prediction module
