"""The autograd conjugates of tensor and sequence parallelism.

Each op is a pair of collectives, one in forward and its conjugate in backward, so that a
parallel region computes the same gradients as the dense model (Megatron-LM's f and g):

=======================  ==================================  ==================================
op                       forward                             backward
=======================  ==================================  ==================================
copy_to_tp      (f)      identity                            all-reduce
reduce_from_tp  (g)      all-reduce                          identity
gather_from_tp           all-gather along the last dim       split along the last dim
scatter_to_tp            split along the last dim            all-gather along the last dim
gather_from_sp  (g)      all-gather along the sequence       reduce-scatter along the sequence
reduce_scatter_to_sp     reduce-scatter along the sequence   all-gather along the sequence
scatter_to_sp            split along the sequence            all-gather along the sequence
mean_from_cp             all-reduce (token-weighted mean)    scale by cp x this rank's share
all_to_all_ep            all-to-all (variable split sizes)   all-to-all with the sizes swapped
gather_from_expert_tp    all-gather of rows (variable        reduce-scatter of rows (variable
                         counts per rank)                    counts per rank)
reduce_scatter_to_       reduce-scatter of rows (variable    all-gather of rows (variable
expert_tp                counts per rank)                    counts per rank)
=======================  ==================================  ==================================

Every op takes the group (a Mesh, a `Group`, or None) explicitly and is the identity for a
group of one rank. Tensors are batch-first: the sequence dimension is 1 by default.
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


class _MeanFromCP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, count, group):
        totals = group.all_reduce(torch.stack([x.detach().float() * count, count.float()]))
        ctx.scale = group.size * count.float() / totals[1]  # this rank's share of the tokens, times cp
        return (totals[0] / totals[1]).to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.scale.to(grad.dtype), None, None


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, send_sizes, recv_sizes):
        ctx.group, ctx.send_sizes, ctx.recv_sizes = group, send_sizes, recv_sizes
        return group.all_to_all(x, send_sizes, recv_sizes)

    @staticmethod
    def backward(ctx, grad):
        return ctx.group.all_to_all(grad, ctx.recv_sizes, ctx.send_sizes), None, None, None


def _all_gather_rows(x: torch.Tensor, group: Group, sizes: list[int]) -> torch.Tensor:
    """Every rank's rows (`sizes[r]` of them on rank r), concatenated in rank order: one all-to-all that sends
    this rank's rows to every rank."""
    return group.all_to_all(x.repeat(group.size, *([1] * (x.dim() - 1))), [x.shape[0]] * group.size, sizes)


def _reduce_scatter_rows(x: torch.Tensor, group: Group, sizes: list[int]) -> torch.Tensor:
    """Rank r's block (the `sizes[r]` rows after those of ranks < r) of `x`, summed over the ranks: one all-to-all
    that sends each block to its rank, then the sum of what arrived."""
    mine = sizes[group.rank]
    received = group.all_to_all(x, sizes, [mine] * group.size)
    return received.view(group.size, mine, *x.shape[1:]).sum(0)


class _GatherRowsFromExpertTP(torch.autograd.Function):
    """Forward: all-gather of rows, rank r contributing `sizes[r]` (an all-to-all sending this rank's rows to
    every rank). Backward: reduce-scatter of the rows' gradients (each rank's block, summed over the ranks)."""

    @staticmethod
    def forward(ctx, x, group, sizes):
        ctx.group, ctx.sizes = group, sizes
        return _all_gather_rows(x, group, sizes)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter_rows(grad.contiguous(), ctx.group, ctx.sizes), None, None


class _ReduceScatterRowsToExpertTP(torch.autograd.Function):
    """Forward: reduce-scatter of rows, rank r keeping block r (`sizes[r]` rows) summed over the ranks.
    Backward: all-gather of the blocks' gradients (each rank's gradient is the whole sum's, for every rank)."""

    @staticmethod
    def forward(ctx, x, group, sizes):
        ctx.group, ctx.sizes = group, sizes
        return _reduce_scatter_rows(x.contiguous(), group, sizes)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather_rows(grad.contiguous(), ctx.group, ctx.sizes), None, None


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


def mean_from_cp(x: torch.Tensor, count: torch.Tensor, group=None) -> torch.Tensor:
    """The mean over the context-parallel ranks of a per-rank mean `x` over `count` tokens, weighted by the counts:
    forward one all-reduce of [x * count, count]; backward the gradient times cp x count / total.

    That backward is what the parameters need: their gradients are then averaged over DP x CP (the
    `BucketedOptimizer`), which divides by cp, so each rank's tokens weigh what they weigh in the mean
    (with equal counts, as without ignored targets, the backward is the identity).
    """
    group = as_group(group, "cp")
    return x if group.size == 1 else _MeanFromCP.apply(x, count, group)


def all_to_all_ep(x: torch.Tensor, send_sizes: list[int], recv_sizes: list[int], group=None) -> torch.Tensor:
    """Forward all-to-all of rows over the expert-parallel group (rank r gets `send_sizes[r]` rows of `x`, and
    this rank gets `recv_sizes[r]` rows from rank r, in rank order); backward the reverse all-to-all (the sizes
    swapped), which sends each row's gradient back to the rank the row came from. Dispatches tokens to the
    ranks holding their experts, and combines the experts' outputs back."""
    group = as_group(group, "ep")
    return x if group.size == 1 else _AllToAll.apply(x, group, list(send_sizes), list(recv_sizes))


def gather_from_expert_tp(x: torch.Tensor, sizes: list[int], group=None) -> torch.Tensor:
    """Forward all-gather of rows over the expert-TP group (rank r holds `sizes[r]` rows of `x`; every rank gets
    all of them in rank order), backward reduce-scatter of their gradients (each rank gets its own rows' gradient
    summed over the ranks, whose experts' width slices each contributed part of it). Megatron-Core's gather of the
    tokens an EP rank received across its expert-TP group, before the experts."""
    group = as_group(group, "expert_tp")
    return x if group.size == 1 else _GatherRowsFromExpertTP.apply(x, group, list(sizes))


def reduce_scatter_to_expert_tp(x: torch.Tensor, sizes: list[int], group=None) -> torch.Tensor:
    """Forward reduce-scatter of rows over the expert-TP group (`x`: every rank's rows in rank order, `sizes[r]`
    of rank r; each rank keeps its block summed over the ranks: the experts' outputs are partial sums over their
    width slices), backward all-gather of the blocks' gradients. The conjugate of `gather_from_expert_tp`."""
    group = as_group(group, "expert_tp")
    return x if group.size == 1 else _ReduceScatterRowsToExpertTP.apply(x, group, list(sizes))
