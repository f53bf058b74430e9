"""LayerNorm and RMSNorm that stay correct under sequence parallelism, and the norms of queries and keys.

The norm weights are replicated on every TP rank. Without sequence parallelism every rank sees
the whole sequence and computes the whole gradient. With it, each rank normalises only its
sequence shard, so its weight gradient is partial: the weights enter through `copy_to_tp`
(forward identity, backward all-reduce), which sums the gradient across TP ranks (a known
peer bug is to forget this). When the region overlaps, the weight and bias enter together
(`copy_params_to_tp`): one all-reduce of both gradients instead of one each.

Inside attention, q and k are split by heads over the TP ranks. A norm of each head (Qwen3, Gemma 3: `Norm` over
head_dim: `HeadNorm`) has a replicated weight that each rank applies to its own heads: its gradient is
summed over the group. A norm over the whole projection (OLMo 2: `ProjectionNorm`) needs the mean square over
every head: each rank's sum of squares is summed over the group (`sum_over_tp`: all-reduce forward and backward),
and its weight is split by heads like the projection it follows.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from tensorpar.distributed.sharding import ShardSpec, tag
from tensorpar.tensor_parallel.mappings import sum_over_tp
from tensorpar.tensor_parallel.region import as_region
from tensorpar.tensor_parallel.region_gemms import with_grad_reduce


def _scale(x: torch.Tensor, weight=None, bias=None) -> torch.Tensor:
    return x if weight is None else x * weight


class Norm(nn.Module):
    """``kind="layernorm"`` (weight and bias) or ``"rmsnorm"`` (weight only, computed in fp32 like Llama's); an
    RMSNorm with `offset` scales by (offset + weight) (Gemma's 1: its weights are stored around 0).

    `region`: the model's `TPRegion` (or a mesh / group), which says how the replicated weight and bias enter:
    their gradients summed over TP under sequence parallelism (or always, with ``summed=True``: a norm of the heads
    each rank holds), or left for later under a split backward."""

    def __init__(self, hidden_size: int, kind: str, eps: float, region=None, device=None, *, offset: float = 0.0,
                 summed: bool | None = None):
        super().__init__()
        self.region = as_region(region)
        self.kind, self.eps, self.sequence_parallel = kind, eps, self.region.sequence_parallel
        self.tp_group, self.offset = self.region.group, offset
        self.summed = self.sequence_parallel if summed is None else summed and self.tp_group.size > 1
        spec = ShardSpec(dim=None, reduce_grad_across_tp=self.summed)
        self.weight = tag(nn.Parameter(torch.full((hidden_size,), 1.0 - offset, device=device)), spec)
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
        if self.offset == 0.0:
            return self.region.replicated(self._normalize, x, self.weight, self.bias, self.summed)
        normalized = self._normalize(x)  # x (offset + w) as x w + offset x, w entering as any replicated weight
        return self.region.replicated(_scale, normalized, self.weight, None, self.summed) + self.offset * normalized

    def extra_repr(self) -> str:
        return (f"{self.kind}, {self.weight.shape[0]}, eps={self.eps}, offset={self.offset}, "
                f"sequence_parallel={self.sequence_parallel}")


def _sum_over_replicas(grad: torch.Tensor, group, replicas: int) -> torch.Tensor:
    """All-reduce over `group` of a buffer with one slot per distinct shard: the sum over the ranks holding this one."""
    slot = group.rank // replicas
    buffer = grad.new_zeros((group.size // replicas,) + tuple(grad.shape))
    buffer[slot] = grad
    group.all_reduce(buffer)
    return buffer[slot]


def replica_grad_reduce(group, replicas: int):
    """The gradient reduction of a shard held by `replicas` consecutive ranks of `group` (None when 1)."""
    return None if replicas == 1 else functools.partial(_sum_over_replicas, group=group, replicas=replicas)


class ProjectionNorm(nn.Module):
    """RMSNorm over all `heads` x `head_dim` features of a projection whose heads are split over the TP group, each
    rank's `local_heads` shard held by `replicas` consecutive ranks (KV heads fewer than ranks). Forward: the sum of
    squares all-reduced (`sum_over_tp`, over the distinct shards); backward: its gradient all-reduced, and the
    weight's summed over the replicas of its shard."""

    def __init__(self, heads: int, local_heads: int, head_dim: int, eps: float, group, replicas: int = 1,
                 device=None, offset: float = 0.0):
        super().__init__()
        self.tp_group, self.replicas, self.eps, self.offset = group, replicas, eps, offset
        self.features = heads * head_dim
        spec = ShardSpec(dim=0, full_size=self.features, padded_size=self.features, replicas=replicas)
        self.weight = tag(nn.Parameter(torch.full((local_heads * head_dim,), 1.0 - offset, device=device)), spec)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        squares = sum_over_tp(x.pow(2).sum(-1, keepdim=True), self.tp_group)
        if self.replicas > 1:
            squares = squares / self.replicas  # every distinct shard was counted on each of its replicas
        x = x * torch.rsqrt(squares / self.features + self.eps)
        weight = with_grad_reduce(self.weight, replica_grad_reduce(self.tp_group, self.replicas))
        return ((weight if not self.offset else self.offset + weight) * x).to(dtype)

    def extra_repr(self) -> str:
        return f"{self.features} features, {self.weight.shape[0]} here, replicas={self.replicas}, eps={self.eps}"


class HeadNorm(Norm):
    """RMSNorm of each head of a projection [..., local_heads * head_dim] (Qwen3's and Gemma 3's q / k norms): one
    [head_dim] weight replicated on the TP ranks, each of which applies it to its own heads, so its gradient is
    summed over the group (`copy_to_tp`: identity forward, all-reduce backward)."""

    def __init__(self, head_dim: int, eps: float, region=None, device=None, offset: float = 0.0):
        super().__init__(head_dim, "rmsnorm", eps, region, device, offset=offset, summed=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.unflatten(-1, (-1, self.weight.shape[0]))).flatten(-2)
