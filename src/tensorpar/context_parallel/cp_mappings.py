"""The autograd conjugate of context parallelism's loss: the token-weighted mean over the CP ranks.

=======================  ==================================  ==================================
op                       forward                             backward
=======================  ==================================  ==================================
mean_from_cp             all-reduce (token-weighted mean)    scale by cp x this rank's share
=======================  ==================================  ==================================
"""

from __future__ import annotations

import torch

from tensorpar.distributed.comm import as_group


class _MeanFromCP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, count, group):
        totals = group.all_reduce(torch.stack([x.detach().float() * count, count.float()]))
        total = totals[1].clamp(min=1)  # no token on any rank (a micro-batch of prompts only): 0, not NaN
        ctx.scale = group.size * count.float() / total  # this rank's share of the tokens, times cp
        return (totals[0] / total).to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.scale.to(grad.dtype), None, None


def mean_from_cp(x: torch.Tensor, count: torch.Tensor, group=None) -> torch.Tensor:
    """The mean over the context-parallel ranks of a per-rank mean `x` over `count` tokens, weighted by the counts:
    forward one all-reduce of [x * count, count]; backward the gradient times cp x count / total.

    That backward is what the parameters need: their gradients are then averaged over DP x CP (the
    `BucketedOptimizer`), which divides by cp, so each rank's tokens weigh what they weigh in the mean
    (with equal counts, as without ignored targets, the backward is the identity).
    """
    group = as_group(group, "cp")
    return x if group.size == 1 else _MeanFromCP.apply(x, count, group)
