"""The tensor-parallel MLP: first matrix (or gate and up matrices) column-parallel, second row-parallel.

Gated MLPs (SwiGLU) split gate and up the same way, so each rank holds matching slices and
computes act(gate) * up locally. One all-reduce forward and one backward (or the
all-gather / reduce-scatter pair under sequence parallelism), as in the course slides.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tensorpar.distributed.comm import as_group
from tensorpar.distributed.ops import copy_to_tp, gather_from_sp
from tensorpar.layers.linear import ColumnParallelLinear, RowParallelLinear
from tensorpar.layers.tp_overlap import column_parallel_in

ACTIVATION_FNS = {
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
    "relu": F.relu,
    "silu": F.silu,
}


class ParallelMLP(nn.Module):
    def __init__(self, cfg, tp_group=None, sequence_parallel: bool = False, device=None, tp_overlap: bool = False):
        super().__init__()
        self.tp_group = as_group(tp_group)
        self.sequence_parallel, self.tp_overlap = sequence_parallel, tp_overlap
        self.act = ACTIVATION_FNS[cfg.activation]
        h, f = cfg.hidden_size, cfg.ffn_hidden_size
        column = dict(sequence_parallel=sequence_parallel, skip_input_comm=True, device=device, init=False)
        self.gate_proj = ColumnParallelLinear(h, f, self.tp_group, cfg.bias, **column) if cfg.gated_mlp else None
        self.up_proj = ColumnParallelLinear(h, f, self.tp_group, cfg.bias, **column)
        self.down_proj = RowParallelLinear(f, h, self.tp_group, cfg.bias, sequence_parallel=sequence_parallel,
                                           device=device, init=False, tp_overlap=tp_overlap)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_overlap:  # the entry's collective hidden behind the gate/up GEMMs (tensorpar.layers.tp_overlap)
            projections = [p for p in (self.gate_proj, self.up_proj) if p is not None]
            outs = column_parallel_in(x, [(p.weight, p.bias) for p in projections], self.tp_group,
                                      self.sequence_parallel)
            h = self.act(outs[0]) * outs[1] if self.gate_proj is not None else self.act(outs[0])
            return self.down_proj(h)
        x = gather_from_sp(x, self.tp_group) if self.sequence_parallel else copy_to_tp(x, self.tp_group)
        if self.gate_proj is not None:
            h = self.act(self.gate_proj(x)) * self.up_proj(x)
        else:
            h = self.act(self.up_proj(x))
        return self.down_proj(h)
