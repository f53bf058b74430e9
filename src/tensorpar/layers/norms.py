"""LayerNorm and RMSNorm that stay correct under sequence parallelism.

The norm weights are replicated on every TP rank. Without sequence parallelism every rank sees
the whole sequence and computes the whole gradient. With it, each rank normalises only its
sequence shard, so its weight gradient is partial: the weights enter through `copy_to_tp`
(forward identity, backward all-reduce), which sums the gradient across TP ranks (a known
peer bug is to forget this). When the region overlaps, the weight and bias enter together
(`copy_params_to_tp`): one all-reduce of both gradients instead of one each.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tensorpar.distributed.sharding import ShardSpec, tag
from tensorpar.tensor_parallel.region import as_region


class Norm(nn.Module):
    """``kind="layernorm"`` (weight and bias) or ``"rmsnorm"`` (weight only, computed in fp32 like Llama's).

    `region`: the model's `TPRegion` (or a mesh / group), which says how the replicated weight and bias enter:
    their gradients summed over TP under sequence parallelism, or left for later under a split backward."""

    def __init__(self, hidden_size: int, kind: str, eps: float, region=None, device=None):
        super().__init__()
        self.region = as_region(region)
        self.kind, self.eps, self.sequence_parallel = kind, eps, self.region.sequence_parallel
        self.tp_group = self.region.group
        spec = ShardSpec(dim=None, reduce_grad_across_tp=self.sequence_parallel)
        self.weight = tag(nn.Parameter(torch.ones(hidden_size, device=device)), spec)
        self.bias = tag(nn.Parameter(torch.zeros(hidden_size, device=device)), spec) if kind == "layernorm" else None

    def _normalize(self, x: torch.Tensor, weight=None, bias=None) -> torch.Tensor:
        """The norm of `x`, scaled and shifted by `weight` and `bias` where given."""
        if self.kind == "layernorm":
            return F.layer_norm(x, (x.shape[-1],), weight, bias, self.eps)
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return x.to(dtype) if weight is None else weight * x.to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.region.replicated(self._normalize, x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"{self.kind}, {self.weight.shape[0]}, eps={self.eps}, sequence_parallel={self.sequence_parallel}"
