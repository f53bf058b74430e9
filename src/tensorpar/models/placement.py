"""Where and how a rank runs its part of the model, as one value: the `Transformer` takes its architecture config
and a `Placement`.

A placement holds the TP region (how the layers' edges communicate and how their GEMMs run), the context-parallel
group with its attention and split, the expert-parallel and expert-TP groups, the pipeline stage this rank holds,
activation recomputation, the fused head and loss's chunk, the device, and the kernels of attention within packed
documents and of the routed experts. `Placement.on(mesh, ...)` makes one from a mesh and the run's knobs
(`tensorpar.models.build.build_transformer` is the one place the training, eval, generate and serve commands do);
`Placement.on(None)` is one process with everything.
"""

from __future__ import annotations

import dataclasses

from tensorpar.config.choices import RECOMPUTE_MODES
from tensorpar.context_parallel.ring_attention import ContextSplit
from tensorpar.distributed.comm import Group, as_group
from tensorpar.errors import TensorparError
from tensorpar.pipeline_parallel.weight_grad import WeightGradQueue
from tensorpar.tensor_parallel.fp8_scaling import Fp8Recipe
from tensorpar.tensor_parallel.region import TPRegion, tp_region


@dataclasses.dataclass(frozen=True)
class PipelineStage:
    """The layers a rank holds (global indices; None: all of them) and whether it holds the first stage (the
    embedding) and the last (the final norm, the head and the loss)."""

    layers: tuple[int, ...] | None = None
    first: bool = True
    last: bool = True

    @classmethod
    def of(cls, layout, num_layers: int, pp_rank: int) -> "PipelineStage":
        """Pipeline rank `pp_rank`'s stage under `layout` (a `ParallelLayout`): its chunks' layers and ends."""
        if layout is None or layout.pp == 1:
            return cls()
        split = layout.split(num_layers)
        return cls(tuple(split.layers_of(pp_rank)), *split.holds_ends(pp_rank))


@dataclasses.dataclass(frozen=True)
class Placement:
    """See the module docstring. `exit_region`: the region the MLP's down projection leaves by;
    `document_attention`: the kernel of attention within packed documents (`functional.varlen_attention`);
    `expert_gemm`: the routed experts' GEMMs grouped in one call or one per expert (`expert_parallel.experts`)."""

    region: TPRegion
    cp_group: Group
    ep_group: Group
    expert_tp_group: Group
    cp_impl: str = "ring"
    cp_split: str = "zigzag"
    stage: PipelineStage = PipelineStage()
    recompute: str = "none"
    loss_chunk_tokens: int | None = None
    device: object = None
    document_attention: str = "auto"
    expert_gemm: str = "grouped"

    def __post_init__(self):
        if self.recompute not in RECOMPUTE_MODES:
            raise TensorparError(f"recompute must be one of {RECOMPUTE_MODES}, got {self.recompute!r}")
        if self.loss_chunk_tokens is not None and self.loss_chunk_tokens < 1:
            raise TensorparError(f"loss_chunk_tokens must be a positive number of tokens or None, "
                                 f"got {self.loss_chunk_tokens}")

    @classmethod
    def on(cls, mesh=None, *, sequence_parallel: bool = False, tp_overlap: bool = True,
           weight_grads: WeightGradQueue | None = None, fp8: Fp8Recipe | None = None, cp_impl: str = "ring",
           cp_split: str = "zigzag", stage: PipelineStage = PipelineStage(), recompute: str = "none",
           loss_chunk_tokens: int | None = None, device=None, document_attention: str = "auto",
           expert_gemm: str = "grouped") -> "Placement":
        """The placement of a rank of `mesh` (a Mesh, a TP Group, or None for one process): the TP region of its TP group
        (`tensorpar.tensor_parallel.region`: SP, overlap, a split backward's `weight_grads` queue, fp8 GEMMs), its
        CP / EP / expert-TP groups, and the rest as given; the device defaults to the mesh's."""
        region = tp_region(as_group(mesh, "tp"), sequence_parallel=sequence_parallel, overlap=tp_overlap,
                           weight_grads=weight_grads, fp8=fp8)
        others = None if isinstance(mesh, Group) else mesh  # a TP group alone: one rank in every other dimension
        return cls(region, as_group(others, "cp"), as_group(others, "ep"), as_group(others, "expert_tp"), cp_impl,
                   cp_split, stage, recompute, loss_chunk_tokens,
                   device if device is not None else getattr(mesh, "device", None), document_attention, expert_gemm)

    @property
    def exit_region(self) -> TPRegion:
        """Full recomputation stops re-running a block's forward once every tensor its backward saved is back, so a
        plain row-parallel exit's reduction is not repeated; in the overlapped exit that reduction runs inside the op
        that saves them, and would be. The block's last exit (the MLP's) therefore leaves by plain collectives."""
        return self.region.without_overlap() if self.recompute == "full" else self.region

    def context(self, seq_len: int) -> ContextSplit | None:
        """How a sequence of `seq_len` positions lies across the CP ranks (None without context parallelism)."""
        if self.cp_group.size == 1:
            return None
        return ContextSplit(self.cp_group, seq_len, self.cp_split, self.cp_impl)


def as_placement(x) -> Placement:
    """A Placement as given, else the default placement on `x` (a Mesh, or None for one process)."""
    return x if isinstance(x, Placement) else Placement.on(x)
