"""LayerNorm and RMSNorm that stay correct under sequence parallelism.

The norm weights are replicated on every TP rank. Without sequence parallelism every rank sees
the whole sequence and computes the whole gradient. With it, each rank normalises only its
sequence shard, so its weight gradient is partial: the weights enter through `copy_to_tp`
(forward identity, backward all-reduce), which sums the gradient across TP ranks (a known
peer bug is to forget this). With ``tp_overlap`` the weight and bias enter together
(`copy_params_to_tp`): one all-reduce of both gradients instead of one each.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tensorpar.distributed.comm import as_group
from tensorpar.distributed.ops import copy_to_tp
from tensorpar.layers import weight_grad
from tensorpar.layers.sharding import ShardSpec, tag
from tensorpar.layers.tp_overlap import copy_params_to_tp


class Norm(nn.Module):
    """``kind="layernorm"`` (weight and bias) or ``"rmsnorm"`` (weight only, computed in fp32 like Llama's)."""

    weight_grad_queue = None  # a WeightGradQueue: the backward leaves the weight gradients in it (layers/weight_grad.py)

    def __init__(self, hidden_size: int, kind: str, eps: float, tp_group=None, sequence_parallel: bool = False,
                 device=None, tp_overlap: bool = False):
        super().__init__()
        self.kind, self.eps, self.sequence_parallel, self.tp_overlap = kind, eps, sequence_parallel, tp_overlap
        self.tp_group = as_group(tp_group)
        spec = ShardSpec(dim=None, reduce_grad_across_tp=sequence_parallel)
        self.weight = tag(nn.Parameter(torch.ones(hidden_size, device=device)), spec)
        self.bias = tag(nn.Parameter(torch.zeros(hidden_size, device=device)), spec) if kind == "layernorm" else None

    def _param(self, p):
        return copy_to_tp(p, self.tp_group) if self.sequence_parallel and p is not None else p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight_grad_queue is not None:
            return self._forward_split(x)
        if self.sequence_parallel and self.tp_overlap:
            weight, *bias = copy_params_to_tp([p for p in (self.weight, self.bias) if p is not None], self.tp_group)
            bias = bias[0] if bias else None
        else:
            weight, bias = self._param(self.weight), self._param(self.bias)
        if self.kind == "layernorm":
            return F.layer_norm(x, (x.shape[-1],), weight, bias, self.eps)
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return weight * x.to(dtype)

    def _forward_split(self, x: torch.Tensor) -> torch.Tensor:
        """The same function, its weight gradients (summed across TP under SP) left in the queue."""
        reduce = weight_grad.summed_over(self.tp_group) if self.sequence_parallel else None
        if self.kind == "layernorm":
            normed = F.layer_norm(x, (x.shape[-1],), None, None, self.eps)
            return weight_grad.affine(normed, self.weight, self.bias, self.weight_grad_queue, reduce=reduce)
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return weight_grad.affine(x.to(dtype), self.weight, None, self.weight_grad_queue, reduce=reduce)

    def extra_repr(self) -> str:
        return f"{self.kind}, {self.weight.shape[0]}, eps={self.eps}, sequence_parallel={self.sequence_parallel}"
