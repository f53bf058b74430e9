"""The autograd conjugates of tensor and sequence parallelism (Megatron-LM's mappings).

Each op is a pair of collectives, one in forward and its conjugate in backward, so that a
parallel region computes the same gradients as the dense model (Megatron-LM's f and g):

=======================  ==================================  ==================================
op                       forward                             backward
=======================  ==================================  ==================================
copy_to_tp      (f)      identity                            all-reduce
reduce_from_tp  (g)      all-reduce                          identity
sum_over_tp              all-reduce                          all-reduce
gather_from_tp           all-gather along the last dim       split along the last dim
scatter_to_tp            split along the last dim            all-gather along the last dim
gather_from_sp  (g)      all-gather along the sequence       reduce-scatter along the sequence
reduce_scatter_to_sp     reduce-scatter along the sequence   all-gather along the sequence
scatter_to_sp            split along the sequence            all-gather along the sequence
=======================  ==================================  ==================================

Every op takes the group (a Mesh, a `Group`, or None) explicitly and is the identity for a
group of one rank. Tensors are batch-first: the sequence dimension is 1 by default. The context-
and expert-parallel conjugates are `tensorpar.context_parallel.cp_mappings` and
`tensorpar.expert_parallel.ep_mappings`.
"""

from __future__ import annotations

import torch

from tensorpar.distributed.comm import Group, as_group
from tensorpar.errors import LayoutError

SEQ_DIM = 1


def _split(x: torch.Tensor, group: Group, dim: int) -> torch.Tensor:
    """This rank's contiguous chunk of `x` along `dim` (which must divide by the group size)."""
    if x.shape[dim] % group.size:
        raise LayoutError(
            f"cannot split dimension {dim} of size {x.shape[dim]} across {group.size} ranks of group "
            f"'{group.name}': it must be divisible by {group.size}"
        )
    return x.chunk(group.size, dim)[group.rank].contiguous()


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return ctx.group.all_reduce(grad.contiguous().clone()), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return group.all_reduce(x.contiguous().clone())

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _SumOverTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return group.all_reduce(x.contiguous().clone())

    @staticmethod
    def backward(ctx, grad):
        return ctx.group.all_reduce(grad.contiguous().clone()), None


class _GatherFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return group.all_gather(x, dim=-1)

    @staticmethod
    def backward(ctx, grad):
        return _split(grad, ctx.group, -1), None


class _ScatterToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split(x, group, -1)

    @staticmethod
    def backward(ctx, grad):
        return ctx.group.all_gather(grad, dim=-1), None


class _GatherFromSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim, grad_is_partial):
        ctx.group, ctx.dim, ctx.grad_is_partial = group, dim, grad_is_partial
        return group.all_gather(x, dim=dim)

    @staticmethod
    def backward(ctx, grad):
        if ctx.grad_is_partial:
            return ctx.group.reduce_scatter(grad, dim=ctx.dim), None, None, None
        return _split(grad, ctx.group, ctx.dim), None, None, None


class _ReduceScatterToSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return group.reduce_scatter(x, dim=dim)

    @staticmethod
    def backward(ctx, grad):
        return ctx.group.all_gather(grad, dim=ctx.dim), None, None


class _ScatterToSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return _split(x, group, dim)

    @staticmethod
    def backward(ctx, grad):
        return ctx.group.all_gather(grad, dim=ctx.dim), None, None


def copy_to_tp(x: torch.Tensor, group=None) -> torch.Tensor:
    """f: forward identity, backward all-reduce. Enters a tensor-parallel region with a replicated input."""
    group = as_group(group)
    return x if group.size == 1 else _CopyToTP.apply(x, group)


def reduce_from_tp(x: torch.Tensor, group=None) -> torch.Tensor:
    """g: forward all-reduce, backward identity. Leaves a tensor-parallel region by summing partial results."""
    group = as_group(group)
    return x if group.size == 1 else _ReduceFromTP.apply(x, group)


def sum_over_tp(x: torch.Tensor, group=None) -> torch.Tensor:
    """The sum over the group of per-rank partials that each rank then uses in its own way (a norm over features
    split across the ranks: each rank scales its own features by it): all-reduce forward, and all-reduce backward,
    since every rank's use of the sum contributes to the gradient of every rank's partial."""
    group = as_group(group)
    return x if group.size == 1 else _SumOverTP.apply(x, group)


def gather_from_tp(x: torch.Tensor, group=None) -> torch.Tensor:
    """Forward all-gather along the last dim, backward split along the last dim (keep this rank's slice)."""
    group = as_group(group)
    return x if group.size == 1 else _GatherFromTP.apply(x, group)


def scatter_to_tp(x: torch.Tensor, group=None) -> torch.Tensor:
    """Forward split along the last dim (keep this rank's slice), backward all-gather along the last dim."""
    group = as_group(group)
    return x if group.size == 1 else _ScatterToTP.apply(x, group)


def gather_from_sp(x: torch.Tensor, group=None, dim: int = SEQ_DIM, grad_is_partial: bool = True) -> torch.Tensor:
    """Forward all-gather along the sequence, backward reduce-scatter along the sequence.

    Used where a sequence-sharded activation enters a tensor-parallel region (the Playbook's g):
    each rank's gradient is then a partial sum over its heads or columns, hence the reduce-scatter.
    With ``grad_is_partial=False`` (the consumer is replicated, e.g. a final gather for output)
    the backward is a plain split instead.
    """
    group = as_group(group)
    return x if group.size == 1 else _GatherFromSP.apply(x, group, dim, grad_is_partial)


def reduce_scatter_to_sp(x: torch.Tensor, group=None, dim: int = SEQ_DIM) -> torch.Tensor:
    """Forward reduce-scatter along the sequence, backward all-gather along the sequence (the Playbook's g*).

    Leaves a tensor-parallel region into a sequence-parallel one: partial sums are reduced and
    each rank keeps its sequence shard.
    """
    group = as_group(group)
    return x if group.size == 1 else _ReduceScatterToSP.apply(x, group, dim)


def scatter_to_sp(x: torch.Tensor, group=None, dim: int = SEQ_DIM) -> torch.Tensor:
    """Forward split along the sequence (keep this rank's shard), backward all-gather along the sequence.

    Enters a sequence-parallel region from a replicated activation (no communication forward).
    """
    group = as_group(group)
    return x if group.size == 1 else _ScatterToSP.apply(x, group, dim)
