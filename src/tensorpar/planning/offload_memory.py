"""The memory levers in the planner (`tensorpar.config.memory_levers`): what each moves off the GPU or shrinks.

- ``--optimizer-state-dtype bf16``: AdamW's two moments take 2 bytes each instead of 4 (the precision's
  ``optimizer_bytes`` 8 -> 4); the fp32 masters stay.
- ``--optimizer-offload``: no optimizer bytes on the GPU; on the host, per rank, the moments (sharded as ZeRO shards
  them, plus the 4-byte ``step`` per tensor), an fp32 master of every element the rank steps (a copy even where the
  GPU run steps fp32 parameters in place: ZeRO-0, ZeRO-3) and an fp32 copy of its gradient slice, which the step
  reads (`tensorpar.data_parallel.host_masters`). The gradients stay on the GPU, where they are reduced.
- ``--activation-offload``: what the decoder layers save (their activations and, under autocast, their weight
  copies) lives on the host between the forward and the backward; the GPU holds, transiently, one layer's saved
  tensors brought back for its backward, and keeps the embedding's, the head's and the loss's (needed first in the
  backward: moving them would lower no peak).

What the copies cost a step (the gradient slice and the master each way once per step, the saved tensors out and
back once per micro-batch) is `tensorpar.planning.offload_time`'s.
"""

from __future__ import annotations

import dataclasses
import math

from tensorpar.config.memory_levers import MemoryLevers
from tensorpar.planning.params import ParamSummary
from tensorpar.planning.precision_recipes import Precision


def levered_precision(prec: Precision, levers: MemoryLevers) -> Precision:
    """`prec` with AdamW's moments in the levers' dtype."""
    if levers.optimizer_state_dtype == "fp32":
        return prec
    return dataclasses.replace(prec, optimizer_bytes=2 * levers.state_bytes)


def _host_bytes(numel: int, tensors: int, prec: Precision, shards: int) -> int:
    """Moments, steps, fp32 master and fp32 gradient copy of `numel` elements in `tensors` tensors, 1/shards each."""
    return (math.ceil(prec.optimizer_bytes * numel / shards) + 4 * tensors
            + 2 * math.ceil(4 * numel / shards))


def host_optimizer_bytes(summary: ParamSummary, layout, prec: Precision) -> int:
    """Host bytes of an offloaded optimizer on one rank holding `summary`'s parameters under `layout`: the dense
    parameters sharded over DP x CP by ZeRO >= 1 (one replica's ranks under HSDP), the routed experts' over
    expert-DP; the trained parameters only (LoRA: the adapters)."""
    dense, expert = summary.trained_numel - summary.trained_expert_numel, summary.trained_expert_numel
    dense_shards = layout.shards if layout.zero and layout.shards > 1 else 1
    expert_shards = layout.expert_dp if layout.zero and expert else 1
    return (_host_bytes(dense, summary.trained_tensors - summary.trained_expert_tensors, prec, dense_shards)
            + _host_bytes(expert, summary.trained_expert_tensors, prec, expert_shards))


@dataclasses.dataclass(frozen=True)
class SavedBytes:
    """What one rank of a stage keeps from its forwards for their backwards: the activations (of them, the layers'
    share ``in_layers``; ``recomputed``: what recomputation brings back during one layer's backward) and autocast's
    or fp8's weight copies (of them, the head's ``head_copies``; ``copies_alive``: those alive only while a layer
    recomputes)."""

    activations: int
    recomputed: int
    in_layers: int
    weight_copies: int
    copies_alive: int
    head_copies: int

    def offloaded(self, levers: MemoryLevers, n_layers: int) -> tuple[int, int, int]:
        """(moved to the host, activations left, weight copies left) under --activation-offload: what the layers save
        (with --activation-offload-layers the first layers' share of it); the embedding's, the head's and the loss's
        stay."""
        offloaded = levers.offloaded_layers(n_layers)
        moved_activations = self.in_layers * offloaded // max(n_layers, 1)
        moved_copies = (self.weight_copies - self.head_copies) * offloaded // max(n_layers, 1)
        return (moved_activations + moved_copies, self.activations - moved_activations,
                self.weight_copies - moved_copies)
