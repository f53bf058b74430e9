"""The gradient norm of the dense model, computed from TP/PP-sharded gradients, and clipping by it.

Each parameter's `ShardSpec` says how many TP ranks hold an identical copy of its tensor
(`effective_replicas`): a column/row shard is held once, a replicated bias or norm weight by
every TP rank, a KV head shared by ``replicas`` ranks by that many. Dividing each local squared
norm by that count and summing over the TP group counts every dense element exactly once.

Collectives (one per call of `global_grad_norm` or `clip_grad_norm_`, each on a 1-element fp32
tensor, none on a group of one rank):

- one all-reduce (sum) on ``mesh.tp_group``: the TP ranks of a stage hold different shards;
- one all-reduce (sum) on ``mesh.pp_group``: the pipeline stages hold different layers.

Nothing is reduced over ``mesh.dp_group`` (nor over the context-parallel ranks): after the
data-parallel gradient all-reduce over DP x CP every replica holds the same (averaged) gradients,
so summing over them would count them dp x cp times; under ZeRO, whose slices are sharded over
``mesh.dp_cp_group``, one all-reduce there comes first.
A parameter held by more than one pipeline stage (tied embeddings on the first and last stage)
would be counted once per stage; such a parameter needs its own accounting.

Routed experts (mixture-of-experts models, ShardSpec group "ep"): each expert-parallel rank holds its own
experts, identical on the expert-DP ranks after their gradient reduction, so their squares are summed over
``mesh.ep_group`` instead of the TP group (under ZeRO first over ``mesh.expert_dp_group``, whose ranks hold
different slices, and over ``mesh.expert_tp_group``, whose ranks hold different width slices of them): each
expert counted once. Up to three more one-element all-reduces, only on meshes with expert groups of more than
one rank.
"""

from __future__ import annotations

import math
from typing import Iterable

import torch

from tensorpar.distributed.sharding import shard_spec

_CLIP_EPS = 1e-6  # torch.nn.utils.clip_grad_norm_'s


def _as_list(params: Iterable[torch.Tensor] | torch.Tensor) -> list[torch.Tensor]:
    return [params] if isinstance(params, torch.Tensor) else list(params)


def _global_norm(params: list[torch.Tensor], mesh, sharded_over_dp: bool = False) -> torch.Tensor:
    device = params[0].device if params else mesh.device  # the gradients' (meta in a dry run)
    total = torch.zeros((), dtype=torch.float32, device=device)
    experts = torch.zeros((), dtype=torch.float32, device=device)
    tp_size = mesh.tp_size
    for p in params:
        spec = shard_spec(p)
        if p.grad is None or spec.pipeline_duplicate:
            continue
        sq = torch.linalg.vector_norm(p.grad.detach(), 2, dtype=torch.float32).square()
        if spec.expert:
            experts += sq.to(total.device)
        else:
            total += sq.to(total.device) / spec.effective_replicas(tp_size)
    if sharded_over_dp:
        # ZeRO: each DP (x CP) rank of a replica holds a different slice of the gradients (HSDP: the replicas hold the
        # same slices, so only the ranks of one replica are summed)
        (getattr(mesh, "dp_shard_group", None) or mesh.dp_cp_group).all_reduce(total)
    mesh.tp_group.all_reduce(total)  # the shards of this stage
    expert_dp = getattr(mesh, "expert_dp_group", None)
    if expert_dp is not None:  # a mixture-of-experts run
        if sharded_over_dp:
            expert_dp.all_reduce(experts)  # ZeRO: the expert-DP ranks hold different slices of their experts
        mesh.expert_tp_group.all_reduce(experts)  # each expert-TP rank holds its own width slice of them
        mesh.ep_group.all_reduce(experts)  # each EP rank holds its own experts
        total += experts
    mesh.pp_group.all_reduce(total)  # the layers of the other stages
    return total.sqrt()


def global_grad_norm(params: Iterable[torch.Tensor] | torch.Tensor, mesh, sharded_over_dp: bool = False) -> torch.Tensor:
    """The L2 norm of the dense model's gradient: an fp32 scalar, the same on every rank.

    `params` are this rank's (sharded) parameters; those whose ``.grad`` is None count as zero.
    Squared norms are taken in fp32 whatever the gradient dtype. Collectives: one all-reduce of
    one element on the TP group, then one on the PP group; none on the DP group unless the
    gradients are sharded over it (``sharded_over_dp=True``, ZeRO), then one there first.
    Parameters whose ShardSpec says ``pipeline_duplicate`` (the last stage's copy of a tied embedding) are skipped.
    """
    return _global_norm(_as_list(params), mesh, sharded_over_dp)


def clip_grad_norm_(
    params: Iterable[torch.Tensor] | torch.Tensor, max_norm: float, mesh, sharded_over_dp: bool = False
) -> torch.Tensor:
    """Scale every gradient in place so that the dense model's gradient norm is at most `max_norm`.

    The factor is ``min(1, max_norm / (norm + 1e-6))``, as in torch.nn.utils.clip_grad_norm_,
    the same on every rank. ``max_norm <= 0`` leaves the gradients alone. Returns the norm
    before clipping (fp32 scalar). Collectives: those of `global_grad_norm`, nothing more.
    """
    params = _as_list(params)
    norm = _global_norm(params, mesh, sharded_over_dp)
    _clip(params, norm, max_norm)
    return norm


def _clip(params: list[torch.Tensor], norm: torch.Tensor, max_norm: float) -> None:
    if max_norm <= 0:
        return
    coef = torch.clamp(max_norm / (norm + _CLIP_EPS), max=1.0)
    for p in params:
        if p.grad is not None:
            p.grad.detach().mul_(coef.to(device=p.grad.device, dtype=p.grad.dtype))


def unscale_and_clip(params: list[torch.Tensor], max_norm: float, mesh, sharded_over_dp: bool, scaler=None):
    """The optimizer step's gradient work: divide by the loss scale (fp16: `scaler`, a DynamicLossScaler), take the
    dense norm and clip. Returns (the norm, whether to skip the step): skip when the norm is not finite (fp16: the
    gradients overflowed and the scaler has backed off); every rank decides alike, from the same global norm. A
    skipped step's gradients are left unclipped: a NaN norm would otherwise spread to every gradient."""
    if scaler is not None:
        for p in params:
            if p.grad is not None:
                p.grad.detach().div_(scaler.scale)
    norm = _global_norm(params, mesh, sharded_over_dp)
    if norm.is_meta:  # a dry run (`tensorpar train --dry-run`): shapes without values, nothing to judge
        skip = False
    else:
        skip = scaler.update(norm.item()) if scaler is not None else not math.isfinite(norm.item())
    if not skip:
        _clip(params, norm, max_norm)
    return norm, skip
