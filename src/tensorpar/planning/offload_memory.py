"""The memory levers in the planner (`tensorpar.config.memory_levers`): what each moves off the GPU or shrinks.

- ``--optimizer-state-dtype bf16``: AdamW's two moments take 2 bytes each instead of 4 (the precision's
  ``optimizer_bytes`` 8 -> 4); the fp32 masters stay.
- ``--optimizer-offload``: no optimizer bytes on the GPU; on the host, per rank, the moments (sharded as ZeRO shards
  them, plus the 4-byte ``step`` per tensor), an fp32 master of every element the rank steps (a copy even where the
  GPU run steps fp32 parameters in place: ZeRO-0, ZeRO-3) and an fp32 copy of its gradient slice, which the step
  reads (`tensorpar.data_parallel.host_masters`). The gradients stay on the GPU, where they are reduced.
- ``--activation-offload``: what autograd saves (the activations and, under autocast, the weight copies) lives on
  the host between the forward and the backward; the GPU holds, transiently, one layer's saved tensors brought
  back for its backward.

Step time: the copies (the gradient slice and the master each way once per step; the saved tensors out and back
once per micro-batch, the outward copies beside the compute) are not modelled.
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
