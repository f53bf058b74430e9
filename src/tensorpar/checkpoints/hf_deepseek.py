"""The tensors of Hugging Face DeepSeek-V3 and GLM-4.5 checkpoints <-> tensorpar's names (configs:
`tensorpar.checkpoints.hf_deepseek_config`).

    tensorpar                                   Hugging Face (model.layers.{i}.)
    layers.{i}.attn_norm / mlp_norm             input_layernorm / post_attention_layernorm
    layers.{i}.attn.q_a_proj, q_a_norm          self_attn.q_a_proj, q_a_layernorm       (DeepSeek-V3; or q_proj)
    layers.{i}.attn.q_b_proj                    self_attn.q_b_proj
    layers.{i}.attn.kv_a_proj, kv_a_norm        self_attn.kv_a_proj_with_mqa, kv_a_layernorm
    layers.{i}.attn.kv_b_proj, o_proj           self_attn.kv_b_proj, o_proj
    layers.{i}.attn.{q,k,v,o}_proj              self_attn.{q,k,v,o}_proj                 (GLM-4.5, q/k/v biases)
    layers.{i}.mlp.router.weight / expert_bias  mlp.gate.weight / mlp.gate.e_score_correction_bias
    layers.{i}.mlp.experts.{p}[j]               mlp.experts.{j}.{p}.weight               (p: gate/up/down_proj)
    layers.{i}.mlp.shared_experts.{p}           mlp.shared_experts.{p}.weight
    layers.{i}.mlp.{p}                          mlp.{p}.weight                           (dense layers)

Multi-token prediction module k is block i = num_hidden_layers + k of both (DeepSeek's published layout, which
transformers' `MtpModel` reads): its block's tensors as above under `layers.{i}.block.`, and enorm, hnorm, eh_proj
and `norm` (Hugging Face: shared_head.norm). DeepSeek's checkpoints also store copies of the embedding and the head
there (`embed_tokens`, `shared_head.head`): written on export (the serving engines read them), ignored on import
(tensorpar's modules share the model's). transformers 5's fused in-memory experts are read too
(`tensorpar.checkpoints.hf_moe.unfuse_experts`).
"""

from __future__ import annotations

import re

import torch

from tensorpar.models.config import ModelConfig

_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
_RENAMES = (("attn_norm.", "input_layernorm."), ("mlp_norm.", "post_attention_layernorm."),
            ("attn.q_a_norm.", "self_attn.q_a_layernorm."), ("attn.kv_a_norm.", "self_attn.kv_a_layernorm."),
            ("attn.kv_a_proj.", "self_attn.kv_a_proj_with_mqa."), ("attn.", "self_attn."),
            ("mlp.router.weight", "mlp.gate.weight"), ("mlp.router.expert_bias", "mlp.gate.e_score_correction_bias"))
_MTP_OWN = {"enorm.weight": "enorm.weight", "hnorm.weight": "hnorm.weight", "eh_proj.weight": "eh_proj.weight",
            "norm.weight": "shared_head.norm.weight"}
_STACKED = re.compile(r"^layers\.(\d+)\.(?:block\.)?mlp\.experts\.(gate_proj|up_proj|down_proj)$")


def _block_name(rest: str) -> str:
    """A block's tensor (below `layers.{i}.`) in Hugging Face's names below `model.layers.{i}.`."""
    for ours, theirs in _RENAMES:
        if rest.startswith(ours):
            return theirs + rest[len(ours):]
    return rest


def hf_name(name: str, cfg: ModelConfig) -> str:
    """The Hugging Face name of tensorpar tensor `name` (not a stacked expert tensor)."""
    top = {"embed.weight": "model.embed_tokens.weight", "final_norm.weight": "model.norm.weight",
           "head.weight": "lm_head.weight"}
    if name in top:
        return top[name]
    _, index, rest = name.split(".", 2)
    if int(index) >= cfg.num_layers:  # a multi-token prediction module
        rest = _MTP_OWN[rest] if rest in _MTP_OWN else _block_name(rest.removeprefix("block."))
    else:
        rest = _block_name(rest)
    return f"model.layers.{index}.{rest}"


def _expert_names(i: int, proj: str, cfg: ModelConfig) -> list[str]:
    return [f"model.layers.{i}.mlp.experts.{j}.{proj}.weight" for j in range(cfg.num_experts)]


def deepseek_to_hf(state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """tensorpar's dense state (names checked by the caller) -> Hugging Face tensors: experts one per tensor (views of
    the stacked ones), each multi-token prediction module with DeepSeek's copies of the embedding and the head."""
    out = {}
    for name, tensor in state.items():
        stacked = _STACKED.match(name)
        if stacked:
            out.update(zip(_expert_names(int(stacked.group(1)), stacked.group(2), cfg), tensor.unbind(0)))
        else:
            out[hf_name(name, cfg)] = tensor
    head = state["embed.weight" if cfg.tie_embeddings else "head.weight"]
    for i in range(cfg.num_layers, cfg.num_blocks):
        out[f"model.layers.{i}.embed_tokens.weight"] = state["embed.weight"]
        out[f"model.layers.{i}.shared_head.head.weight"] = head
    return out


def deepseek_from_hf(hf_state: dict[str, torch.Tensor], cfg: ModelConfig, names) -> dict[str, torch.Tensor]:
    """The inverse of `deepseek_to_hf` for tensorpar's tensor `names` (the Hugging Face names and shapes checked by
    the caller; the modules' copies of the embedding and the head are not read)."""
    out = {}
    for name in names:
        stacked = _STACKED.match(name)
        if stacked:
            out[name] = torch.stack([hf_state[n] for n in _expert_names(int(stacked.group(1)), stacked.group(2),
                                                                        cfg)])
        else:
            out[name] = hf_state[hf_name(name, cfg)]
    return out


def held_mtp_layers(cfg: ModelConfig, hf_names) -> int:
    """How many of the config's multi-token prediction modules the checkpoint's tensors hold (transformers'
    `save_pretrained` writes none)."""
    held = 0
    for i in range(cfg.num_layers, cfg.num_blocks):
        if not any(n.startswith(f"model.layers.{i}.") or n.startswith(f"layers.{i}.") for n in hf_names):
            break
        held += 1
    return held


def is_mtp_copy(name: str, cfg: ModelConfig) -> bool:
    """A multi-token prediction module's stored copy of the embedding or the head (not read: shared)."""
    match = re.match(r"^model\.layers\.(\d+)\.(embed_tokens|shared_head\.head)\.weight$", name)
    return match is not None and int(match.group(1)) >= cfg.num_layers
