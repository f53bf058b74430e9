"""The autograd conjugates of expert parallelism: tokens to the ranks holding their experts and back, and the
rows of an expert's tokens over its expert-TP group.

=======================  ==================================  ==================================
op                       forward                             backward
=======================  ==================================  ==================================
all_to_all_ep            all-to-all (variable split sizes)   all-to-all with the sizes swapped
gather_from_expert_tp    all-gather of rows (variable        reduce-scatter of rows (variable
                         counts per rank)                    counts per rank)
reduce_scatter_to_       reduce-scatter of rows (variable    all-gather of rows (variable
expert_tp                counts per rank)                    counts per rank)
=======================  ==================================  ==================================

Every op takes the group explicitly and is the identity for a group of one rank.
"""

from __future__ import annotations

import torch

from tensorpar.distributed.comm import Group, as_group


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
