"""The tensor-parallel MLP: first matrix (or gate and up matrices) column-parallel, second row-parallel.

Gated MLPs (SwiGLU) split gate and up the same way, so each rank holds matching slices and
computes act(gate) * up locally. One all-reduce forward and one backward (or the
all-gather / reduce-scatter pair under sequence parallelism), as in the course slides.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tensorpar.tensor_parallel.linear import ColumnParallelLinear, RowParallelLinear
from tensorpar.tensor_parallel.region import as_region

ACTIVATION_FNS = {
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
    "relu": F.relu,
    "silu": F.silu,
}


class ParallelMLP(nn.Module):
    def __init__(self, cfg, region=None, device=None, exit_region=None):
        """`region`: the model's `TPRegion` (or a mesh / group: plain collectives); `exit_region`, if given, the
        one `down_proj` leaves by (default: `region`)."""
        super().__init__()
        self.region = as_region(region)
        self.tp_group, self.sequence_parallel = self.region.group, self.region.sequence_parallel
        self.act = ACTIVATION_FNS[cfg.activation]
        h, f, bias = cfg.hidden_size, cfg.ffn_hidden_size, cfg.mlp_has_bias
        column = dict(device=device, init=False)
        self.gate_proj = ColumnParallelLinear(h, f, self.region, bias, **column) if cfg.gated_mlp else None
        self.up_proj = ColumnParallelLinear(h, f, self.region, bias, **column)
        self.down_proj = RowParallelLinear(f, h, exit_region or self.region, bias, device=device, init=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        projections = [p.projection() for p in (self.gate_proj, self.up_proj) if p is not None]
        outs = self.region.enter(x, projections)  # gate and up share x: the region is entered once
        h = self.act(outs[0]) * outs[1] if self.gate_proj is not None else self.act(outs[0])
        return self.down_proj(h)
