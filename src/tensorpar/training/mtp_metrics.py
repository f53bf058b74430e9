"""The per-step metric of multi-token prediction (tensorpar.models.mtp): `mtp_loss`, the mean over the modules of
each one's cross-entropy averaged over every target of the step (all ranks: one all-reduce of 2 values a module over
the world; the last pipeline stage's ranks hold them, one TP rank each), and `mtp_loss_{k}` for module k when there
are several. The training objective adds mtp_loss_weight times their mean; `loss` stays the next-token loss."""

from __future__ import annotations

import torch


def mtp_step_metrics(model, cfg, mesh) -> dict:
    """The step's multi-token prediction metrics (the same on every rank; a collective); resets the sums."""
    sums = torch.zeros(2 * cfg.num_mtp_layers, device=mesh.device)
    stats = getattr(model, "mtp_stats", None)
    if stats is not None and stats.vector is not None:
        sums += stats.vector
        stats.reset()
    mesh.world_group.all_reduce(sums)
    per_depth = (sums[0::2] / sums[1::2].clamp(min=1)).double().tolist()
    out = {"mtp_loss": sum(per_depth) / len(per_depth)}
    if len(per_depth) > 1:
        out.update({f"mtp_loss_{k}": loss for k, loss in enumerate(per_depth, 1)})
    return out
