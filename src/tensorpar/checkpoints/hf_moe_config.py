"""Hugging Face Mixtral, Qwen2-MoE and Qwen3-MoE config.json fields <-> tensorpar's mixture-of-experts ModelConfig
fields.

    moe_config_from_hf(hf, decoder)   config.json -> ModelConfig (`decoder`: the Llama-style fields already read)
    moe_architecture(cfg)             "mixtral", "qwen2_moe" or "qwen3_moe": what an MoE config exports as
    moe_export_problems(cfg)          why `cfg` has no such equivalent ([] when it has one)
    moe_config_to_hf(cfg)             the MoE fields of the exported config.json

Mixtral (MixtralForCausalLM): every layer an MoE of `num_local_experts` experts of width `intermediate_size`,
softmax top-k renormalised, no biases, no shared experts. Qwen2-MoE (Qwen2MoeForCausalLM): layer i is an MoE
when (i + 1) % decoder_sparse_step == 0 and i is not in mlp_only_layers (else a dense MLP of width
intermediate_size); experts of width moe_intermediate_size, top-k probabilities renormalised only with
norm_topk_prob; a shared expert of width shared_expert_intermediate_size (a multiple of the expert width, as
num_shared_experts experts) scaled by sigmoid(shared_expert_gate x); biases on q/k/v only (qkv_bias).
Qwen3-MoE (Qwen3MoeForCausalLM, family "qwen3_moe"): Qwen3's decoder (qk-norm, its own head_dim), MoE layers as
Qwen2-MoE's (decoder_sparse_step, mlp_only_layers, norm_topk_prob) without a shared expert.
Mixtral's and Qwen2-MoE's sliding-window attention is refused unless its window covers every position the model
takes (Qwen3-MoE's is read with its decoder).
"""

from __future__ import annotations

from tensorpar.checkpoints.hf_fields import boolean, non_negative_float, positive_int, unsupported
from tensorpar.models.config import ModelConfig

MOE_MODEL_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe")


def _check_sliding_window(hf: dict, model_type: str, max_positions: int) -> None:
    window = hf.get("sliding_window")
    used = window is not None and (model_type == "mixtral" or boolean(hf, "use_sliding_window", False))
    if model_type == "qwen2_moe" and used and hf.get("layer_types") is not None:
        used = "sliding_attention" in hf["layer_types"]
    if used and (not isinstance(window, int) or 0 < window < max_positions):
        raise unsupported("sliding_window", window, f"{model_type}'s sliding-window attention is not supported; a "
                                                    f"window of at least max_position_embeddings ({max_positions}) "
                                                    f"is accepted")


def _router_aux(hf: dict) -> float:
    """The load-balancing loss's coefficient: config.json's, where `output_router_logits` makes transformers add the
    loss in training, else 0 (transformers trains without it: its default)."""
    coef = non_negative_float(hf, "router_aux_loss_coef", 0.001)
    return coef if boolean(hf, "output_router_logits", False) else 0.0


def _mixtral(hf: dict, decoder: dict) -> ModelConfig:
    width = positive_int(hf, "intermediate_size", 14336)
    jitter = non_negative_float(hf, "router_jitter_noise", 0.0)
    if jitter:
        raise unsupported("router_jitter_noise", jitter, "router input jitter is not supported; use 0")
    experts = positive_int(hf, "num_local_experts", hf.get("num_experts", 8))
    return ModelConfig(**decoder, ffn_hidden_size=width, num_experts=experts,
                       experts_per_token=positive_int(hf, "num_experts_per_tok", 2), moe_ffn_hidden_size=width,
                       norm_topk_prob=True, router_aux_loss_coef=_router_aux(hf))


def _dense_layers(hf: dict, layers: int) -> tuple[int, ...]:
    dense_only = hf.get("mlp_only_layers") or []
    if not isinstance(dense_only, list) or not all(isinstance(i, int) and not isinstance(i, bool)
                                                   for i in dense_only):
        raise unsupported("mlp_only_layers", dense_only, "expected a list of layer indices")
    return tuple(sorted({i for i in dense_only if 0 <= i < layers}))


def _qwen_moe(hf: dict, decoder: dict, model_type: str) -> ModelConfig:
    """Qwen2-MoE (a gated shared expert, q/k/v biases) or Qwen3-MoE (no shared expert; its decoder's biases)."""
    layers = decoder["num_layers"]
    qwen3 = model_type == "qwen3_moe"
    width = positive_int(hf, "moe_intermediate_size", 768 if qwen3 else 1408)
    step = positive_int(hf, "decoder_sparse_step", 1)
    shared = {}
    if not qwen3:
        shared_width = positive_int(hf, "shared_expert_intermediate_size", 5632)
        if shared_width % width:
            raise unsupported("shared_expert_intermediate_size", shared_width, f"tensorpar's shared experts are a "
                                                                               f"multiple of moe_intermediate_size "
                                                                               f"{width} wide")
        shared = dict(num_shared_experts=shared_width // width, shared_expert_gate=True,
                      qkv_bias=boolean(hf, "qkv_bias", True))
    dense = tuple(i for i in _dense_layers(hf, layers) if (i + 1) % step == 0)  # the others are dense anyway
    return ModelConfig(**{**decoder, **shared}, ffn_hidden_size=positive_int(hf, "intermediate_size",
                                                                           6144 if qwen3 else 5632),
                       num_experts=positive_int(hf, "num_local_experts" if "num_local_experts" in hf else "num_experts",
                                                128 if qwen3 else 60),
                       experts_per_token=positive_int(hf, "num_experts_per_tok", 8 if qwen3 else 4),
                       moe_ffn_hidden_size=width, moe_layer_freq=step, mlp_only_layers=dense,
                       norm_topk_prob=boolean(hf, "norm_topk_prob", False),
                       router_aux_loss_coef=_router_aux(hf))


def moe_config_from_hf(hf: dict, decoder: dict) -> ModelConfig:
    """A ModelConfig from a Mixtral / Qwen2-MoE / Qwen3-MoE config.json; `decoder`: its Llama-style fields."""
    model_type = hf["model_type"]
    if model_type == "qwen3_moe":
        return _qwen_moe(hf, decoder, model_type)
    for field in ("attention_bias", "mlp_bias"):  # Llama's switches, which these models do not read
        if boolean(hf, field, False):
            raise unsupported(field, True, f"{model_type} has no such bias")
    _check_sliding_window(hf, model_type, decoder["max_seq_len"])
    return _mixtral(hf, decoder) if model_type == "mixtral" else _qwen_moe(hf, decoder, model_type)


def moe_architecture(cfg: ModelConfig) -> str:
    """A config of family qwen3_moe is Qwen3-MoE; of family llama, shared experts make a Qwen2-MoE model, none a
    Mixtral one."""
    if cfg.family == "qwen3_moe":
        return "qwen3_moe"
    return "qwen2_moe" if cfg.num_shared_experts else "mixtral"


def moe_export_problems(cfg: ModelConfig) -> list[str]:
    """'field=value (needs ...)' for each field `cfg` would have to change to export as `moe_architecture(cfg)`."""
    # dense first layers and scaled routing weights are DeepSeek-V3's; these architectures have neither
    wanted = dict(router_score="softmax", capacity_factor=None, first_k_dense_replace=0, routed_scaling_factor=1.0)
    arch = moe_architecture(cfg)
    if arch == "mixtral":
        wanted.update(bias=False, qkv_bias_effective=False, norm_topk_prob=True, moe_layer_freq=1, mlp_only_layers=())
    elif arch == "qwen2_moe":
        wanted.update(bias=False, shared_expert_gate=True)
    else:
        wanted.update(num_shared_experts=0)
    actual = dict(bias=cfg.bias, router_score=cfg.router_score, capacity_factor=cfg.capacity_factor,
                  qkv_bias_effective=cfg.attention_qkv_bias, norm_topk_prob=cfg.norm_topk_prob,
                  moe_layer_freq=cfg.moe_layer_freq, shared_expert_gate=cfg.shared_expert_gate,
                  mlp_only_layers=cfg.mlp_only_layers, num_shared_experts=cfg.num_shared_experts,
                  first_k_dense_replace=cfg.first_k_dense_replace, routed_scaling_factor=cfg.routed_scaling_factor)
    names = {"qkv_bias_effective": "qkv_bias"}
    return [f"{names.get(k, k)}={actual[k]!r} (needs {v!r})" for k, v in wanted.items() if actual[k] != v]


def moe_config_to_hf(cfg: ModelConfig) -> dict:
    """The architecture and MoE fields of the config.json of `cfg` (checked by `moe_export_problems`)."""
    common = dict(num_experts_per_tok=cfg.experts_per_token, router_aux_loss_coef=cfg.router_aux_loss_coef,
                  output_router_logits=cfg.router_aux_loss_coef > 0, sliding_window=None)
    if moe_architecture(cfg) == "mixtral":
        return dict(common, architectures=["MixtralForCausalLM"], model_type="mixtral",
                    num_local_experts=cfg.num_experts, intermediate_size=cfg.expert_ffn_size, router_jitter_noise=0.0)
    qwen = dict(common, num_experts=cfg.num_experts, intermediate_size=cfg.ffn_hidden_size,
                moe_intermediate_size=cfg.expert_ffn_size, decoder_sparse_step=cfg.moe_layer_freq,
                mlp_only_layers=list(cfg.mlp_only_layers), norm_topk_prob=cfg.norm_topk_prob)
    if moe_architecture(cfg) == "qwen3_moe":  # its decoder's fields (windows included) are the decoder's
        return {k: v for k, v in qwen.items() if k != "sliding_window"}
    return dict(qwen, architectures=["Qwen2MoeForCausalLM"], model_type="qwen2_moe",
                shared_expert_intermediate_size=cfg.num_shared_experts * cfg.expert_ffn_size,
                qkv_bias=cfg.attention_qkv_bias, use_sliding_window=False)
