"""Hugging Face Mixtral and Qwen2-MoE config.json fields <-> tensorpar's mixture-of-experts ModelConfig fields.

    moe_config_from_hf(hf, decoder)   config.json -> ModelConfig (`decoder`: the Llama-style fields already read)
    moe_architecture(cfg)             "mixtral" or "qwen2_moe": what an MoE config exports as
    moe_export_problems(cfg)          why `cfg` has no such equivalent ([] when it has one)
    moe_config_to_hf(cfg)             the MoE fields of the exported config.json

Mixtral (MixtralForCausalLM): every layer an MoE of `num_local_experts` experts of width `intermediate_size`,
softmax top-k renormalised, no biases, no shared experts. Qwen2-MoE (Qwen2MoeForCausalLM): layer i is an MoE
when (i + 1) % decoder_sparse_step == 0 and i is not in mlp_only_layers (else a dense MLP of width
intermediate_size); experts of width moe_intermediate_size, top-k probabilities renormalised only with
norm_topk_prob; a shared expert of width shared_expert_intermediate_size (a multiple of the expert width, as
num_shared_experts experts) scaled by sigmoid(shared_expert_gate x); biases on q/k/v only (qkv_bias).
Sliding-window attention is refused unless its window covers every position the model takes.
"""

from __future__ import annotations

from tensorpar.checkpoints.hf_fields import boolean, non_negative_float, positive_int, unsupported
from tensorpar.models.config import ModelConfig

MOE_MODEL_TYPES = ("mixtral", "qwen2_moe")


def _check_sliding_window(hf: dict, model_type: str, max_positions: int) -> None:
    window = hf.get("sliding_window")
    used = window is not None and (model_type == "mixtral" or boolean(hf, "use_sliding_window", False))
    if model_type == "qwen2_moe" and used and hf.get("layer_types") is not None:
        used = "sliding_attention" in hf["layer_types"]
    if used and (not isinstance(window, int) or 0 < window < max_positions):
        raise unsupported("sliding_window", window, f"sliding-window attention is not supported; a window of at "
                                                    f"least max_position_embeddings ({max_positions}) is accepted")


def _mixtral(hf: dict, decoder: dict) -> ModelConfig:
    width = positive_int(hf, "intermediate_size", 14336)
    jitter = non_negative_float(hf, "router_jitter_noise", 0.0)
    if jitter:
        raise unsupported("router_jitter_noise", jitter, "router input jitter is not supported; use 0")
    experts = positive_int(hf, "num_local_experts", hf.get("num_experts", 8))
    return ModelConfig(**decoder, ffn_hidden_size=width, bias=False, num_experts=experts,
                       experts_per_token=positive_int(hf, "num_experts_per_tok", 2), moe_ffn_hidden_size=width,
                       norm_topk_prob=True, router_aux_loss_coef=non_negative_float(hf, "router_aux_loss_coef", 0.001))


def _qwen2_moe(hf: dict, decoder: dict) -> ModelConfig:
    layers = decoder["num_layers"]
    width = positive_int(hf, "moe_intermediate_size", 1408)
    shared = positive_int(hf, "shared_expert_intermediate_size", 5632)
    if shared % width:
        raise unsupported("shared_expert_intermediate_size", shared, f"tensorpar's shared experts are a multiple "
                                                                     f"of moe_intermediate_size {width} wide")
    step = positive_int(hf, "decoder_sparse_step", 1)
    dense_only = hf.get("mlp_only_layers") or []
    if not isinstance(dense_only, list) or not all(isinstance(i, int) and not isinstance(i, bool)
                                                   for i in dense_only):
        raise unsupported("mlp_only_layers", dense_only, "expected a list of layer indices")
    overlap = sorted(i for i in set(dense_only) if 0 <= i < layers and (i + 1) % step == 0)
    if overlap:
        raise unsupported("mlp_only_layers", dense_only, f"layers {overlap} would be MoE layers under "
                                                         f"decoder_sparse_step={step}; tensorpar places MoE layers "
                                                         f"by decoder_sparse_step alone")
    return ModelConfig(**decoder, ffn_hidden_size=positive_int(hf, "intermediate_size", 5632), bias=False,
                       qkv_bias=boolean(hf, "qkv_bias", True), num_experts=positive_int(hf, "num_experts", 60),
                       experts_per_token=positive_int(hf, "num_experts_per_tok", 4), moe_ffn_hidden_size=width,
                       num_shared_experts=shared // width, shared_expert_gate=True, moe_layer_freq=step,
                       norm_topk_prob=boolean(hf, "norm_topk_prob", False),
                       router_aux_loss_coef=non_negative_float(hf, "router_aux_loss_coef", 0.001))


def moe_config_from_hf(hf: dict, decoder: dict) -> ModelConfig:
    """A ModelConfig from a Mixtral / Qwen2-MoE config.json; `decoder`: its Llama-style fields."""
    model_type = hf["model_type"]
    for field in ("attention_bias", "mlp_bias"):  # Llama's switches, which these models do not read
        if boolean(hf, field, False):
            raise unsupported(field, True, f"{model_type} has no such bias")
    _check_sliding_window(hf, model_type, decoder["max_seq_len"])
    return _mixtral(hf, decoder) if model_type == "mixtral" else _qwen2_moe(hf, decoder)


def moe_architecture(cfg: ModelConfig) -> str:
    """Shared experts make a Qwen2-MoE model, none a Mixtral one."""
    return "qwen2_moe" if cfg.num_shared_experts else "mixtral"


def moe_export_problems(cfg: ModelConfig) -> list[str]:
    """'field=value (needs ...)' for each field `cfg` would have to change to export as `moe_architecture(cfg)`."""
    wanted = dict(bias=False, router_score="softmax", capacity_factor=None)
    if moe_architecture(cfg) == "mixtral":
        wanted.update(qkv_bias_effective=False, norm_topk_prob=True, moe_layer_freq=1)
    else:
        wanted.update(shared_expert_gate=True)
    actual = dict(bias=cfg.bias, router_score=cfg.router_score, capacity_factor=cfg.capacity_factor,
                  qkv_bias_effective=cfg.attention_qkv_bias, norm_topk_prob=cfg.norm_topk_prob,
                  moe_layer_freq=cfg.moe_layer_freq, shared_expert_gate=cfg.shared_expert_gate)
    names = {"qkv_bias_effective": "qkv_bias"}
    return [f"{names.get(k, k)}={actual[k]!r} (needs {v!r})" for k, v in wanted.items() if actual[k] != v]


def moe_config_to_hf(cfg: ModelConfig) -> dict:
    """The architecture and MoE fields of the config.json of `cfg` (checked by `moe_export_problems`)."""
    common = dict(num_experts_per_tok=cfg.experts_per_token, router_aux_loss_coef=cfg.router_aux_loss_coef,
                  output_router_logits=False, sliding_window=None)
    if moe_architecture(cfg) == "mixtral":
        return dict(common, architectures=["MixtralForCausalLM"], model_type="mixtral",
                    num_local_experts=cfg.num_experts, intermediate_size=cfg.expert_ffn_size, router_jitter_noise=0.0)
    return dict(common, architectures=["Qwen2MoeForCausalLM"], model_type="qwen2_moe", num_experts=cfg.num_experts,
                intermediate_size=cfg.ffn_hidden_size, moe_intermediate_size=cfg.expert_ffn_size,
                shared_expert_intermediate_size=cfg.num_shared_experts * cfg.expert_ffn_size,
                decoder_sparse_step=cfg.moe_layer_freq, mlp_only_layers=[], norm_topk_prob=cfg.norm_topk_prob,
                qkv_bias=cfg.attention_qkv_bias, use_sliding_window=False)
