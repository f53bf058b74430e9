"""The named model presets: the tiny models that train on a CPU, and the published shapes of each family (what
`tensorpar plan` and `train --dry-run` take by name), or a ModelConfig saved as JSON."""

from __future__ import annotations

import json
import math

from tensorpar.errors import TensorparError
from tensorpar.models.config import ModelConfig

def _gpt2(hidden, layers, heads, **kw) -> ModelConfig:
    return ModelConfig(
        family="gpt2", vocab_size=50257, hidden_size=hidden, num_layers=layers, num_heads=heads,
        ffn_hidden_size=4 * hidden, max_seq_len=1024, **kw,
    )


def _llama(hidden, layers, heads, kv, ffn, vocab=128256, theta=500000.0, tie=False, max_seq=131072, family="llama",
           **kw) -> ModelConfig:
    kw = {"activation": "silu", **kw}
    return ModelConfig(
        family=family, vocab_size=vocab, hidden_size=hidden, num_layers=layers, num_heads=heads, num_kv_heads=kv,
        ffn_hidden_size=ffn, max_seq_len=max_seq, norm="rmsnorm", gated_mlp=True,
        position="rope", rope_theta=theta, tie_embeddings=tie, bias=False, **kw,
    )


def _deepseek(hidden, layers, heads, ffn, vocab, experts, moe_ffn, *, q_lora=1536, kv_lora=512, nope=128, rope=64,
              v=128, theta=10000.0, max_seq=163840, **kw) -> ModelConfig:
    """A DeepSeek-V3-class MoE: latent attention, sigmoid routing with the balancing bias, top-8, one shared expert."""
    defaults = dict(experts_per_token=8, num_shared_experts=1, router_score="sigmoid", expert_bias=True,
                    bias_update_speed=0.001, rope_interleave=True)
    return ModelConfig(
        family="deepseek_v3", vocab_size=vocab, hidden_size=hidden, num_layers=layers, num_heads=heads,
        num_kv_heads=heads, ffn_hidden_size=ffn, max_seq_len=max_seq, norm="rmsnorm", norm_eps=1e-6,
        activation="silu", gated_mlp=True, position="rope", rope_theta=theta, tie_embeddings=False, bias=False,
        num_experts=experts, moe_ffn_hidden_size=moe_ffn, q_lora_rank=q_lora, kv_lora_rank=kv_lora,
        qk_nope_head_dim=nope, qk_rope_head_dim=rope, v_head_dim=v, **{**defaults, **kw})


def _yarn(factor, beta_fast=32.0, beta_slow=1.0) -> dict:
    return {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": 4096, "beta_fast": beta_fast,
            "beta_slow": beta_slow, "mscale": 1.0, "mscale_all_dim": 1.0}


_LLAMA3_SCALING = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 8192}

def _sliding_every(n: int, layers: int) -> tuple[str, ...]:
    """Layer types of a model whose every n-th layer (the n-th, 2n-th, ...) attends globally, the others locally."""
    return tuple("full_attention" if (i + 1) % n == 0 else "sliding_attention" for i in range(layers))


def _qwen3(hidden, layers, heads, kv, ffn, family="qwen3", **kw) -> ModelConfig:
    return _llama(hidden, layers, heads, kv, ffn, vocab=151936, theta=1e6, max_seq=40960, family=family,
                  head_size=128, qk_norm="head", norm_eps=1e-6, **kw)


def _gemma(hidden, layers, heads, kv, ffn, **kw) -> ModelConfig:
    return _llama(hidden, layers, heads, kv, ffn, head_size=256, activation="gelu_new", norm_placement="sandwich",
                  norm_offset=1.0, embedding_multiplier=math.sqrt(hidden), query_pre_attn_scalar=256.0,
                  norm_eps=1e-6, tie=True, **kw)


PRESETS: dict[str, ModelConfig] = {
    # Trains in minutes on 2 CPU cores with the byte-level tokenizer (vocabulary 257).
    "tiny": _llama(128, 4, 4, 2, 352, vocab=257, theta=10000.0, max_seq=1024),
    "tiny-gpt2": ModelConfig(family="gpt2", vocab_size=257, hidden_size=128, num_layers=4, num_heads=4,
                             ffn_hidden_size=512, max_seq_len=1024),
    # GPT-2 (Radford et al. 2019), as published on the Hugging Face hub.
    "gpt2-124m": _gpt2(768, 12, 12),
    "gpt2-350m": _gpt2(1024, 24, 16),
    "gpt2-774m": _gpt2(1280, 36, 20),
    "gpt2-1.5b": _gpt2(1600, 48, 25),
    # Llama 3.2 1B (tied embeddings, as published) and Llama 3.1 8B / 70B / 405B.
    "llama-1b": _llama(2048, 16, 32, 8, 8192, tie=True,
                       rope_scaling={**_LLAMA3_SCALING, "factor": 32.0}),
    "llama-8b": _llama(4096, 32, 32, 8, 14336, rope_scaling={**_LLAMA3_SCALING, "factor": 8.0}),
    "llama-70b": _llama(8192, 80, 64, 8, 28672, rope_scaling={**_LLAMA3_SCALING, "factor": 8.0}),
    "llama-405b": _llama(16384, 126, 128, 8, 53248, rope_scaling={**_LLAMA3_SCALING, "factor": 8.0}),
    # Mixtures of experts. tiny-moe trains in seconds on CPU: 8 experts (top-2) and one shared expert per layer.
    "tiny-moe": _llama(64, 4, 4, 2, 128, vocab=257, theta=10000.0, max_seq=1024, num_experts=8, experts_per_token=2,
                       num_shared_experts=1, moe_ffn_hidden_size=64, router_aux_loss_coef=0.01,
                       router_z_loss_coef=0.001),
    # Mixtral 8x7B (Jiang et al. 2024) and Qwen1.5-MoE-A2.7B (60 experts, top-4, a 4-expert-wide shared expert behind
    # a sigmoid gate, q/k/v biases), as published on the Hugging Face hub.
    "mixtral-8x7b": _llama(4096, 32, 32, 8, 14336, vocab=32000, theta=1e6, max_seq=32768, num_experts=8,
                           experts_per_token=2, router_aux_loss_coef=0.02),
    "qwen-moe-a2.7b": _llama(2048, 24, 16, 16, 5632, vocab=151936, theta=1e6, max_seq=8192, num_experts=60,
                             experts_per_token=4, num_shared_experts=4, moe_ffn_hidden_size=1408,
                             shared_expert_gate=True, qkv_bias=True, norm_topk_prob=False,
                             router_aux_loss_coef=0.001),
    # The decoders users bring (docs/models.md), as published on the Hugging Face hub: Qwen2.5-7B (q/k/v biases),
    # Qwen3-8B and Qwen3-30B-A3B (qk-norm, 128-wide heads; 128 experts, top-8, no shared expert), Mistral-7B-v0.1
    # (a 4096 sliding window), Gemma 2 9B and Gemma 3 12B (sandwich norms, (1 + w) RMSNorm, GeGLU, a scaled
    # embedding, local and global layers; Gemma 2's soft caps; Gemma 3's qk-norm and local RoPE base), Phi-3-mini-4k
    # (its 2047 window) and OLMo-2-7B (norms after the sublayers, qk-norm over the whole projection).
    "qwen2.5-7b": _llama(3584, 28, 28, 4, 18944, vocab=152064, theta=1e6, family="qwen2", qkv_bias=True,
                         norm_eps=1e-6),
    "qwen3-8b": _qwen3(4096, 36, 32, 8, 12288),
    "qwen3-30b-a3b": _qwen3(2048, 48, 32, 4, 6144, family="qwen3_moe", num_experts=128, experts_per_token=8,
                            moe_ffn_hidden_size=768, router_aux_loss_coef=0.001),
    "mistral-7b": _llama(4096, 32, 32, 8, 14336, vocab=32000, theta=10000.0, max_seq=32768, family="mistral",
                         sliding_window=4096),
    "gemma2-9b": _gemma(3584, 42, 16, 8, 14336, vocab=256000, theta=10000.0, max_seq=8192, family="gemma2",
                        sliding_window=4096, layer_types=_sliding_every(2, 42), attn_logit_softcap=50.0,
                        final_logit_softcap=30.0),
    "gemma3-12b": _gemma(3840, 48, 16, 8, 15360, vocab=262208, theta=1e6, family="gemma3_text",
                         rope_scaling={"rope_type": "linear", "factor": 8.0}, rope_local_theta=10000.0,
                         sliding_window=1024, layer_types=_sliding_every(6, 48), qk_norm="head"),
    "phi3-mini": _llama(3072, 32, 32, 32, 8192, vocab=32064, theta=10000.0, max_seq=4096, family="phi3",
                        sliding_window=2047),
    "olmo2-7b": _llama(4096, 32, 32, 32, 11008, vocab=100352, theta=500000.0, max_seq=4096, family="olmo2",
                       qk_norm="projection", norm_placement="post", norm_eps=1e-6),
    # DeepSeek-V3 class (docs/deepseek.md). tiny-deepseek trains in seconds on CPU: latent attention, 8 experts in 4
    # groups (a token sees 2), the balancing bias, a dense first layer and one multi-token prediction module.
    "tiny-deepseek": _deepseek(64, 4, 4, 128, 257, 8, 32, q_lora=32, kv_lora=16, nope=16, rope=8, v=16,
                               max_seq=1024, experts_per_token=2, n_group=4, topk_group=2, routed_scaling_factor=2.5,
                               first_k_dense_replace=1, num_mtp_layers=1, router_aux_loss_coef=0.001),
    # DeepSeek-V3 (671B + a 14B MTP module; DeepSeek-AI 2024) and Kimi K2 (1T; 384 experts, 64 heads, one group, no
    # MTP), as published on the Hugging Face hub.
    "deepseek-v3": _deepseek(7168, 61, 128, 18432, 129280, 256, 2048, n_group=8, topk_group=4,
                             routed_scaling_factor=2.5, first_k_dense_replace=3, num_mtp_layers=1,
                             router_aux_loss_coef=0.0001, rope_scaling=_yarn(40.0), init_std=0.006),
    "kimi-k2": _deepseek(7168, 61, 64, 18432, 163840, 384, 2048, theta=50000.0, max_seq=131072,
                         routed_scaling_factor=2.827, first_k_dense_replace=1, rope_scaling=_yarn(32.0, 1.0, 1.0)),
    # GLM-4.5-Air (106B, 12B active; Zhipu 2025): the same routing family with grouped-query attention, 128-wide heads,
    # q/k/v biases and RoPE on half of each head, as published.
    "glm-4.5-air": _llama(4096, 46, 96, 8, 10944, vocab=151552, theta=1e6, family="glm4_moe", head_size=128,
                          qkv_bias=True, partial_rotary_factor=0.5, num_experts=128, experts_per_token=8,
                          num_shared_experts=1, moe_ffn_hidden_size=1408, first_k_dense_replace=1,
                          router_score="sigmoid", expert_bias=True, bias_update_speed=0.001, num_mtp_layers=1),
}


def get_config(name_or_path: str) -> ModelConfig:
    """A preset by name, or a ModelConfig saved as JSON (`ModelConfig.to_dict()`)."""
    if name_or_path in PRESETS:
        return PRESETS[name_or_path]
    if name_or_path.endswith(".json"):
        try:
            with open(name_or_path) as f:
                return ModelConfig(**json.load(f))
        except FileNotFoundError:
            raise TensorparError(f"model config file '{name_or_path}' does not exist") from None
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise TensorparError(f"model config file '{name_or_path}' is unreadable or not JSON: {e}") from None
        except TypeError as e:
            raise TensorparError(f"model config file '{name_or_path}' is not a tensorpar config: {e}") from None
    raise TensorparError(f"unknown model preset '{name_or_path}'; known presets: {', '.join(PRESETS)}")
