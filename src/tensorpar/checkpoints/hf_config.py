"""Hugging Face config.json <-> tensorpar's ModelConfig: GPT-2 here, the Llama-style families (Llama, Mistral,
Qwen2, Qwen3, Gemma 2 and 3, Phi-3, OLMo 2) in `tensorpar.checkpoints.hf_family_config`, the mixture-of-experts
fields (Mixtral, Qwen2-MoE, Qwen3-MoE) in `tensorpar.checkpoints.hf_moe_config`, DeepSeek-V3 and GLM-4.5 in
`tensorpar.checkpoints.hf_deepseek_config`.

    config_from_hf(hf_dict)          config.json -> ModelConfig (refuses what the model cannot compute)
    config_to_hf(cfg)                ModelConfig -> a config.json dict transformers loads
"""

from __future__ import annotations

import math

import torch

from tensorpar.checkpoints.hf_deepseek_config import (
    ARCHITECTURES as DEEPSEEK_ARCHITECTURES,
    DEEPSEEK_MODEL_TYPES,
    deepseek_config_from_hf,
    deepseek_config_to_hf,
    deepseek_export_problems,
)
from tensorpar.checkpoints.hf_families import FAMILIES, PLAIN, family_of
from tensorpar.checkpoints.hf_family_config import (
    decoder_config_to_hf,
    decoder_export_problems,
    decoder_fields,
    intermediate_size,
)
from tensorpar.checkpoints.hf_fields import boolean, positive_float, positive_int, require, unsupported
from tensorpar.checkpoints.hf_moe_config import (
    MOE_MODEL_TYPES,
    moe_config_from_hf,
    moe_config_to_hf,
    moe_export_problems,
)
from tensorpar.errors import TensorparError
from tensorpar.models.config import ModelConfig

SUPPORTED_MODEL_TYPES = ("gpt2",) + tuple(FAMILIES) + DEEPSEEK_MODEL_TYPES
# Hugging Face activation names -> tensorpar's (same function; gelu_new is the tanh approximation).
_GPT2_ACTIVATIONS = {"gelu_new": "gelu_new", "gelu_pytorch_tanh": "gelu_new", "gelu": "gelu", "relu": "relu",
                     "silu": "silu", "swish": "silu"}


def config_from_hf(hf: dict) -> ModelConfig:
    """A ModelConfig from a Hugging Face config.json dict (GPT-2, a Llama-style family, an MoE); dropout is 0."""
    if not isinstance(hf, dict):
        raise TensorparError(f"a Hugging Face config must be a JSON object, got {type(hf).__name__}")
    model_type = hf.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise unsupported("model_type", model_type, f"an unsupported model type; supported: "
                                                    f"{', '.join(SUPPORTED_MODEL_TYPES)}")
    if hf.get("quantization_config"):
        raise unsupported("quantization_config", hf["quantization_config"].get("quant_method", "?")
                           if isinstance(hf["quantization_config"], dict) else hf["quantization_config"],
                           "quantized checkpoints are not supported")
    if model_type == "gpt2":
        cfg = _gpt2_config(hf)
    elif model_type in DEEPSEEK_MODEL_TYPES:
        cfg = deepseek_config_from_hf(hf)
    elif model_type in MOE_MODEL_TYPES:
        cfg = moe_config_from_hf(hf, decoder_fields(hf, model_type))
    else:
        cfg = ModelConfig(**decoder_fields(hf, model_type), ffn_hidden_size=intermediate_size(hf, model_type))
    return cfg.replace(init_std=_initializer_range(hf),
                       pad_token_id=None if model_type == "gpt2" else _padding_row(hf, cfg.vocab_size))


def _padding_row(hf: dict, vocab_size: int) -> int | None:
    """The embedding row transformers' Llama-style, MoE and DeepSeek models never train (`nn.Embedding(...,
    padding_idx=config.pad_token_id)`; GPT-2's has none): config.json's pad_token_id, a negative one counted from
    the end as nn.Embedding counts it."""
    value = hf.get("pad_token_id")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not -vocab_size <= value < vocab_size:
        raise unsupported("pad_token_id", value, f"expected a token id within the vocabulary of {vocab_size} (the "
                                                 f"embedding row transformers never trains)")
    return value % vocab_size


def _initializer_range(hf: dict) -> float:
    """The std a model trained from this config starts with (DeepSeek-V3: 0.006); every config class defaults to
    0.02, and a null is that default. 0 is honoured (zeros); a negative or non-number std is refused."""
    value = hf.get("initializer_range")
    if value is None:
        return 0.02
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise unsupported("initializer_range", value, "expected a non-negative number (the initial weights' std)")
    return float(value)


def _gpt2_config(hf: dict) -> ModelConfig:
    # Defaults are GPT2Config's, for config.json files that leave them out.
    hidden = positive_int(hf, "n_embd", 768)
    act = hf.get("activation_function", "gelu_new")
    if act not in _GPT2_ACTIVATIONS:
        raise unsupported("activation_function", act, f"supported: {', '.join(_GPT2_ACTIVATIONS)}")
    require(hf, "scale_attn_weights", True, True, "tensorpar always scales attention scores by 1/sqrt(head_dim)")
    require(hf, "scale_attn_by_inverse_layer_idx", False, False, "per-layer attention scaling is not supported")
    require(hf, "add_cross_attention", False, False, "cross-attention is not supported")
    n_inner = hf.get("n_inner")
    return ModelConfig(
        family="gpt2",
        vocab_size=positive_int(hf, "vocab_size", 50257),
        hidden_size=hidden,
        num_layers=positive_int(hf, "n_layer", 12),
        num_heads=positive_int(hf, "n_head", 12),
        ffn_hidden_size=4 * hidden if n_inner is None else positive_int(hf, "n_inner"),
        max_seq_len=positive_int(hf, "n_positions", 1024),
        norm="layernorm",
        norm_eps=positive_float(hf, "layer_norm_epsilon", 1e-5),
        activation=_GPT2_ACTIVATIONS[act],
        gated_mlp=False,
        position="learned",
        tie_embeddings=boolean(hf, "tie_word_embeddings", True),
        bias=True,
        dropout=0.0,
    )


def check_representable(cfg: ModelConfig) -> None:
    """Refuse configs that have no Hugging Face equivalent in their family's architecture (GPT2LMHeadModel,
    LlamaForCausalLM, Qwen3ForCausalLM, ..., MixtralForCausalLM, Qwen2MoeForCausalLM, Qwen3MoeForCausalLM)."""
    if cfg.family in DEEPSEEK_MODEL_TYPES:
        bad, arch = deepseek_export_problems(cfg), DEEPSEEK_ARCHITECTURES[cfg.family]
    elif cfg.family == "gpt2" and not cfg.is_moe:
        wanted = dict(norm="layernorm", position="learned", gated_mlp=False, bias=True, num_kv_heads=cfg.num_heads,
                      qkv_bias=True, mlp_bias=True, head_size=cfg.hidden_size // cfg.num_heads,
                      **{k: v for k, v in PLAIN.items() if k not in ("rope_local_theta", "partial_rotary_factor")},
                      sliding_window=None)
        actual = dict({k: getattr(cfg, k) for k in wanted}, num_kv_heads=cfg.kv_heads, qkv_bias=cfg.attention_qkv_bias,
                      mlp_bias=cfg.mlp_has_bias, head_size=cfg.head_dim)
        if cfg.activation not in _GPT2_ACTIVATIONS.values():
            actual["activation"], wanted["activation"] = cfg.activation, "one of " + ", ".join(_GPT2_ACTIVATIONS)
        bad = [f"{k}={actual[k]!r} (needs {wanted[k]!r})" for k in wanted if actual[k] != wanted[k]]
        arch = "GPT2LMHeadModel"
    elif cfg.family == "gpt2":
        bad, arch = ["family='gpt2' (an MoE model exports as a Llama-style family)"], "MoE"
    else:
        bad = decoder_export_problems(cfg) + (moe_export_problems(cfg) if cfg.is_moe else [])
        arch = family_of(cfg).architecture
    if bad:
        raise TensorparError(f"this {cfg.family} config has no Hugging Face {arch} equivalent: {', '.join(bad)}")


def config_to_hf(cfg: ModelConfig, dtype: torch.dtype | None = None, token_ids: dict | None = None) -> dict:
    """A config.json dict that transformers loads as its family's config class (the inverse of config_from_hf).
    `token_ids`: bos_token_id, eos_token_id and pad_token_id (those not given are null: no token is special;
    without `token_ids`, GPT-2 keeps GPT2Config's end-of-text id 50256 when its vocabulary holds it)."""
    check_representable(cfg)
    if cfg.family in DEEPSEEK_MODEL_TYPES:
        out = deepseek_config_to_hf(cfg)
    else:
        out = _gpt2_hf_fields(cfg) if cfg.family == "gpt2" else decoder_config_to_hf(cfg)
        if cfg.is_moe:
            out.update(moe_config_to_hf(cfg))
    if token_ids is not None or cfg.family != "gpt2" or cfg.vocab_size <= 50256:
        out.update({name: (token_ids or {}).get(name) for name in ("bos_token_id", "eos_token_id")})
        # the model's own padding row, not the tokenizer's pad (generation pads with the EOS): transformers never trains
        # the row config.json names
        out["pad_token_id"] = cfg.pad_token_id
    if dtype is not None:
        out["torch_dtype"] = str(dtype).removeprefix("torch.")
    return out


def _gpt2_hf_fields(cfg: ModelConfig) -> dict:
    """The GPT2Config fields of a GPT-2 ModelConfig, as a config.json dict."""
    out = {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": cfg.vocab_size,
        "n_positions": cfg.max_seq_len,
        "n_embd": cfg.hidden_size,
        "n_layer": cfg.num_layers,
        "n_head": cfg.num_heads,
        "n_inner": cfg.ffn_hidden_size,
        "activation_function": cfg.activation,
        "layer_norm_epsilon": cfg.norm_eps,
        "resid_pdrop": cfg.dropout,
        "embd_pdrop": cfg.dropout,
        "attn_pdrop": cfg.dropout,
        "scale_attn_weights": True,
        "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False,
        "initializer_range": cfg.init_std,
        "tie_word_embeddings": cfg.tie_embeddings,
    }
    return out
