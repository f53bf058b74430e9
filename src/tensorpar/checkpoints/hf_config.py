"""Hugging Face config.json <-> tensorpar's ModelConfig, for GPT-2, Llama, Mixtral and Qwen2-MoE (the MoE fields:
`tensorpar.checkpoints.hf_moe_config`), DeepSeek-V3 and GLM-4.5 (`tensorpar.checkpoints.hf_deepseek_config`).

    config_from_hf(hf_dict)          config.json -> ModelConfig (refuses what the model cannot compute)
    config_to_hf(cfg)                ModelConfig -> a config.json dict transformers loads
"""

from __future__ import annotations

import torch

from tensorpar.checkpoints.hf_deepseek_config import (
    ARCHITECTURES as DEEPSEEK_ARCHITECTURES,
    DEEPSEEK_MODEL_TYPES,
    deepseek_config_from_hf,
    deepseek_config_to_hf,
    deepseek_export_problems,
)
from tensorpar.checkpoints.hf_fields import boolean, positive_float, positive_int, require, unsupported
from tensorpar.checkpoints.hf_moe_config import (
    MOE_MODEL_TYPES,
    moe_architecture,
    moe_config_from_hf,
    moe_config_to_hf,
    moe_export_problems,
)
from tensorpar.errors import TensorparError
from tensorpar.models.config import ModelConfig

SUPPORTED_MODEL_TYPES = ("gpt2", "llama") + MOE_MODEL_TYPES + DEEPSEEK_MODEL_TYPES
# Hugging Face activation names -> tensorpar's (same function; gelu_new is the tanh approximation).
_GPT2_ACTIVATIONS = {"gelu_new": "gelu_new", "gelu_pytorch_tanh": "gelu_new", "gelu": "gelu", "relu": "relu",
                     "silu": "silu", "swish": "silu"}


def config_from_hf(hf: dict) -> ModelConfig:
    """A ModelConfig from a Hugging Face config.json dict (GPT-2 or Llama); dropout is 0."""
    if not isinstance(hf, dict):
        raise TensorparError(f"a Hugging Face config must be a JSON object, got {type(hf).__name__}")
    model_type = hf.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise unsupported("model_type", model_type, f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
    if hf.get("quantization_config"):
        raise unsupported("quantization_config", hf["quantization_config"].get("quant_method", "?")
                           if isinstance(hf["quantization_config"], dict) else hf["quantization_config"],
                           "quantized checkpoints are not supported")
    if model_type in MOE_MODEL_TYPES:
        return moe_config_from_hf(hf, _decoder_fields(hf, model_type))
    if model_type in DEEPSEEK_MODEL_TYPES:
        return deepseek_config_from_hf(hf)
    return _gpt2_config(hf) if model_type == "gpt2" else _llama_config(hf)


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


def _rope_type(d: dict) -> str:
    return d.get("rope_type", d.get("type")) or "default"


def _llama_rope(hf: dict, max_positions: int, default_theta: float = 10000.0) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling) from a transformers 5 `rope_parameters` dict or the older top-level
    `rope_theta` + `rope_scaling` fields (either may carry the theta and the scaling)."""
    params, legacy = hf.get("rope_parameters") or {}, hf.get("rope_scaling") or {}
    for field, d in (("rope_parameters", params), ("rope_scaling", legacy)):
        if not isinstance(d, dict):
            raise unsupported(field, d, "expected a JSON object")
        if any(isinstance(v, dict) for v in d.values()):
            raise unsupported(field, list(d), "per-layer-type RoPE parameters are not supported")
    theta = params.get("rope_theta", legacy.get("rope_theta", hf.get("rope_theta", default_theta)))
    theta = positive_float({"rope_theta": theta}, "rope_theta")
    scaled = [(f, d) for f, d in (("rope_parameters", params), ("rope_scaling", legacy)) if _rope_type(d) != "default"]
    for field, d in (("rope_parameters", params), ("rope_scaling", legacy), ("config", hf)):
        factor = d.get("partial_rotary_factor", 1.0)
        if factor not in (None, 1, 1.0):
            raise unsupported("partial_rotary_factor", factor, "RoPE on part of the head is not supported")
    if not scaled:
        return theta, None
    field, d = scaled[0]
    kind = _rope_type(d)
    if kind != "llama3":
        raise unsupported(f"{field}.rope_type", kind, "supported: default, llama3")
    scaling = {
        "rope_type": "llama3",
        "factor": positive_float(d, "factor"),
        "low_freq_factor": positive_float(d, "low_freq_factor"),
        "high_freq_factor": positive_float(d, "high_freq_factor"),
        # As in transformers: without it, the model's own length is the pre-training length.
        "original_max_position_embeddings": positive_int(d, "original_max_position_embeddings",
                                                 hf.get("original_max_position_embeddings", max_positions)),
    }
    if scaling["high_freq_factor"] <= scaling["low_freq_factor"]:
        raise unsupported(f"{field}.high_freq_factor", scaling["high_freq_factor"],
                           f"must exceed low_freq_factor {scaling['low_freq_factor']}")
    return theta, scaling


# Defaults of LlamaConfig / MixtralConfig / Qwen2MoeConfig, for config.json files that leave fields out.
_DEFAULTS = {
    "llama": dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                  num_attention_heads=32, num_key_value_heads=None, max_position_embeddings=2048, rms_norm_eps=1e-6),
    "mixtral": dict(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                    num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=4096 * 32,
                    rms_norm_eps=1e-5, rope_theta=1e6),
    "qwen2_moe": dict(vocab_size=151936, hidden_size=2048, intermediate_size=5632, num_hidden_layers=24,
                      num_attention_heads=16, num_key_value_heads=16, max_position_embeddings=32768, rms_norm_eps=1e-6),
}


def _decoder_fields(hf: dict, model_type: str) -> dict:
    """The ModelConfig fields a Llama-style decoder (Llama, Mixtral, Qwen2-MoE) shares: sizes, attention, RoPE."""
    defaults = _DEFAULTS[model_type]
    hidden = positive_int(hf, "hidden_size", defaults["hidden_size"])
    heads = positive_int(hf, "num_attention_heads", defaults["num_attention_heads"])
    kv_heads = hf.get("num_key_value_heads", defaults["num_key_value_heads"])
    kv_heads = heads if kv_heads is None else positive_int({"num_key_value_heads": kv_heads}, "num_key_value_heads")
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise unsupported("hidden_act", act, f"{model_type}'s gated MLP is supported with silu only")
    if hidden % heads:
        raise unsupported("hidden_size", hidden, f"not divisible by num_attention_heads {heads}")
    head_dim = hf.get("head_dim")
    if head_dim is not None and head_dim != hidden // heads:
        raise unsupported("head_dim", head_dim,
                           f"tensorpar needs hidden_size / num_attention_heads = {hidden // heads}")
    if heads % kv_heads:
        raise unsupported("num_key_value_heads", kv_heads, f"does not divide num_attention_heads {heads}")
    max_positions = positive_int(hf, "max_position_embeddings", defaults["max_position_embeddings"])
    theta, scaling = _llama_rope(hf, max_positions, defaults.get("rope_theta", 10000.0))
    return dict(
        family="llama",
        vocab_size=positive_int(hf, "vocab_size", defaults["vocab_size"]),
        hidden_size=hidden,
        num_layers=positive_int(hf, "num_hidden_layers", defaults["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=kv_heads,
        max_seq_len=max_positions,
        norm="rmsnorm",
        norm_eps=positive_float(hf, "rms_norm_eps", defaults["rms_norm_eps"]),
        activation="silu",
        gated_mlp=True,
        position="rope",
        rope_theta=theta,
        rope_scaling=scaling,
        tie_embeddings=boolean(hf, "tie_word_embeddings", False),
        dropout=0.0,
    )


def _llama_config(hf: dict) -> ModelConfig:
    attention_bias = boolean(hf, "attention_bias", False)
    mlp_bias = boolean(hf, "mlp_bias", False)
    if attention_bias != mlp_bias:
        raise unsupported("mlp_bias", mlp_bias, f"differs from attention_bias={attention_bias}; tensorpar has one "
                                                 "bias switch for attention and MLP")
    return ModelConfig(**_decoder_fields(hf, "llama"),
                       ffn_hidden_size=positive_int(hf, "intermediate_size", _DEFAULTS["llama"]["intermediate_size"]),
                       bias=attention_bias)


def check_representable(cfg: ModelConfig) -> None:
    """Refuse configs that have no Hugging Face GPT2LMHeadModel / LlamaForCausalLM / MixtralForCausalLM /
    Qwen2MoeForCausalLM / DeepseekV3ForCausalLM / Glm4MoeForCausalLM equivalent."""
    if cfg.family in DEEPSEEK_MODEL_TYPES:
        bad = deepseek_export_problems(cfg)
        if bad:
            raise TensorparError(f"this {cfg.family} config has no Hugging Face {DEEPSEEK_ARCHITECTURES[cfg.family]} "
                                 f"equivalent: {', '.join(bad)}")
        return
    if cfg.family == "gpt2" and not cfg.is_moe:
        wanted = dict(norm="layernorm", position="learned", gated_mlp=False, bias=True, num_kv_heads=cfg.num_heads)
        actual = dict(norm=cfg.norm, position=cfg.position, gated_mlp=cfg.gated_mlp, bias=cfg.bias,
                      num_kv_heads=cfg.kv_heads)
        if cfg.activation not in _GPT2_ACTIVATIONS.values():
            actual["activation"], wanted["activation"] = cfg.activation, "one of " + ", ".join(_GPT2_ACTIVATIONS)
    else:
        wanted = dict(norm="rmsnorm", position="rope", gated_mlp=True, activation="silu")
        actual = dict(norm=cfg.norm, position=cfg.position, gated_mlp=cfg.gated_mlp, activation=cfg.activation)
        if cfg.rope_scaling and _rope_type(cfg.rope_scaling) not in ("default", "llama3"):
            actual["rope_scaling"], wanted["rope_scaling"] = _rope_type(cfg.rope_scaling), "default or llama3"
        if cfg.family != "llama":
            actual["family"], wanted["family"] = cfg.family, "llama"
    if not cfg.is_moe and cfg.attention_qkv_bias != cfg.bias:
        actual["qkv_bias"], wanted["qkv_bias"] = cfg.attention_qkv_bias, cfg.bias
    bad = [f"{k}={actual[k]!r} (needs {wanted[k]!r})" for k in wanted if actual[k] != wanted[k]]
    bad += moe_export_problems(cfg) if cfg.is_moe else []
    if bad:
        arch = ("GPT2LMHeadModel" if cfg.family == "gpt2" else "LlamaForCausalLM") if not cfg.is_moe else \
            {"mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM"}[moe_architecture(cfg)]
        raise TensorparError(f"this {cfg.family} config has no Hugging Face {arch} equivalent: {', '.join(bad)}")


def config_to_hf(cfg: ModelConfig, dtype: torch.dtype | None = None) -> dict:
    """A config.json dict that transformers loads as a GPT2Config / LlamaConfig / MixtralConfig / Qwen2MoeConfig (the
    inverse of config_from_hf)."""
    check_representable(cfg)
    if cfg.family in DEEPSEEK_MODEL_TYPES:
        out = deepseek_config_to_hf(cfg)
    else:
        out = _gpt2_hf_fields(cfg) if cfg.family == "gpt2" else _decoder_hf_fields(cfg)
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
    if cfg.vocab_size <= 50256:  # GPT2Config's default end-of-text id would lie outside the vocabulary
        out.update(bos_token_id=None, eos_token_id=None)
    return out


def _decoder_hf_fields(cfg: ModelConfig) -> dict:
    """The LlamaConfig fields of a Llama-style ModelConfig as a config.json dict, with the Mixtral / Qwen2-MoE fields
    in place of the bias switches for an MoE model."""
    rope = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling and _rope_type(cfg.rope_scaling) != "default":
        rope = {**cfg.rope_scaling, "rope_type": "llama3", "rope_theta": cfg.rope_theta}
        rope.pop("type", None)
    out = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.ffn_hidden_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps,
        # transformers 5 reads rope_parameters; older versions read rope_theta and rope_scaling.
        "rope_parameters": rope,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": None if rope["rope_type"] == "default" else
        {k: v for k, v in rope.items() if k != "rope_theta"},
        "attention_bias": cfg.bias,
        "mlp_bias": cfg.bias,
        "attention_dropout": 0.0,
        "initializer_range": cfg.init_std,
        "tie_word_embeddings": cfg.tie_embeddings,
    }
    if cfg.is_moe:
        for field in ("attention_bias", "mlp_bias"):
            del out[field]
        out.update(moe_config_to_hf(cfg))
    return out
