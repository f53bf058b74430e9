"""config.json <-> ModelConfig for the Llama-style families (`tensorpar.checkpoints.hf_families`: Llama, Mistral,
Qwen2 / Qwen2.5, Qwen3, Qwen3-MoE's decoder, Gemma 2, Gemma 3 text, Phi-3, OLMo 2; the decoder of Mixtral and
Qwen2-MoE too).

    decoder_fields(hf, model_type)    the ModelConfig fields of a config.json's decoder (sizes, norms, attention,
                                      biases, windows, RoPE), each field read as its config class reads it and
                                      refused, naming it, when tensorpar cannot compute what it asks for
    decoder_export_problems(cfg)      why `cfg` has no equivalent in its family's architecture ([] if it has)
    decoder_config_to_hf(cfg)         the config.json fields of the decoder

RoPE parameters come as transformers 5 writes them (`rope_parameters`, per layer type for Gemma 3) or as earlier
versions did (top-level `rope_theta`, `rope_scaling`, Gemma 3's `rope_local_base_freq`); Phi-3's "su" and "yarn"
types are its longrope, as its config class makes them.
"""

from __future__ import annotations

import warnings

from tensorpar.checkpoints.hf_families import DECODER, FAMILIES, family_of
from tensorpar.checkpoints.hf_fields import boolean, positive_float, positive_int, unsupported
from tensorpar.functional.rope import ROPE_TYPES, rope_type, scaling_problems
from tensorpar.models.config import LAYER_TYPES, ModelConfig

_FLOATS = ("factor", "low_freq_factor", "high_freq_factor", "attention_factor", "beta_fast", "beta_slow", "mscale",
           "mscale_all_dim")


def _dict_field(hf: dict, field: str) -> dict:
    value = hf.get(field) or {}
    if not isinstance(value, dict):
        raise unsupported(field, value, "expected a JSON object")
    return value


def _rope_sources(hf: dict, fam) -> tuple[dict, dict, str]:
    """(the global RoPE parameters, the sliding layers' (Gemma 3), the field they came from)."""
    params, legacy = _dict_field(hf, "rope_parameters"), _dict_field(hf, "rope_scaling")
    local = {}
    if any(isinstance(v, dict) for v in params.values()):
        if not fam.local_rope:
            raise unsupported("rope_parameters", sorted(params), "per-layer-type RoPE parameters are not supported")
        others = sorted(set(params) - set(LAYER_TYPES))
        if others:
            raise unsupported("rope_parameters", others, f"layer types other than {', '.join(LAYER_TYPES)}")
        params, local = params.get("full_attention") or {}, params.get("sliding_attention") or {}
    if rope_type(params) == "default" and rope_type(legacy) != "default":
        return {**legacy, **{k: v for k, v in params.items() if k in ("rope_theta", "partial_rotary_factor")}}, \
            local, "rope_scaling"
    return params, local, "rope_parameters"


def _scaling(source: dict, field: str, hf: dict, fam, max_positions: int) -> dict | None:
    """The rope_scaling of a ModelConfig from a RoPE parameters dict (None for the default type)."""
    kind = fam.rope_aliases.get(rope_type(source), rope_type(source))  # as Phi3Config reads "su" and "yarn"
    if kind == "default":
        return None
    supported = fam.rope_types or ROPE_TYPES
    if kind not in supported:
        raise unsupported(f"{field}.rope_type", kind, f"supported: {', '.join(supported)}")
    scaling = {k: v for k, v in source.items() if k not in ("type", "rope_type", "rope_theta", "partial_rotary_factor")}
    scaling["rope_type"] = kind
    for name in _FLOATS:
        if scaling.get(name) is not None:
            scaling[name] = positive_float(scaling, name)
    if kind in ("llama3", "yarn", "longrope"):
        # As transformers: Phi-3's top-level original length first, else the dict's, else the model's own.
        original = hf.get("original_max_position_embeddings") if fam.rope_aliases else None
        original = original or scaling.get("original_max_position_embeddings") or \
            hf.get("original_max_position_embeddings", max_positions)
        scaling["original_max_position_embeddings"] = positive_int({"original_max_position_embeddings": original},
                                                                   "original_max_position_embeddings")
    return scaling


def _rope(hf: dict, fam, max_positions: int, head_dim: int) -> dict:
    """rope_theta, rope_scaling, rope_local_theta and partial_rotary_factor of a config.json."""
    params, local, field = _rope_sources(hf, fam)
    theta = positive_float({"rope_theta": params.get("rope_theta", hf.get("rope_theta", fam.defaults["rope_theta"]))},
                           "rope_theta")
    partial = params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):
        if not fam.partial_rope:
            raise unsupported("partial_rotary_factor", partial, f"{fam.model_type} rotates whole heads")
        if not (isinstance(partial, (int, float)) and 0 < partial <= 1):
            raise unsupported("partial_rotary_factor", partial, "expected a number in (0, 1]")
    partial = 1.0 if partial is None else float(partial)
    scaling = _scaling(params, field, hf, fam, max_positions)
    problems = scaling_problems(scaling, int(head_dim * partial))
    if problems:
        raise unsupported(f"{field}.rope_type", rope_type(scaling), problems[0])
    local_theta = None
    if fam.local_rope:
        if rope_type(local) != "default":
            raise unsupported("rope_parameters.sliding_attention.rope_type", rope_type(local),
                              "the sliding layers' RoPE is supported unscaled (default) only")
        local_theta = positive_float({"rope_local_base_freq": local.get(
            "rope_theta", hf.get("rope_local_base_freq", fam.defaults["rope_local_base_freq"]))},
            "rope_local_base_freq")
    return dict(rope_theta=theta, rope_scaling=scaling, rope_local_theta=local_theta, partial_rotary_factor=partial)


def _windows(hf: dict, fam, layers: int) -> dict:
    """sliding_window and layer_types (None when every layer is alike) of a config.json."""
    kind = fam.windows
    if kind == "none":
        return dict(sliding_window=None, layer_types=None)
    window = hf.get("sliding_window", fam.defaults.get("sliding_window"))
    if kind in ("switched", "qwen") and not boolean(hf, "use_sliding_window", False):
        window = None
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise unsupported("sliding_window", window, "expected a positive integer or null")
    types = hf.get("layer_types") if kind in ("qwen", "alternating") else None
    if types is None and kind == "qwen":
        first = hf.get("max_window_layers", fam.defaults["max_window_layers"])
        types = ["sliding_attention" if window is not None and i >= first else "full_attention" for i in range(layers)]
    if types is None and kind == "alternating":
        pattern = positive_int(hf, "sliding_window_pattern", fam.defaults["sliding_window_pattern"])
        types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)]
    if types is not None and (not isinstance(types, list) or len(types) != layers or not set(types) <= set(LAYER_TYPES)):
        raise unsupported("layer_types", types, f"expected one of {', '.join(LAYER_TYPES)} for each of the {layers} "
                                                f"layers")
    if window is None or (types is not None and "sliding_attention" not in types):
        return dict(sliding_window=None, layer_types=None)
    uniform = types is None or set(types) == {"sliding_attention"}
    return dict(sliding_window=window, layer_types=None if uniform else tuple(types))


def _biases(hf: dict, fam) -> dict:
    """bias (the output projection's), qkv_bias and mlp_bias, canonical: None where they follow `bias`."""
    if fam.biases == "qkv":
        return dict(bias=False, qkv_bias=True, mlp_bias=None)
    if fam.biases == "none":
        return dict(bias=False, qkv_bias=None, mlp_bias=None)
    attention = boolean(hf, "attention_bias", False)
    mlp = boolean(hf, "mlp_bias", False) if fam.biases == "llama" else False
    return dict(bias=attention, qkv_bias=None, mlp_bias=None if mlp == attention else mlp)


def _scores(hf: dict, fam) -> dict:
    """Gemma's query_pre_attn_scalar and soft caps (None / none for the other families)."""
    if not fam.scores:
        return {}
    caps = {}
    for ours, theirs in (("attn_logit_softcap", "attn_logit_softcapping"),
                         ("final_logit_softcap", "final_logit_softcapping")):
        value = hf.get(theirs, fam.defaults.get(theirs))
        if theirs in fam.unused and value is not None:
            warnings.warn(f"config.json's {theirs}={value!r} is not applied: transformers' {fam.architecture} never "
                          f"applies it, and tensorpar computes what transformers computes", UserWarning, stacklevel=2)
            value = None
        caps[ours] = None if value is None else positive_float({theirs: value}, theirs)
    return dict(caps, query_pre_attn_scalar=positive_float(hf, "query_pre_attn_scalar",
                                                           fam.defaults["query_pre_attn_scalar"]))


def decoder_fields(hf: dict, model_type: str) -> dict:
    """The ModelConfig fields of the decoder of a config.json of `model_type` (a Llama-style family; Mixtral and
    Qwen2-MoE give family "llama"); dropout is 0."""
    fam = FAMILIES[model_type]
    defaults = fam.defaults
    hidden = positive_int(hf, "hidden_size", defaults["hidden_size"])
    heads = positive_int(hf, "num_attention_heads", defaults["num_attention_heads"])
    kv_heads = hf.get("num_key_value_heads", defaults["num_key_value_heads"])
    kv_heads = heads if kv_heads is None else positive_int({"num_key_value_heads": kv_heads}, "num_key_value_heads")
    act = hf.get(fam.activation_field, defaults[fam.activation_field])
    if act not in fam.activations:
        raise unsupported(fam.activation_field, act, f"{model_type}'s gated MLP is supported with "
                                                     f"{', '.join(fam.activations)}")
    head_dim = hf.get("head_dim", defaults.get("head_dim"))
    if head_dim is None or head_dim == (hidden // heads if hidden % heads == 0 else None):
        if hidden % heads:
            raise unsupported("hidden_size", hidden, f"not divisible by num_attention_heads {heads} (and no head_dim)")
        head_dim = None
    else:
        head_dim = positive_int({"head_dim": head_dim}, "head_dim")
        if head_dim % 2:
            raise unsupported("head_dim", head_dim, "RoPE needs an even head dimension")
    if heads % kv_heads:
        raise unsupported("num_key_value_heads", kv_heads, f"does not divide num_attention_heads {heads}")
    if hf.get("use_bidirectional_attention"):
        raise unsupported("use_bidirectional_attention", True, "tensorpar's decoders attend causally")
    layers = positive_int(hf, "num_hidden_layers", defaults["num_hidden_layers"])
    max_positions = positive_int(hf, "max_position_embeddings", defaults["max_position_embeddings"])
    fields = dict(
        DECODER, **fam.fixed,
        family="llama" if model_type in ("mixtral", "qwen2_moe") else model_type,
        vocab_size=positive_int(hf, "vocab_size", defaults["vocab_size"]),
        hidden_size=hidden, num_layers=layers, num_heads=heads, num_kv_heads=kv_heads, head_size=head_dim,
        max_seq_len=max_positions, norm_eps=positive_float(hf, "rms_norm_eps", defaults["rms_norm_eps"]),
        activation=fam.activations[act], tie_embeddings=boolean(hf, "tie_word_embeddings", defaults["tie_word_embeddings"]),
        dropout=0.0,
    )
    fields.update(_rope(hf, fam, max_positions, head_dim or hidden // heads))
    fields.update(_windows(hf, fam, layers))
    fields.update(_biases(hf, fam))
    fields.update(_scores(hf, fam))
    if fam.scaled_embedding:
        fields["embedding_multiplier"] = hidden ** 0.5  # as transformers computes it
    return fields


def intermediate_size(hf: dict, model_type: str) -> int:
    """The MLP width of a config.json of `model_type` (its config class's default when left out)."""
    return positive_int(hf, "intermediate_size", FAMILIES[model_type].defaults["intermediate_size"])


def decoder_export_problems(cfg: ModelConfig) -> list[str]:
    """'field=value (needs ...)' for each field `cfg` would have to change to have an equivalent in its family."""
    fam = family_of(cfg)
    wanted = {**DECODER, **fam.fixed}
    bad = [f"{k}={getattr(cfg, k)!r} (needs {v!r})" for k, v in wanted.items() if getattr(cfg, k) != v]
    if cfg.is_mla:
        bad.append(f"kv_lora_rank={cfg.kv_lora_rank!r} (needs None: latent attention exports as deepseek_v3)")
    if cfg.activation not in fam.activations.values():
        bad.append(f"activation={cfg.activation!r} (needs one of {sorted(set(fam.activations.values()))})")
    qkv, o, mlp = cfg.attention_qkv_bias, cfg.bias, cfg.mlp_has_bias
    wanted_biases = {"qkv": (True, False, False), "none": (False, False, False), "attention": (o, o, False),
                     "llama": (o, o, mlp)}[fam.biases]
    if fam.model_type == "qwen2_moe":  # Qwen2MoeConfig.qkv_bias switches its q/k/v biases (default on)
        wanted_biases = (qkv, False, False)
    for name, have, need in zip(("qkv_bias", "bias", "mlp_bias"), (qkv, o, mlp), wanted_biases):
        if have != need:
            bad.append(f"{name}={have!r} (needs {need!r})")
    if fam.windows == "none" and cfg.sliding_window is not None:
        bad.append(f"sliding_window={cfg.sliding_window!r} (needs None)")
    if fam.windows in ("uniform", "switched") and cfg.layer_types is not None:
        bad.append("layer_types (needs every layer alike)")
    if fam.local_rope and cfg.rope_local_theta is None and cfg.rope_scaling:
        bad.append("rope_local_theta=None (needs the sliding layers' own, unscaled base)")
    if fam.rope_types and rope_type(cfg.rope_scaling) not in fam.rope_types:
        bad.append(f"rope_scaling={rope_type(cfg.rope_scaling)!r} (needs one of {', '.join(fam.rope_types)})")
    if "attn_logit_softcapping" in fam.unused and cfg.attn_logit_softcap is not None:
        bad.append(f"attn_logit_softcap={cfg.attn_logit_softcap!r} (needs None: {fam.architecture} does not apply one)")
    if fam.scaled_embedding and cfg.embedding_multiplier != cfg.hidden_size ** 0.5:
        bad.append(f"embedding_multiplier={cfg.embedding_multiplier!r} (needs sqrt(hidden_size))")
    return bad


def _rope_parameters(cfg: ModelConfig) -> dict:
    rope = {"rope_type": "default", **(cfg.rope_scaling or {}), "rope_theta": cfg.rope_theta}
    rope.pop("type", None)
    if cfg.partial_rotary_factor != 1.0:
        rope["partial_rotary_factor"] = cfg.partial_rotary_factor
    return rope


def decoder_config_to_hf(cfg: ModelConfig) -> dict:
    """The config.json fields of the decoder of a Llama-style `cfg` (checked by `decoder_export_problems`)."""
    fam = family_of(cfg)
    rope = _rope_parameters(cfg)
    out = {
        "architectures": [fam.architecture], "model_type": fam.model_type, "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size, "intermediate_size": cfg.ffn_hidden_size, "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.kv_heads, "head_dim": cfg.head_dim,
        fam.activation_field: next(k for k, v in fam.activations.items() if v == cfg.activation),
        "max_position_embeddings": cfg.max_seq_len, "rms_norm_eps": cfg.norm_eps,
        # transformers 5 reads rope_parameters; earlier versions read rope_theta and rope_scaling.
        "rope_parameters": rope, "rope_theta": cfg.rope_theta,
        "rope_scaling": None if rope["rope_type"] == "default" else {k: v for k, v in rope.items() if k != "rope_theta"},
        "attention_dropout": 0.0, "initializer_range": cfg.init_std, "tie_word_embeddings": cfg.tie_embeddings,
    }
    if fam.local_rope:
        local = {"rope_type": "default", "rope_theta": cfg.rope_local_theta or cfg.rope_theta}
        out.update(rope_parameters={"full_attention": rope, "sliding_attention": local},
                   rope_local_base_freq=local["rope_theta"])
    if fam.partial_rope:
        out["partial_rotary_factor"] = cfg.partial_rotary_factor
        if cfg.rope_scaling and "original_max_position_embeddings" in cfg.rope_scaling:
            out["original_max_position_embeddings"] = cfg.rope_scaling["original_max_position_embeddings"]
    if fam.biases in ("llama", "attention"):
        out["attention_bias"] = cfg.bias
    if fam.biases == "llama":
        out["mlp_bias"] = cfg.mlp_has_bias
    if fam.windows != "none":
        out["sliding_window"] = cfg.sliding_window
        if fam.windows in ("switched", "qwen"):
            out["use_sliding_window"] = cfg.sliding_window is not None
        if fam.windows in ("qwen", "alternating"):
            out["layer_types"] = [cfg.layer_type(i) for i in range(cfg.num_layers)]
        if fam.windows == "qwen":
            out["max_window_layers"] = cfg.num_layers
    if fam.scores:
        scalar = cfg.query_pre_attn_scalar
        out.update(query_pre_attn_scalar=int(scalar) if scalar == int(scalar) else scalar,
                   attn_logit_softcapping=cfg.attn_logit_softcap,
                   final_logit_softcapping=cfg.final_logit_softcap)
    return out
