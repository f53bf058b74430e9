"""How a TP region's GEMMs run: one of three values, chosen once per run by `region.tp_region`.

- `DenseGemms`: in the compute dtype, every gradient in the backward (the default);
- `Fp8Gemms`: the column- and row-parallel products and the experts' run in fp8, with scales that agree across the
  group (`tensorpar.tensor_parallel.fp8_linear`); everything else as dense (embeddings, norms, routers);
- `SplitBackwardGemms`: a zero-bubble schedule's split backward: every product's backward computes the input
  gradient only and leaves the weight gradients in a `WeightGradQueue` (`tensorpar.pipeline_parallel.weight_grad`).

They run local products only: the collectives at the region's edges are those of
`tensorpar.tensor_parallel.region_edges`, which hand the entered input to `column` and reduce what `row` returns.
Two exceptions, named where they occur: fp8's amax all-reduces (max) over the group (`fp8_linears`), and the
gradient of a parameter replicated on the TP ranks, which each rank computed from part of the tokens: `affine` and
`linear` take the region's edges as ``summed_by`` and either pass the parameters through `summed_by.copy_params`
(forward identity, backward all-reduce) or, under the split backward, leave that all-reduce to the deferred
weight-gradient work (W).

========  =================================  =================================  =================================
method    dense                              fp8                                split backward
========  =================================  =================================  =================================
column    [x W_i^T + b_i]                    fp8 GEMMs (amax all-reduce "out")  W_i's, b_i's gradients queued
row       x W^T (a partial sum)              fp8 GEMM (amax all-reduce "in")    W's gradient queued
affine    fn(x, w, b) (a norm, a bias)       as dense                           w's, b's gradients queued
linear    x W^T + b (a replicated weight)    as dense                           W's, b's gradients queued
stacked   x W[i]^T (one expert of a stack)   fp8 GEMM (expert TP's split)       W[i]'s gradient queued
grouped   every expert of a stack in one     none: the experts take `stacked`   none: as fp8
          GEMM (`functional.grouped_gemm`)
lookup    W[ids] (fp32 gradient sums)        as dense                           W's gradient queued
========  =================================  =================================  =================================
"""

from __future__ import annotations

import dataclasses
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F

from tensorpar.distributed.comm import Group
from tensorpar.functional.grouped_gemm import grouped_mm
from tensorpar.pipeline_parallel import weight_grad
from tensorpar.tensor_parallel.fp8_linear import fp8_linears
from tensorpar.tensor_parallel.fp8_scaling import Fp8Recipe
from tensorpar.tensor_parallel.lookup import embedding_lookup

GradReduce = Callable[[torch.Tensor], torch.Tensor]
Stacked = Callable[[torch.Tensor, int], torch.Tensor]
Grouped = Callable[[torch.Tensor, list], torch.Tensor]


class _ReduceGrad(torch.autograd.Function):
    """Forward: identity. Backward: `reduce` applied to the gradient."""

    @staticmethod
    def forward(ctx, t, reduce: GradReduce):
        ctx.reduce = reduce
        return t.view_as(t)

    @staticmethod
    def backward(ctx, grad):
        return ctx.reduce(grad), None


def with_grad_reduce(t: torch.Tensor | None, reduce: GradReduce | None) -> torch.Tensor | None:
    """`t` whose gradient passes through `reduce` (forward identity); `t` itself without a reduce."""
    return t if t is None or reduce is None else _ReduceGrad.apply(t, reduce)


class Projection(NamedTuple):
    """A column-parallel product's parameters: y = x W^T + b; `grad_reduce`, when set, is applied to the
    gradients of W and b (KV heads replicated on several TP ranks: summed over the copies)."""

    weight: torch.Tensor
    bias: torch.Tensor | None = None
    grad_reduce: GradReduce | None = None

    def params(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(W, b), each with `grad_reduce` applied to its gradient."""
        return with_grad_reduce(self.weight, self.grad_reduce), with_grad_reduce(self.bias, self.grad_reduce)


@dataclasses.dataclass(frozen=True)
class DenseGemms:
    """Products in the compute dtype; every gradient computed in the backward."""

    fp8 = None  # the recipe, for Fp8Gemms
    weight_grads = None  # the queue, for SplitBackwardGemms

    def column(self, x: torch.Tensor, projections: list[Projection], group: Group) -> list[torch.Tensor]:
        """[x W_i^T + b_i] of the column-parallel `projections` sharing the entered input `x`."""
        return [F.linear(x, *p.params()) for p in projections]

    def row(self, x: torch.Tensor, weight: torch.Tensor, group: Group,
            bias: torch.Tensor | None = None) -> torch.Tensor:
        """The row-parallel product x W^T: this rank's partial sum, before the exit's reduction. `bias` only where
        there is no reduction (a group of one rank): added in the GEMM, as nn.Linear adds it."""
        return F.linear(x, weight, bias)

    def affine(self, fn, x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
               summed_by=None) -> torch.Tensor:
        """``fn(x, weight, bias)`` of an elementwise scale and shift (``fn(x)`` alone: the same without them);
        with ``summed_by`` (the region's edges) the parameters' gradients are summed over its group."""
        if summed_by is not None:
            weight, bias = summed_by.copy_params(weight, bias)
        return fn(x, weight, bias)

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
               summed_by=None) -> torch.Tensor:
        """``F.linear(x, weight, bias)`` of a replicated weight; ``summed_by`` as in `affine`."""
        if summed_by is not None:
            weight, bias = summed_by.copy_params(weight, bias)
        return F.linear(x, weight, bias)

    def stacked(self, weight: torch.Tensor, group: Group | None, split: str | None) -> Stacked:
        """``f(x, i) = x @ weight[i]^T`` for stacked weights [n, out, in]: the stack is unbound once, so that its
        backward stacks the slices' gradients in one op (indexing each slice would allocate a whole zero gradient
        per slice)."""
        slices = weight.unbind(0)
        return lambda x, i: x @ slices[i].t()

    def grouped(self, weight: torch.Tensor) -> Grouped | None:
        """``f(x, sizes)``: the rows of x grouped by `sizes` times their slice of the stacked weights [n, out, in],
        in one grouped GEMM; None where the slices take GEMMs of their own (`stacked`: fp8, the split backward)."""
        return lambda x, sizes: grouped_mm(x, weight, sizes)

    def lookup(self, ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """``F.embedding(ids, weight)``, the gradient accumulated in fp32 for a bf16/fp16 table."""
        return embedding_lookup(ids, weight)


@dataclasses.dataclass(frozen=True)
class Fp8Gemms(DenseGemms):
    """The column- and row-parallel products and the experts' in fp8 (``--dtype fp8``), with scales that agree
    across the group: `fp8_linears` and its `split` ("out": a column-parallel weight's rows are split, "in": a
    row-parallel one's columns). The rest as `DenseGemms`."""

    fp8: Fp8Recipe = dataclasses.field()  # required (not DenseGemms's None)

    def column(self, x, projections, group):
        ys = fp8_linears(x, [with_grad_reduce(p.weight, p.grad_reduce) for p in projections], self.fp8, group, "out")
        return [y if p.bias is None else y + with_grad_reduce(p.bias, p.grad_reduce) for y, p in zip(ys, projections)]

    def row(self, x, weight, group, bias=None):
        y = fp8_linears(x, [weight], self.fp8, group, "in")[0]
        return y if bias is None else y + bias

    def stacked(self, weight, group, split):
        """As `DenseGemms.stacked`, each slice in fp8; `group` and `split` say how each slice is split (expert
        TP: "out" for the experts' column-parallel projections, "in" for the row-parallel one)."""
        slices = weight.unbind(0)
        return lambda x, i: fp8_linears(x, [slices[i]], self.fp8, group, split)[0]

    def grouped(self, weight):
        return None  # each expert's fp8 GEMM scales its own slice


@dataclasses.dataclass(frozen=True)
class SplitBackwardGemms(DenseGemms):
    """Every product's backward computes the input gradient only and queues its weight gradients in
    `weight_grads`; a replicated parameter's all-reduce (``summed_by``) runs in the queued work."""

    weight_grads: weight_grad.WeightGradQueue = dataclasses.field()  # required (not DenseGemms's None)

    def column(self, x, projections, group):
        return [weight_grad.linear(x, p.weight, p.bias, self.weight_grads, reduce=p.grad_reduce) for p in projections]

    def row(self, x, weight, group, bias=None):
        return weight_grad.linear(x, weight, bias, self.weight_grads)

    def affine(self, fn, x, weight, bias, summed_by=None):
        return weight_grad.affine(fn(x), weight, bias, self.weight_grads, reduce=self._reduce(summed_by))

    def linear(self, x, weight, bias=None, summed_by=None):
        return weight_grad.linear(x, weight, bias, self.weight_grads, reduce=self._reduce(summed_by))

    def stacked(self, weight, group, split):
        return lambda x, i: weight_grad.linear(x, weight, None, self.weight_grads, index=i)

    def grouped(self, weight):
        return None  # each expert's weight gradient is queued on its own

    def lookup(self, ids, weight):
        return weight_grad.embedding(ids, weight, self.weight_grads)

    @staticmethod
    def _reduce(summed_by) -> GradReduce | None:
        return None if summed_by is None else weight_grad.summed_over(summed_by.group)
