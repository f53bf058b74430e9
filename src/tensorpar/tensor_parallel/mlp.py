"""The tensor-parallel MLP: first matrix (or gate and up matrices) column-parallel, second row-parallel.

Gated MLPs (SwiGLU) split gate and up the same way, so each rank holds matching slices and
computes act(gate) * up locally. One all-reduce forward and one backward (or the
all-gather / reduce-scatter pair under sequence parallelism), as in the course slides.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from tensorpar.tensor_parallel.linear import ColumnParallelLinear, RowParallelLinear
from tensorpar.tensor_parallel.lora import LoraSpec, add_column_adapters, adapter_region, lora_site
from tensorpar.tensor_parallel.region import as_region

ACTIVATION_FNS = {
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
    "relu": F.relu,
    "silu": F.silu,
}


class ParallelMLP(nn.Module):
    def __init__(self, cfg, region=None, device=None, exit_region=None, lora: LoraSpec | None = None,
                 layer_index: int = 0):
        """`region`: the model's `TPRegion` (or a mesh / group: plain collectives); `exit_region`, if given, the
        one `down_proj` leaves by (default: `region`); `lora`: the run's LoRA adapters (on the projections its
        targets name) and `layer_index` the layer's (their dropout masks' seeds)."""
        super().__init__()
        self.region = as_region(region)
        self.tp_group, self.sequence_parallel = self.region.group, self.region.sequence_parallel
        self.act = ACTIVATION_FNS[cfg.activation]
        h, f, bias = cfg.hidden_size, cfg.ffn_hidden_size, cfg.mlp_has_bias
        column = dict(device=device, init=False)
        site = functools.partial(lora_site, lora, layer_index)
        self.gate_proj = (ColumnParallelLinear(h, f, self.region, bias, lora=site("gate"), **column)
                          if cfg.gated_mlp else None)
        self.up_proj = ColumnParallelLinear(h, f, self.region, bias, lora=site("up"), **column)
        self.down_proj = RowParallelLinear(f, h, exit_region or self.region, bias, device=device, init=False,
                                           lora=site("down"))
        self.adapter_region = adapter_region(self.region, site("gate") or site("up"))

    def forward(self, x: torch.Tensor, ctx=None) -> torch.Tensor:
        """`ctx`: the micro-batch's context (the adapters' dropout seed), when the layers have adapters."""
        layers = [p for p in (self.gate_proj, self.up_proj) if p is not None]
        outs = self.region.enter(x, [p.projection() for p in layers])  # gate and up share x: entered once
        if self.adapter_region is not None:
            outs = add_column_adapters(self.adapter_region, x, outs, [p.adapter() for p in layers], ctx)
        h = self.act(outs[0]) * outs[1] if self.gate_proj is not None else self.act(outs[0])
        return self.down_proj(h, ctx)
