"""Hugging Face DeepSeek-V3 (`deepseek_v3`, also Kimi K2's shape) and GLM-4.5 (`glm4_moe`) config.json fields <->
tensorpar's ModelConfig (the tensors: `tensorpar.checkpoints.hf_deepseek`).

    deepseek_config_from_hf(hf)      config.json -> ModelConfig (refuses what the model cannot compute)
    deepseek_export_problems(cfg)    why `cfg` has no DeepseekV3ForCausalLM / Glm4MoeForCausalLM equivalent
    deepseek_config_to_hf(cfg)       ModelConfig -> a config.json dict transformers loads

Both families: layers first_k_dense_replace.. are MoE layers of n_routed_experts experts of width
moe_intermediate_size (sigmoid scores, the `e_score_correction_bias` that chooses, group-limited top-k,
routed_scaling_factor, norm_topk_prob) plus n_shared_experts experts every token uses; the first layers are dense
MLPs of intermediate_size. DeepSeek-V3's attention is multi-head latent attention (q_lora_rank, kv_lora_rank,
qk_nope/rope_head_dim, v_head_dim; rope_interleave: DeepSeek's weights lay the rotary dimensions out in pairs) with
YaRN as its rope_parameters say; GLM-4.5's is grouped-query attention with q/k/v biases (attention_bias), heads of
head_dim (`head_size`), per-head query and key norms when use_qk_norm (`qk_norm="head"`) and RoPE on the first
partial_rotary_factor of each head. num_nextn_predict_layers multi-token prediction modules are read
when the folder holds their weights (transformers writes none: then 0). The balancing bias's update speed is not a
Hugging Face field: imported models take DeepSeek-V3's 0.001 (it acts in training only).
"""

from __future__ import annotations

from tensorpar.checkpoints.hf_families import PLAIN
from tensorpar.checkpoints.hf_fields import boolean, non_negative_float, positive_float, positive_int, unsupported
from tensorpar.models.config import ModelConfig

DEEPSEEK_MODEL_TYPES = ("deepseek_v3", "glm4_moe")
ARCHITECTURES = {"deepseek_v3": "DeepseekV3ForCausalLM", "glm4_moe": "Glm4MoeForCausalLM"}
BIAS_UPDATE_SPEED = 0.001  # DeepSeek-V3's gamma for most of its pre-training (technical report, section 4.2)
_YARN_FIELDS = ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale", "mscale_all_dim",
                "attention_factor", "truncate")
# DeepseekV3Config's and Glm4MoeConfig's defaults, for config.json files that leave fields out.
_DEFAULTS = {
    "deepseek_v3": dict(vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
                        num_hidden_layers=61, num_attention_heads=128, n_shared_experts=1, n_routed_experts=256,
                        routed_scaling_factor=2.5, n_group=8, topk_group=4, num_experts_per_tok=8,
                        first_k_dense_replace=3, max_position_embeddings=4096, rms_norm_eps=1e-6, rope_theta=10000.0,
                        partial_rotary_factor=1.0),
    "glm4_moe": dict(vocab_size=151552, hidden_size=4096, intermediate_size=10944, moe_intermediate_size=1408,
                     num_hidden_layers=46, num_attention_heads=96, n_shared_experts=1, n_routed_experts=128,
                     routed_scaling_factor=1.0, n_group=1, topk_group=1, num_experts_per_tok=8,
                     first_k_dense_replace=1, max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=10000.0,
                     partial_rotary_factor=0.5),
}


def _count(hf: dict, field: str, default: int, minimum: int = 0) -> int:
    value = hf.get(field, default)
    value = default if value is None else value
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise unsupported(field, value, f"expected an integer >= {minimum}")
    return value


def _rope(hf: dict, model_type: str) -> tuple[float, dict | None, float]:
    """(rope_theta, rope_scaling, partial_rotary_factor) from `rope_parameters` (transformers 5) or the older
    top-level rope_theta / rope_scaling."""
    params, legacy = hf.get("rope_parameters") or {}, hf.get("rope_scaling") or {}
    for field, d in (("rope_parameters", params), ("rope_scaling", legacy)):
        if not isinstance(d, dict) or any(isinstance(v, dict) for v in d.values()):
            raise unsupported(field, d, "expected one JSON object of RoPE parameters")
    merged = {**legacy, **params}
    default = _DEFAULTS[model_type]
    theta = positive_float({"rope_theta": merged.get("rope_theta", hf.get("rope_theta", default["rope_theta"]))},
                           "rope_theta")
    partial = merged.get("partial_rotary_factor", hf.get("partial_rotary_factor", default["partial_rotary_factor"]))
    partial = positive_float({"partial_rotary_factor": partial}, "partial_rotary_factor")
    kind = merged.get("rope_type", merged.get("type")) or "default"
    if kind == "default":
        return theta, None, partial
    if kind != "yarn":
        raise unsupported("rope_parameters.rope_type", kind, f"{model_type} is supported with default or yarn RoPE")
    scaling = {"rope_type": "yarn", "factor": positive_float(merged, "factor"),
               "original_max_position_embeddings": positive_int(merged, "original_max_position_embeddings")}
    for field in _YARN_FIELDS[2:]:
        if merged.get(field) is not None:
            scaling[field] = merged[field] if field == "truncate" else non_negative_float(merged, field, 0.0)
    return theta, scaling, partial


def _attention(hf: dict, model_type: str, hidden: int, heads: int) -> dict:
    """The attention's ModelConfig fields: latent attention (DeepSeek-V3) or grouped-query attention (GLM-4.5)."""
    kv_heads = _count(hf, "num_key_value_heads", heads, 1)
    if model_type == "deepseek_v3":
        if kv_heads != heads:
            raise unsupported("num_key_value_heads", kv_heads, f"latent attention has one key per head ({heads})")
        if boolean(hf, "attention_bias", False):
            raise unsupported("attention_bias", True, "DeepSeek-V3's projections have no biases")
        q_rank = hf.get("q_lora_rank", 1536)
        return dict(num_kv_heads=heads, q_lora_rank=None if q_rank is None else positive_int(hf, "q_lora_rank"),
                    kv_lora_rank=positive_int(hf, "kv_lora_rank", 512),
                    qk_nope_head_dim=positive_int(hf, "qk_nope_head_dim", 128),
                    qk_rope_head_dim=positive_int(hf, "qk_rope_head_dim", 64),
                    v_head_dim=positive_int(hf, "v_head_dim", 128),
                    rope_interleave=boolean(hf, "rope_interleave", True), bias=False)
    head_dim = hf.get("head_dim")
    head_size = None if head_dim is None or head_dim * heads == hidden else positive_int(hf, "head_dim")
    if heads % kv_heads:
        raise unsupported("num_key_value_heads", kv_heads, f"does not divide num_attention_heads {heads}")
    return dict(num_kv_heads=kv_heads, qkv_bias=boolean(hf, "attention_bias", False), bias=False, head_size=head_size,
                qk_norm="head" if boolean(hf, "use_qk_norm", False) else "none")


def _routing(hf: dict, model_type: str, layers: int) -> dict:
    """The mixture of experts' ModelConfig fields."""
    d = _DEFAULTS[model_type]
    for field, wanted in (("topk_method", "noaux_tc"), ("scoring_func", "sigmoid"), ("moe_layer_freq", 1)):
        if hf.get(field, wanted) != wanted:
            raise unsupported(field, hf[field], f"tensorpar's {model_type} routing is {field}={wanted!r}")
    experts = positive_int(hf, "n_routed_experts", d["n_routed_experts"])
    shared = positive_int(hf, "n_shared_experts", d["n_shared_experts"])
    aux = non_negative_float(hf, "aux_loss_alpha", 0.0) if boolean(hf, "seq_aux", True) else 0.0
    return dict(num_experts=experts, experts_per_token=positive_int(hf, "num_experts_per_tok", d["num_experts_per_tok"]),
                moe_ffn_hidden_size=positive_int(hf, "moe_intermediate_size", d["moe_intermediate_size"]),
                num_shared_experts=shared, router_score="sigmoid",
                norm_topk_prob=boolean(hf, "norm_topk_prob", True),
                routed_scaling_factor=positive_float(hf, "routed_scaling_factor", d["routed_scaling_factor"]),
                n_group=_count(hf, "n_group", d["n_group"], 1), topk_group=_count(hf, "topk_group", d["topk_group"], 1),
                first_k_dense_replace=min(_count(hf, "first_k_dense_replace", d["first_k_dense_replace"]), layers),
                expert_bias=True, bias_update_speed=BIAS_UPDATE_SPEED, router_aux_loss_coef=aux)


def deepseek_config_from_hf(hf: dict) -> ModelConfig:
    """A ModelConfig from a DeepSeek-V3 or GLM-4.5 config.json (`num_mtp_layers` as the config says: the folder's
    reader sets 0 when it holds no module weights)."""
    model_type = hf["model_type"]
    d = _DEFAULTS[model_type]
    hidden = positive_int(hf, "hidden_size", d["hidden_size"])
    heads = positive_int(hf, "num_attention_heads", d["num_attention_heads"])
    layers = positive_int(hf, "num_hidden_layers", d["num_hidden_layers"])
    if hf.get("hidden_act", "silu") != "silu":
        raise unsupported("hidden_act", hf["hidden_act"], f"{model_type}'s gated MLP is supported with silu only")
    if hidden % heads and (model_type == "deepseek_v3" or hf.get("head_dim") is None):
        raise unsupported("hidden_size", hidden, f"not divisible by num_attention_heads {heads} (and no head_dim)")
    theta, scaling, partial = _rope(hf, model_type)
    if model_type == "deepseek_v3" and partial != 1.0:
        raise unsupported("partial_rotary_factor", partial, "latent attention's rotary part is qk_rope_head_dim")
    return ModelConfig(
        family=model_type, vocab_size=positive_int(hf, "vocab_size", d["vocab_size"]), hidden_size=hidden,
        num_layers=layers, num_heads=heads, ffn_hidden_size=positive_int(hf, "intermediate_size",
                                                                         d["intermediate_size"]),
        max_seq_len=positive_int(hf, "max_position_embeddings", d["max_position_embeddings"]), norm="rmsnorm",
        norm_eps=positive_float(hf, "rms_norm_eps", d["rms_norm_eps"]), activation="silu", gated_mlp=True,
        position="rope", rope_theta=theta, rope_scaling=scaling, partial_rotary_factor=partial,
        tie_embeddings=boolean(hf, "tie_word_embeddings", False), dropout=0.0,
        num_mtp_layers=_count(hf, "num_nextn_predict_layers", hf.get("num_mtp_layers", 0) or 0),
        **_attention(hf, model_type, hidden, heads), **_routing(hf, model_type, layers))


def deepseek_export_problems(cfg: ModelConfig) -> list[str]:
    """'field=value (needs ...)' for each field `cfg` would have to change to export as its family's architecture."""
    wanted = dict(PLAIN, norm="rmsnorm", position="rope", gated_mlp=True, activation="silu", bias=False,
                  mlp_bias_effective=False, router_score="sigmoid", expert_bias=True, moe_layer_freq=1,
                  capacity_factor=None, shared_expert_gate=False, is_moe=True, has_shared_experts=True,
                  sliding_window=None, mlp_only_layers=(), is_mla=cfg.family == "deepseek_v3")
    del wanted["partial_rotary_factor"]  # GLM-4.5's own; latent attention refuses another than 1 anyway
    if cfg.family == "deepseek_v3":
        wanted["qkv_bias_effective"] = False
    elif cfg.qk_norm in ("none", "head"):  # GLM-4.5's use_qk_norm: each head's
        del wanted["qk_norm"]
    else:
        wanted["qk_norm"] = "none or head"
    rope_type = (cfg.rope_scaling or {}).get("rope_type", (cfg.rope_scaling or {}).get("type")) or "default"
    if rope_type not in ("default", "yarn"):
        wanted["rope_type"] = "default or yarn"
    actual = {k: getattr(cfg, k) for k in PLAIN}
    actual.update(norm=cfg.norm, position=cfg.position, gated_mlp=cfg.gated_mlp, activation=cfg.activation,
                  bias=cfg.bias, mlp_bias_effective=cfg.mlp_has_bias, router_score=cfg.router_score,
                  expert_bias=cfg.expert_bias, moe_layer_freq=cfg.moe_layer_freq, capacity_factor=cfg.capacity_factor,
                  shared_expert_gate=cfg.shared_expert_gate, is_moe=cfg.is_moe,
                  has_shared_experts=cfg.num_shared_experts > 0, sliding_window=cfg.sliding_window,
                  mlp_only_layers=cfg.mlp_only_layers, is_mla=cfg.is_mla, qkv_bias_effective=cfg.attention_qkv_bias,
                  rope_type=rope_type)
    return [f"{k.removesuffix('_effective')}={actual[k]!r} (needs {v!r})" for k, v in wanted.items() if actual[k] != v]


def deepseek_config_to_hf(cfg: ModelConfig) -> dict:
    """The config.json dict of a DeepSeek-V3 / GLM-4.5 ModelConfig (checked by `deepseek_export_problems`)."""
    rope = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling:
        rope = {**{k: v for k, v in cfg.rope_scaling.items() if k != "type"}, "rope_type": "yarn",
                "rope_theta": cfg.rope_theta}
    out = {
        "architectures": [ARCHITECTURES[cfg.family]], "model_type": cfg.family, "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size, "intermediate_size": cfg.ffn_hidden_size,
        "moe_intermediate_size": cfg.expert_ffn_size, "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.kv_heads, "hidden_act": "silu",
        "max_position_embeddings": cfg.max_seq_len, "rms_norm_eps": cfg.norm_eps, "rope_parameters": rope,
        "tie_word_embeddings": cfg.tie_embeddings, "initializer_range": cfg.init_std, "attention_dropout": 0.0,
        "n_routed_experts": cfg.num_experts, "num_experts_per_tok": cfg.experts_per_token,
        "n_shared_experts": cfg.num_shared_experts, "routed_scaling_factor": cfg.routed_scaling_factor,
        "n_group": cfg.n_group, "topk_group": cfg.topk_group, "first_k_dense_replace": cfg.first_k_dense_replace,
        "norm_topk_prob": cfg.norm_topk_prob, "num_nextn_predict_layers": cfg.num_mtp_layers,
        "bos_token_id": None, "eos_token_id": None,
    }
    if cfg.family == "deepseek_v3":
        out.update(q_lora_rank=cfg.q_lora_rank, kv_lora_rank=cfg.kv_lora_rank, qk_nope_head_dim=cfg.qk_nope_head_dim,
                   qk_rope_head_dim=cfg.qk_rope_head_dim, v_head_dim=cfg.v_head_dim,
                   rope_interleave=cfg.rope_interleave, attention_bias=False)
    else:
        rope["partial_rotary_factor"] = cfg.partial_rotary_factor
        out.update(head_dim=cfg.head_dim, attention_bias=cfg.attention_qkv_bias, use_qk_norm=cfg.qk_norm == "head")
    return out
