"""How a TP region's edges communicate: plain or overlapped, each with or without sequence parallelism.

A TP region is the stretch between a column-parallel entry (the input replicated or, with sequence parallelism,
sequence-sharded; each rank computes its slice of the features) and a row-parallel exit (the partial products summed
over the TP group, or reduce-scattered along the sequence). `PlainEdges` runs the collectives of
`tensorpar.tensor_parallel.mappings` beside the region's GEMMs (`tensorpar.tensor_parallel.region_gemms`, handed
in by the region); `OverlappedEdges` runs the entry and the exit as the fused ops of
`tensorpar.tensor_parallel.tp_overlap`, which hide the collectives behind GEMMs of their own, in the compute dtype:
`tp_region` pairs it with dense GEMMs only.

===========  ========================================  =================================================
method       forward                                   backward
===========  ========================================  =================================================
entry        identity (f) / SP: all-gather             all-reduce / SP: reduce-scatter of the input grad
enter        entry, then the column-parallel GEMMs     as entry (overlapped: behind the weight-grad GEMMs)
             (overlapped: the all-gather in pieces,
             each piece's GEMMs as soon as it arrives)
leave        the row-parallel GEMM, then all-reduce    none / SP: all-gather of the output gradient
             (g) / SP: reduce-scatter (overlapped: in  (overlapped: in pieces, behind the GEMMs); the bias
             pieces, behind the next piece's GEMM)     gradient under SP: all-reduce
reduce       all-reduce / SP: reduce-scatter           none / SP: all-gather
copy_params  identity                                  all-reduce of the gradients (overlapped: one for
                                                       all the parameters, flattened together)
===========  ========================================  =================================================
"""

from __future__ import annotations

import dataclasses

import torch

from tensorpar.distributed.comm import Group
from tensorpar.tensor_parallel.mappings import copy_to_tp, gather_from_sp, reduce_from_tp, reduce_scatter_to_sp
from tensorpar.tensor_parallel.region_gemms import DenseGemms, Projection
from tensorpar.tensor_parallel.tp_overlap import column_parallel_in, copy_params_to_tp, row_parallel_out


def _add_bias(y: torch.Tensor, weight=None, bias: torch.Tensor | None = None) -> torch.Tensor:
    return y if bias is None else y + bias


@dataclasses.dataclass(frozen=True)
class PlainEdges:
    """The region's collectives run beside its GEMMs, each waited for where it is made."""

    group: Group
    sequence_parallel: bool = False
    overlap = False

    def entry(self, x: torch.Tensor) -> torch.Tensor:
        """Enter the region with `x`: `copy_to_tp` (identity / all-reduce), or under SP `gather_from_sp`
        (all-gather / reduce-scatter). Never overlapped: a caller that runs its own GEMMs on the entered input
        (the chunked head and loss) takes it alone, with no GEMM here to hide it behind."""
        return gather_from_sp(x, self.group) if self.sequence_parallel else copy_to_tp(x, self.group)

    def reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """Partial results summed over the group (SP: reduce-scattered along the sequence, dimension 1)."""
        if self.sequence_parallel:
            return reduce_scatter_to_sp(partial, self.group)
        return reduce_from_tp(partial, self.group)

    def enter(self, x: torch.Tensor, projections: list[Projection], gemms: DenseGemms) -> list[torch.Tensor]:
        """`entry`, then `gemms.column`: [x W_i^T + b_i, ...] over the full sequence."""
        return gemms.column(self.entry(x), projections, self.group)

    def leave(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
              gemms: DenseGemms) -> torch.Tensor:
        """`gemms.row`, then `reduce`, then the replicated `bias` (whose gradient, under SP, is summed). A group of
        one rank reduces nothing: its bias joins the GEMM."""
        if self.group.size == 1:
            return gemms.row(x, weight, self.group, bias)
        y = self.reduce(gemms.row(x, weight, self.group))
        if bias is None:
            return y
        return gemms.affine(_add_bias, y, None, bias, self if self.sequence_parallel else None)

    def copy_params(self, *params: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        """Parameters replicated on the TP ranks, each of which used them on part of the tokens: forward identity,
        backward each one's gradient all-reduced (`copy_to_tp`). None stays None."""
        return tuple(None if p is None else copy_to_tp(p, self.group) for p in params)


@dataclasses.dataclass(frozen=True)
class OverlappedEdges(PlainEdges):
    """The entry's and exit's collectives hidden behind the GEMMs beside them (`tp_overlap`), which these ops
    run themselves in the compute dtype: the `gemms` handed in are dense (`tp_region` sees to it) and unused."""

    overlap = True

    def enter(self, x, projections, gemms):
        return column_parallel_in(x, [p.params() for p in projections], self.group, self.sequence_parallel)

    def leave(self, x, weight, bias, gemms):
        return row_parallel_out(x, weight, bias, self.group, self.sequence_parallel)

    def copy_params(self, *params):
        """As `PlainEdges.copy_params`, with one all-reduce of all the gradients flattened together."""
        present = iter(copy_params_to_tp([p for p in params if p is not None], self.group))
        return tuple(None if p is None else next(present) for p in params)
