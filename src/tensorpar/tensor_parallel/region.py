"""How a rank's layers enter and leave tensor-parallel regions: one object, built once from the run's options.

A TP region is the stretch between a column-parallel entry (the input replicated or, with sequence
parallelism, sequence-sharded; each rank computes its slice of the features) and a row-parallel exit (the
partial products summed over the TP group, or reduce-scattered along the sequence). How the entry and the
exit communicate is a policy of the whole run, not of a layer, and `TPRegion` holds it:

- ``group``: the TP group;
- ``sequence_parallel``: activations outside the regions are sequence shards (all-gather in, reduce-scatter out);
- ``overlap``: the entry's and exit's collectives are hidden behind the GEMMs beside them
  (`tensorpar.tensor_parallel.tp_overlap`); off for a group of one rank and under a split backward;
- ``weight_grads``: a `WeightGradQueue` (zero-bubble schedules): every layer's backward computes the input
  gradient only and leaves its weight gradients in the queue (`tensorpar.pipeline_parallel.weight_grad`);
- ``fp8``: an `Fp8Recipe` (``--dtype fp8``): the column- and row-parallel GEMMs (`enter`, `leave`) and the
  experts' (`stacked_linear`) run in fp8 with scales that agree across the group
  (`tensorpar.tensor_parallel.fp8_linear`); their collectives are then the plain ones (no overlap), and a split
  backward is refused. Embeddings, the LM head, routers and norms keep the compute dtype.

The layers have one forward each and ask the region: `enter` (column-parallel projections sharing an input;
`entry`: its collective alone),
`leave` (the row-parallel product and its reduction), `replicated` (parameters replicated on the TP ranks, such
as a norm's, whose gradients are summed over them when each rank sees part of the tokens), `reduce` (partial
results summed over TP, e.g. a vocabulary-parallel embedding's), `linear` (a local product whose weight gradient
may be deferred), `stacked_linear` (one expert's slice of stacked expert weights) and `lookup` (an embedding).
Each chooses, in one place, among the plain collectives, the overlapped ones and the split backward.

============  =======================================  ==============================================
method        forward                                  backward
============  =======================================  ==============================================
enter         identity (f) / SP: all-gather            all-reduce / SP: reduce-scatter of the input grad
entry         as enter, without the GEMMs              as enter
leave         all-reduce (g) / SP: reduce-scatter      none / SP: all-gather of the output gradient
replicated    identity                                 all-reduce of the parameters' gradients (summed)
reduce        all-reduce / SP: reduce-scatter          none / SP: all-gather
============  =======================================  ==============================================
"""

from __future__ import annotations

import dataclasses
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F

from tensorpar.distributed.comm import Group, as_group
from tensorpar.errors import TensorparError
from tensorpar.pipeline_parallel import weight_grad
from tensorpar.tensor_parallel.fp8_linear import fp8_linears
from tensorpar.tensor_parallel.fp8_scaling import Fp8Recipe
from tensorpar.tensor_parallel.lookup import embedding_lookup
from tensorpar.tensor_parallel.mappings import copy_to_tp, gather_from_sp, reduce_from_tp, reduce_scatter_to_sp
from tensorpar.tensor_parallel.tp_overlap import column_parallel_in, copy_params_to_tp, row_parallel_out

GradReduce = Callable[[torch.Tensor], torch.Tensor]


class Projection(NamedTuple):
    """A column-parallel product's parameters: y = x W^T + b; `grad_reduce`, when set, is applied to the
    gradients of W and b (KV heads replicated on several TP ranks: summed over the copies)."""

    weight: torch.Tensor
    bias: torch.Tensor | None = None
    grad_reduce: GradReduce | None = None


class _ReduceGrad(torch.autograd.Function):
    """Forward: identity. Backward: `reduce` applied to the gradient."""

    @staticmethod
    def forward(ctx, t, reduce: GradReduce):
        ctx.reduce = reduce
        return t.view_as(t)

    @staticmethod
    def backward(ctx, grad):
        return ctx.reduce(grad), None


def _with_grad_reduce(t: torch.Tensor | None, reduce: GradReduce | None) -> torch.Tensor | None:
    return t if t is None or reduce is None else _ReduceGrad.apply(t, reduce)


@dataclasses.dataclass(frozen=True)
class TPRegion:
    """The TP group and how this run's layers communicate at the edges of its regions (see the module docstring)."""

    group: Group
    sequence_parallel: bool = False
    overlap: bool = False
    weight_grads: weight_grad.WeightGradQueue | None = None
    fp8: Fp8Recipe | None = None

    def __post_init__(self):
        alone = self.group.size == 1
        if self.fp8 is not None and self.weight_grads is not None:
            raise TensorparError("fp8 GEMMs cannot run under a split backward (zero-bubble schedules): use 1f1b or "
                                 "interleaved with --dtype fp8")
        # SP needs ranks to shard over; overlap hides collectives a single rank does not make, and a split backward
        # defers the weight-gradient GEMMs it would hide them behind. The overlapped ops run their own GEMMs, in the
        # compute dtype, so fp8 takes the plain collectives.
        object.__setattr__(self, "sequence_parallel", self.sequence_parallel and not alone)
        object.__setattr__(self, "overlap", self.overlap and not alone and self.weight_grads is None
                           and self.fp8 is None)

    def without_overlap(self) -> "TPRegion":
        """The same region with plain collectives (the exit that full recomputation replays)."""
        return dataclasses.replace(self, overlap=False)

    def without_fp8(self) -> "TPRegion":
        """The same region with GEMMs in the compute dtype (the LM head's)."""
        return self if self.fp8 is None else dataclasses.replace(self, fp8=None)

    # -- the edges of a TP region ------------------------------------------------------------------

    def enter(self, x: torch.Tensor, projections: list[Projection]) -> list[torch.Tensor]:
        """Enter the region with `x` (replicated, or with SP this rank's sequence shard) and apply the
        column-parallel `projections` that share it: [x W_i^T + b_i, ...] over the full sequence."""
        if self.overlap:
            params = [(_with_grad_reduce(p.weight, p.grad_reduce), _with_grad_reduce(p.bias, p.grad_reduce))
                      for p in projections]
            return column_parallel_in(x, params, self.group, self.sequence_parallel)
        x = self.entry(x)
        if self.fp8 is not None:
            ys = fp8_linears(x, [_with_grad_reduce(p.weight, p.grad_reduce) for p in projections], self.fp8,
                             self.group, "out")
            return [y if p.bias is None else y + _with_grad_reduce(p.bias, p.grad_reduce)
                    for y, p in zip(ys, projections)]
        if self.weight_grads is not None:
            return [weight_grad.linear(x, p.weight, p.bias, self.weight_grads, reduce=p.grad_reduce)
                    for p in projections]
        return [F.linear(x, _with_grad_reduce(p.weight, p.grad_reduce), _with_grad_reduce(p.bias, p.grad_reduce))
                for p in projections]

    def entry(self, x: torch.Tensor) -> torch.Tensor:
        """`enter`'s collective alone, for a caller that runs its own GEMMs on the entered input (the chunked
        head and loss): `copy_to_tp` (identity / all-reduce), or under SP `gather_from_sp` (all-gather /
        reduce-scatter). Never overlapped: there is no GEMM here to hide it behind."""
        return gather_from_sp(x, self.group) if self.sequence_parallel else copy_to_tp(x, self.group)

    def leave(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """The row-parallel product x W^T summed over the group (SP: reduce-scattered along the sequence), leaving
        the region, plus the replicated `bias` (whose gradient, under SP, is summed over the group)."""
        if self.overlap:
            return row_parallel_out(x, weight, bias, self.group, self.sequence_parallel)
        if self.fp8 is not None:
            y = self.reduce(fp8_linears(x, [weight], self.fp8, self.group, "in")[0])
        else:
            y = self.reduce(weight_grad.linear(x, weight, None, self.weight_grads))
        if bias is None:
            return y
        if self.weight_grads is not None:
            reduce = weight_grad.summed_over(self.group) if self.sequence_parallel else None
            return weight_grad.affine(y, None, bias, self.weight_grads, reduce=reduce)
        return y + (copy_to_tp(bias, self.group) if self.sequence_parallel else bias)

    def reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """Partial results summed over the group (SP: reduce-scattered along the sequence, dimension 1)."""
        if self.sequence_parallel:
            return reduce_scatter_to_sp(partial, self.group)
        return reduce_from_tp(partial, self.group)

    # -- parameters replicated on the TP ranks -----------------------------------------------------

    def replicated(self, fn, x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None = None,
                   summed: bool | None = None) -> torch.Tensor:
        """``fn(x, weight, bias)`` of an elementwise scale and shift (`fn(x)` alone must be the same without them:
        a norm's normalisation) whose parameters are replicated on the TP ranks. With ``summed`` (default: under
        SP, where each rank sees its sequence shard) their gradients are summed over the group: one all-reduce
        of both with overlap, one each without."""
        summed = self.sequence_parallel if summed is None else summed
        if self.weight_grads is not None:
            reduce = weight_grad.summed_over(self.group) if summed else None
            return weight_grad.affine(fn(x), weight, bias, self.weight_grads, reduce=reduce)
        if summed and self.overlap:
            weight, *rest = copy_params_to_tp([p for p in (weight, bias) if p is not None], self.group)
            bias = rest[0] if rest else None
        elif summed:
            weight, bias = (None if p is None else copy_to_tp(p, self.group) for p in (weight, bias))
        return fn(x, weight, bias)

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
               summed: bool = False) -> torch.Tensor:
        """``F.linear(x, weight, bias)`` of a weight replicated on the TP ranks (a router, a shared expert's
        gate): with ``summed`` its gradient is summed over the group (each rank saw part of the tokens)."""
        if self.weight_grads is not None:
            reduce = weight_grad.summed_over(self.group) if summed else None
            return weight_grad.linear(x, weight, bias, self.weight_grads, reduce=reduce)
        if summed:
            weight, bias = (None if p is None else copy_to_tp(p, self.group) for p in (weight, bias))
        return F.linear(x, weight, bias)

    def stacked_linear(self, weight: torch.Tensor, group: Group | None = None,
                       split: str | None = None) -> Callable[[torch.Tensor, int], torch.Tensor]:
        """``f(x, i) = x @ weight[i]^T`` for stacked weights [n, out, in] (a rank's experts): the stack is
        unbound once, so that its backward stacks the slices' gradients in one op (indexing each slice would
        allocate a whole zero gradient per slice); under a split backward each slice's gradient is deferred.
        Under fp8, `group` and `split` say how each slice is split (expert TP: "out" for the experts' column-
        parallel projections, "in" for the row-parallel one; see `fp8_linears`)."""
        if self.weight_grads is not None:
            return lambda x, i: weight_grad.linear(x, weight, None, self.weight_grads, index=i)
        slices = weight.unbind(0)
        if self.fp8 is not None:
            return lambda x, i: fp8_linears(x, [slices[i]], self.fp8, group, split)[0]
        return lambda x, i: x @ slices[i].t()

    def lookup(self, ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """``F.embedding(ids, weight)``: the weight gradient accumulated in fp32 for a bf16/fp16 table, or left in
        the queue under a split backward."""
        if self.weight_grads is not None:
            return weight_grad.embedding(ids, weight, self.weight_grads)
        return embedding_lookup(ids, weight)


def as_region(x) -> TPRegion:
    """A TPRegion as given, else one of plain collectives over the TP group of `x` (a Mesh, a Group, a torch
    ProcessGroup, or None for one rank): what a layer built outside a model (from_dense, a test) takes."""
    return x if isinstance(x, TPRegion) else TPRegion(as_group(x, "tp"))
