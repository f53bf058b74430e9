"""The mixture-of-experts layers of Hugging Face Mixtral, Qwen2-MoE and Qwen3-MoE checkpoints <-> tensorpar's names
(Qwen3-MoE's as Qwen2-MoE's, without the shared expert).

Hub checkpoints (and what transformers 5 `save_pretrained` writes: it converts its fused in-memory experts back)
keep one tensor per expert; tensorpar stacks the experts of a layer ([E, F, H] / [E, H, F]):

    tensorpar layers.{i}.mlp.             Mixtral model.layers.{i}.block_sparse_moe.   Qwen2-MoE model.layers.{i}.mlp.
    router.weight                         gate.weight                                  gate.weight
    experts.gate_proj[j]                  experts.{j}.w1.weight                        experts.{j}.gate_proj.weight
    experts.up_proj[j]                    experts.{j}.w3.weight                        experts.{j}.up_proj.weight
    experts.down_proj[j]                  experts.{j}.w2.weight                        experts.{j}.down_proj.weight
    shared_experts.{p}.weight             -                                            shared_expert.{p}.weight
    shared_expert_gate                    -                                            shared_expert_gate.weight

`unfuse_experts` also reads transformers 5's in-memory layout, should a folder hold it: per layer
`mlp.experts.gate_up_proj` [E, 2F, H] (gate rows, then up rows) and `mlp.experts.down_proj` [E, H, F], with
Mixtral's router and experts under `mlp.` instead of `block_sparse_moe.`.
"""

from __future__ import annotations

import re

import torch

from tensorpar.checkpoints.hf_moe_config import moe_architecture
from tensorpar.models.config import ModelConfig

_QWEN_NAMES = {"gate_proj": "gate_proj", "up_proj": "up_proj", "down_proj": "down_proj"}
_PROJ_NAMES = {"mixtral": {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}, "qwen2_moe": _QWEN_NAMES,
               "qwen3_moe": _QWEN_NAMES}
_FUSED = re.compile(r"^(model\.layers\.\d+)\.(?:mlp|block_sparse_moe)\.experts\.(gate_up_proj|down_proj)$")
_MIXTRAL_MLP = re.compile(r"^(model\.layers\.\d+)\.mlp\.(gate\.weight|experts\.\d+\.w[123]\.weight)$")


def _block(cfg: ModelConfig, i: int) -> str:
    return f"model.layers.{i}.{'block_sparse_moe' if moe_architecture(cfg) == 'mixtral' else 'mlp'}."


def moe_layer_pairs(cfg: ModelConfig, i: int) -> list[tuple[str, str]]:
    """(Hugging Face name, tensorpar name) of layer `i`'s MoE tensors that map one to one (router, shared experts)."""
    h, t = _block(cfg, i), f"layers.{i}.mlp."
    pairs = [(h + "gate.weight", t + "router.weight")]
    if cfg.num_shared_experts:
        pairs += [(f"{h}shared_expert.{p}.weight", f"{t}shared_experts.{p}.weight")
                  for p in ("gate_proj", "up_proj", "down_proj")]
    if cfg.shared_expert_gate:
        pairs.append((h + "shared_expert_gate.weight", t + "shared_expert_gate"))
    return pairs


def expert_names(cfg: ModelConfig, i: int) -> dict[str, list[str]]:
    """tensorpar's stacked expert tensor name of layer `i` -> the Hugging Face names of its experts, in order."""
    h, names = _block(cfg, i), _PROJ_NAMES[moe_architecture(cfg)]
    return {f"layers.{i}.mlp.experts.{p}": [f"{h}experts.{j}.{names[p]}.weight" for j in range(cfg.num_experts)]
            for p in ("gate_proj", "up_proj", "down_proj")}


def experts_to_hf(state: dict[str, torch.Tensor], cfg: ModelConfig, i: int) -> dict[str, torch.Tensor]:
    """Layer `i`'s routed experts in Hugging Face names (one tensor per expert, views of the stacked ones)."""
    out = {}
    for tp, names in expert_names(cfg, i).items():
        out.update(zip(names, state[tp].unbind(0)))
    return out


def experts_from_hf(state: dict[str, torch.Tensor], cfg: ModelConfig, i: int) -> dict[str, torch.Tensor]:
    """The inverse of `experts_to_hf`: layer `i`'s stacked expert tensors (shapes already checked)."""
    return {tp: torch.stack([state[n] for n in names]) for tp, names in expert_names(cfg, i).items()}


def unfuse_experts(state: dict[str, torch.Tensor], origin: dict[str, str], cfg: ModelConfig) -> None:
    """Rewrite, in place, transformers 5's fused expert tensors (and Mixtral's `mlp.` names) to the Hub layout;
    `origin` (name -> name as stored) follows. Tensors whose shapes do not fit are left for the shape check."""
    arch = moe_architecture(cfg)
    for key in list(state):
        fused, mixtral_mlp = _FUSED.match(key), _MIXTRAL_MLP.match(key) if arch == "mixtral" else None
        if mixtral_mlp:
            new = f"{mixtral_mlp.group(1)}.block_sparse_moe.{mixtral_mlp.group(2)}"
            if new not in state:
                state[new], origin[new] = state.pop(key), origin.pop(key)
            continue
        if not fused or state[key].dim() != 3 or state[key].shape[0] != cfg.num_experts:
            continue
        layer = int(key.split(".")[2])
        tensor = state[key]
        if fused.group(2) == "gate_up_proj":
            if tensor.shape[1] % 2:
                continue
            parts = {"gate_proj": tensor[:, : tensor.shape[1] // 2], "up_proj": tensor[:, tensor.shape[1] // 2:]}
        else:
            parts = {"down_proj": tensor}
        names = expert_names(cfg, layer) if cfg.is_moe_layer(layer) else {}
        for proj, stacked in parts.items():
            for name, expert in zip(names.get(f"layers.{layer}.mlp.experts.{proj}", []), stacked.unbind(0)):
                state[name], origin[name] = expert, origin[key]
        if names:
            del state[key]
