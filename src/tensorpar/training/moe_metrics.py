"""The per-step metrics of a mixture-of-experts run, from the statistics every MoE layer sums over the step.

One all-reduce (sum) over the whole world of a [num_layers, E + 6] table: each rank fills the rows of its
stage's MoE layers with what its tokens did (every token is routed on exactly one rank; the per-sequence loss
values are reported by one rank of those sharing the sequence), so the sums are the global batch's.

=========================  ========================================================================
moe_aux_loss               router_aux_loss_coef x the load-balancing loss (mean over sequences),
                           summed over the MoE layers: what the step added to `loss` for balance
moe_z_loss                 router_z_loss_coef x the router z-loss (mean over tokens), summed over layers
moe_load_imbalance         max over layers of (routing choices of the busiest expert / the mean)
moe_tokens_per_expert_max  the busiest expert's routing choices (the layer of that imbalance)
moe_tokens_per_expert_mean routing choices per expert (tokens x experts_per_token / num_experts)
moe_dropped_tokens         routing choices over an expert's capacity, all layers (0 when dropless)
moe_dropped_fraction       that over all routing choices
=========================  ========================================================================

The same table's routing counts move the routers' balancing biases after the step (`update_expert_biases`,
auxiliary-loss-free balancing): every rank sees the same counts, so every rank and layout moves them alike.
"""

from __future__ import annotations

import torch

from tensorpar.expert_parallel import STAT_FIELDS
from tensorpar.expert_parallel.router import update_expert_bias


def moe_step_table(model, cfg, mesh) -> torch.Tensor:
    """[blocks, E + 6]: every MoE layer's sums over the step (the multi-token prediction modules' blocks after the
    layers), summed over the world (a collective); resets the layers' sums."""
    table = torch.zeros(cfg.num_blocks, cfg.num_experts + len(STAT_FIELDS), device=mesh.device)
    for index, layer in model.moe_layers().items():
        if layer.stats.vector is not None:
            table[index] = layer.stats.vector
        layer.stats.reset()
    mesh.world_group.all_reduce(table)
    return table


def update_expert_biases(model, cfg, table: torch.Tensor) -> None:
    """Move this rank's routers' balancing biases by the step's global routing counts (`moe_step_table`)."""
    for index, layer in model.moe_layers().items():
        update_expert_bias(layer.router.expert_bias, table[index, :cfg.num_experts], cfg.bias_update_speed)


def moe_step_metrics(model, cfg, mesh, table: torch.Tensor | None = None) -> dict:
    """The step's MoE metrics (the same on every rank; a collective over the world unless given the step's `table`);
    resets the layers' sums."""
    e = cfg.num_experts
    table = moe_step_table(model, cfg, mesh) if table is None else table
    rows = table[[i for i in range(cfg.num_blocks) if cfg.is_moe_layer(i)]].double()
    counts = rows[:, :e]
    choices, dropped, aux_sum, sequences, z_sum, tokens = rows[:, e:].unbind(1)
    imbalance = counts.max(1).values / counts.mean(1).clamp(min=1e-12)
    worst = int(imbalance.argmax())
    return {
        "moe_aux_loss": cfg.router_aux_loss_coef * float((aux_sum / sequences.clamp(min=1)).sum()),
        "moe_z_loss": cfg.router_z_loss_coef * float((z_sum / tokens.clamp(min=1)).sum()),
        "moe_load_imbalance": float(imbalance[worst]),
        "moe_tokens_per_expert_max": float(counts[worst].max()),
        "moe_tokens_per_expert_mean": float(counts[worst].mean()),
        "moe_dropped_tokens": int(dropped.sum()),
        "moe_dropped_fraction": float(dropped.sum() / choices.sum().clamp(min=1)),
    }
