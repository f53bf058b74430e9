"""How a rank's layers enter and leave tensor-parallel regions: one value, built once from the run's options.

A TP region is the stretch between a column-parallel entry (the input replicated or, with sequence
parallelism, sequence-sharded; each rank computes its slice of the features) and a row-parallel exit (the
partial products summed over the TP group, or reduce-scattered along the sequence). How a run does this is a
policy of the whole run, not of a layer, and it has two independent parts, which `TPRegion` composes:

- its ``edges`` (`tensorpar.tensor_parallel.region_edges`): how the entry and the exit communicate over the TP
  ``group``, `PlainEdges` or `OverlappedEdges` (the collectives hidden behind the GEMMs beside them,
  `tensorpar.tensor_parallel.tp_overlap`), each with or without ``sequence_parallel`` (activations outside the
  regions are sequence shards: all-gather in, reduce-scatter out);
- its ``gemms`` (`tensorpar.tensor_parallel.region_gemms`): how the products run, `DenseGemms`, `Fp8Gemms`
  (``--dtype fp8``: the column- and row-parallel GEMMs and the experts' in fp8, scales agreed across the group)
  or `SplitBackwardGemms` (zero-bubble schedules: weight gradients left in a `WeightGradQueue`,
  `tensorpar.pipeline_parallel.weight_grad`).

`tp_region` builds it and is the one place that knows which combinations run (its docstring lists the rules).
The layers have one forward each and ask the region: `enter` (column-parallel projections sharing an input; `entry`:
its collective alone; `column`: the GEMMs alone), `leave` (the row-parallel product and its reduction), `replicated`
(parameters replicated on the TP ranks, such as a norm's, whose gradients are summed over them when each rank sees
part of the tokens), `reduce` (partial results summed over TP, e.g. a vocabulary-parallel embedding's), `linear` (a
local product of a replicated weight), `stacked_linear` (one expert's slice of stacked expert weights) and `lookup`
(an embedding). Each is one line: the collectives are the edges', the products the GEMMs'.

============  ============  =======================================  ==============================================
method        asks          forward                                  backward
============  ============  =======================================  ==============================================
enter         edges, gemms  identity (f) / SP: all-gather            all-reduce / SP: reduce-scatter of the input grad
entry         edges         as enter, without the GEMMs              as enter
column        gemms         none (the GEMMs of an entered input)     none
leave         edges, gemms  all-reduce (g) / SP: reduce-scatter      none / SP: all-gather of the output gradient
replicated    gemms, edges  identity                                 all-reduce of the parameters' gradients (summed)
linear        gemms, edges  identity                                 as replicated, when summed
reduce        edges         all-reduce / SP: reduce-scatter          none / SP: all-gather
stacked_...   gemms         none (fp8: the amax all-reduce)          none (fp8: the amax all-reduce)
lookup        gemms         none                                     none
============  ============  =======================================  ==============================================

Under the split backward, the backward's all-reduce of a replicated parameter's gradient runs in the deferred
weight-gradient work instead; under fp8, `fp8_linears` adds its small all-reduces (max) of the amaxes.
"""

from __future__ import annotations

import dataclasses

import torch

from tensorpar.distributed.comm import Group, as_group
from tensorpar.errors import TensorparError
from tensorpar.pipeline_parallel.weight_grad import WeightGradQueue
from tensorpar.tensor_parallel.fp8_scaling import Fp8Recipe
from tensorpar.tensor_parallel.region_edges import OverlappedEdges, PlainEdges
from tensorpar.tensor_parallel.region_gemms import DenseGemms, Fp8Gemms, Projection, SplitBackwardGemms, Stacked

__all__ = ["Projection", "TPRegion", "as_region", "tp_region"]


@dataclasses.dataclass(frozen=True)
class TPRegion:
    """How this run's layers communicate at the edges of its TP regions and run the GEMMs inside them (see the
    module docstring). Build it with `tp_region`."""

    edges: PlainEdges
    gemms: DenseGemms

    @property
    def group(self) -> Group:
        return self.edges.group

    @property
    def sequence_parallel(self) -> bool:
        return self.edges.sequence_parallel

    @property
    def overlap(self) -> bool:
        return self.edges.overlap

    @property
    def weight_grads(self) -> WeightGradQueue | None:
        return self.gemms.weight_grads

    @property
    def fp8(self) -> Fp8Recipe | None:
        return self.gemms.fp8

    def without_overlap(self) -> "TPRegion":
        """The same region with plain collectives (the exit that full recomputation replays)."""
        return tp_region(self.group, sequence_parallel=self.sequence_parallel, weight_grads=self.weight_grads,
                         fp8=self.fp8)

    def without_fp8(self) -> "TPRegion":
        """The same region with GEMMs in the compute dtype (the LM head's)."""
        if self.fp8 is None:
            return self
        return tp_region(self.group, sequence_parallel=self.sequence_parallel, overlap=self.overlap,
                         weight_grads=self.weight_grads)

    # -- the edges of a TP region ------------------------------------------------------------------

    def enter(self, x: torch.Tensor, projections: list[Projection]) -> list[torch.Tensor]:
        """Enter the region with `x` (replicated, or with SP this rank's sequence shard) and apply the
        column-parallel `projections` that share it: [x W_i^T + b_i, ...] over the full sequence."""
        return self.edges.enter(x, projections, self.gemms)

    def entry(self, x: torch.Tensor) -> torch.Tensor:
        """`enter`'s collective alone, for a caller that runs its own GEMMs on the entered input (the chunked
        head and loss): `copy_to_tp` (identity / all-reduce), or under SP `gather_from_sp` (all-gather /
        reduce-scatter). Never overlapped: there is no GEMM here to hide it behind."""
        return self.edges.entry(x)

    def column(self, x: torch.Tensor, projections: list[Projection]) -> list[torch.Tensor]:
        """The column-parallel `projections` of `x`, already in the region (what `entry` returned, or a tensor
        computed from it: latent attention's up-projections of its entered latents)."""
        return self.gemms.column(x, projections, self.group)

    def leave(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """The row-parallel product x W^T summed over the group (SP: reduce-scattered along the sequence), leaving
        the region, plus the replicated `bias` (whose gradient, under SP, is summed over the group)."""
        return self.edges.leave(x, weight, bias, self.gemms)

    def reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """Partial results summed over the group (SP: reduce-scattered along the sequence, dimension 1)."""
        return self.edges.reduce(partial)

    # -- local products --------------------------------------------------------------------------

    def replicated(self, fn, x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None = None,
                   summed: bool | None = None) -> torch.Tensor:
        """``fn(x, weight, bias)`` of an elementwise scale and shift (`fn(x)` alone must be the same without them:
        a norm's normalisation) whose parameters are replicated on the TP ranks. With ``summed`` (default: under
        SP, where each rank sees its sequence shard) their gradients are summed over the group: one all-reduce
        of both with overlap, one each without."""
        summed = self.sequence_parallel if summed is None else summed
        return self.gemms.affine(fn, x, weight, bias, self.edges if summed else None)

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
               summed: bool = False) -> torch.Tensor:
        """``F.linear(x, weight, bias)`` of a weight replicated on the TP ranks (a router, a shared expert's
        gate): with ``summed`` its gradient is summed over the group (each rank saw part of the tokens)."""
        return self.gemms.linear(x, weight, bias, self.edges if summed else None)

    def stacked_linear(self, weight: torch.Tensor, group: Group | None = None, split: str | None = None) -> Stacked:
        """``f(x, i) = x @ weight[i]^T`` for stacked weights [n, out, in] (a rank's experts); under fp8, `group`
        and `split` say how each slice is split (see `Fp8Gemms.stacked`)."""
        return self.gemms.stacked(weight, group, split)

    def grouped_linear(self, weight: torch.Tensor):
        """``f(x, sizes)``: the rows of x grouped by `sizes` times their slice of stacked weights [n, out, in] in one
        grouped GEMM, or None where the region's GEMMs take each slice on its own (fp8, the split backward)."""
        return self.gemms.grouped(weight)

    def lookup(self, ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """``F.embedding(ids, weight)``: the weight gradient accumulated in fp32 for a bf16/fp16 table, or left in
        the queue under a split backward."""
        return self.gemms.lookup(ids, weight)


def tp_region(group, *, sequence_parallel: bool = False, overlap: bool = False,
              weight_grads: WeightGradQueue | None = None, fp8: Fp8Recipe | None = None) -> TPRegion:
    """The region of a run over the TP `group` (a Group, a Mesh, a torch ProcessGroup, or None for one rank). The
    rules, all here:

    - fp8 GEMMs with a split backward (``weight_grads``, zero-bubble schedules): refused;
    - the GEMMs: fp8 when ``fp8`` is given, else split-backward ones when ``weight_grads`` is, else dense;
    - sequence parallelism: only on a group of more than one rank (it needs ranks to shard over);
    - overlap: only on a group of more than one rank (one rank makes no collectives to hide) and only with the
      dense GEMMs: the overlapped ops run their own GEMMs in the compute dtype, so fp8 takes the plain
      collectives, and a split backward defers the weight-gradient GEMMs they would hide the collectives behind.
    """
    group = as_group(group, "tp")
    if fp8 is not None and weight_grads is not None:
        raise TensorparError("fp8 GEMMs cannot run under a split backward (zero-bubble schedules): use 1f1b or "
                             "interleaved with --dtype fp8")
    alone = group.size == 1
    if fp8 is not None:
        gemms = Fp8Gemms(fp8)
    elif weight_grads is not None:
        gemms = SplitBackwardGemms(weight_grads)
    else:
        gemms = DenseGemms()
    edges = OverlappedEdges if overlap and not alone and fp8 is None and weight_grads is None else PlainEdges
    return TPRegion(edges(group, sequence_parallel and not alone), gemms)


def as_region(x) -> TPRegion:
    """A TPRegion as given, else one of plain collectives over the TP group of `x` (a Mesh, a Group, a torch
    ProcessGroup, or None for one rank): what a layer built outside a model (from_dense, a test) takes."""
    return x if isinstance(x, TPRegion) else tp_region(x)
