"""Compute for the planner: the FLOPs of one micro-batch through one pipeline stage.

The forward of a layer is ``2 b s P_layer + 4 b s^2 h`` (the matmul parameters, PaLM's attention
term, with the query heads' width for h and a sliding window's keys for s where it is shorter, averaged over the
layers: the accounting of `tensorpar.models.flops`, so that summed over stages it is exactly
``train_flops_per_token(cfg, s) * b * s``) and the head ``2 b s (V h + norm)`` on the last stage (with
multi-token prediction, each module's block and the head once more);
training is 3 x forward. A mixture of experts counts what one token uses (`models.flops`: the router, its
top-k routed experts and the shared experts; balanced routing), averaged over the layers when only every
moe_layer_freq-th layer is one. Recomputation adds one more forward of every layer ("full"; tensorpar's
checkpoint stops before the MLP's output projection when there is no dropout, which it then skips)
or of the attention core ``4 b s^2 h`` ("selective").
"""

from __future__ import annotations

from tensorpar.models.flops import attention_flops_per_token, matmul_params
from tensorpar.planning.candidates import Candidate, stage_layers
from tensorpar.planning.precision_recipes import Precision


_PARTS: dict = {}


def flop_parts(cfg) -> tuple[float, float]:
    """(parameters in matmuls per layer, parameters of the head incl. the final norm), dense counts."""
    hit = _PARTS.get(id(cfg))
    if hit is not None and hit[0] is cfg:
        return hit[1]
    norm = cfg.hidden_size * (2 if cfg.norm == "layernorm" else 1)
    head = cfg.vocab_size * cfg.hidden_size + norm
    out = (matmul_params(cfg) - head) / cfg.num_blocks, head  # multi-token prediction modules: blocks too
    _PARTS[id(cfg)] = (cfg, out)
    return out


def down_proj_params(cfg) -> float:
    """The MLP output projection's parameters one token uses, averaged over the layers (MoE: top-k routed
    experts' and the shared experts')."""
    dense = cfg.ffn_hidden_size * cfg.hidden_size
    if not cfg.is_moe:
        return dense
    moe = (cfg.experts_per_token + cfg.num_shared_experts) * cfg.expert_ffn_size * cfg.hidden_size
    n_moe = sum(cfg.is_moe_layer(i) for i in range(cfg.num_layers))
    return (n_moe * moe + (cfg.num_layers - n_moe) * dense) / cfg.num_layers


def stage_flops(cfg, layout: Candidate, b: int, s: int, stage: int | None, precision: Precision) -> tuple[float, float]:
    """(training FLOPs, recomputation FLOPs) of one micro-batch through one stage (all its TP ranks)."""
    first, last, n = stage_layers(cfg, layout, stage)
    layer_p, head_p = flop_parts(cfg)
    attn = attention_flops_per_token(cfg, s) / (3.0 * cfg.num_blocks) * b * s  # one layer's forward, on average
    layer_fwd = 2.0 * b * s * layer_p + attn
    mtp = cfg.num_mtp_layers if last else 0  # each multi-token prediction module: a block, and the head again
    n += mtp
    fwd = n * layer_fwd + (2.0 * b * s * (head_p + mtp * cfg.vocab_size * cfg.hidden_size) if last else 0.0)
    if layout.recompute == "full":
        again = layer_fwd
        if precision.activations == "tensorpar" and cfg.dropout == 0:
            again -= 2.0 * b * s * down_proj_params(cfg)  # checkpoint stops before down_proj
        recompute = n * again
    elif layout.recompute == "selective":
        recompute = n * attn
    else:
        recompute = 0.0
    return 3.0 * fwd, recompute


def megatron_flops_per_step(cfg, global_batch: int, seq_len: int) -> float:
    """Narayanan et al. 2021, eq. 3: 96 B s l h^2 (1 + s/(6h) + V/(16 l h)), FLOPs of one step with full
    activation recomputation (the accounting of their reported teraFLOP/s per GPU)."""
    B, s, l, h, V = global_batch, seq_len, cfg.num_layers, cfg.hidden_size, cfg.vocab_size
    return 96.0 * B * s * l * h * h * (1 + s / (6 * h) + V / (16 * l * h))
