"""The routed experts held by one expert-parallel rank: num_experts / ep MLPs as stacked weights.

``gate_proj`` / ``up_proj`` [E_local, F, H] and ``down_proj`` [E_local, H, F] are the slices
[ep_rank * E_local, (ep_rank + 1) * E_local) of the dense [E, ...] tensors (ShardSpec dim 0 over the
"ep" group), so a checkpoint stores every expert under its global index and any EP size reloads it.
Each expert computes the dense MLP's function (act(x Wg^T) * (x Wu^T)) Wd^T, or act(x Wu^T) Wd^T
ungated; routed experts have no biases. No communication here.

The local experts run as one grouped GEMM per projection (`--expert-gemm grouped`, the default:
`tensorpar.functional.grouped_gemm`) or one GEMM per expert (`loop`, the reference); fp8 GEMMs and a zero-bubble
schedule's split backward always loop (each slice its own scales, its own queued weight gradient).

Expert tensor parallelism (an expert-TP group of etp ranks): each rank holds the [F/etp] slice of every
local expert's width, Megatron-style: gate_proj / up_proj column-parallel (rows F), down_proj row-parallel
(columns F), so its outputs are partial sums over the width that the dispatcher reduce-scatters.
"""

from __future__ import annotations

import torch
from torch import nn

from tensorpar.config.choices import EXPERT_GEMMS
from tensorpar.distributed.sharding import ShardSpec, tag
from tensorpar.errors import TensorparError
from tensorpar.layout.rules import expert_width_per_rank, experts_per_rank
from tensorpar.tensor_parallel.mlp import ACTIVATION_FNS
from tensorpar.tensor_parallel.region import as_region


class GroupedExperts(nn.Module):
    def __init__(self, cfg, ep_group, expert_tp_group=None, device=None, region=None, gemm: str = "grouped"):
        """`region`: the model's `TPRegion`, whose split backward (if any) the experts' weight gradients follow;
        `gemm`: "grouped" (one grouped GEMM per projection for all local experts, where the region's GEMMs allow)
        or "loop" (one GEMM per expert)."""
        super().__init__()
        if gemm not in EXPERT_GEMMS:
            raise TensorparError(f"expert GEMMs must be one of {EXPERT_GEMMS}, got {gemm!r}")
        self.region, self.gemm = as_region(region), gemm
        e, h, f = cfg.num_experts, cfg.hidden_size, cfg.expert_ffn_size
        etp = expert_tp_group.size if expert_tp_group is not None else 1
        self.expert_tp_group = expert_tp_group if etp > 1 else None
        self.num_local = experts_per_rank(e, ep_group.size)
        self.first = ep_group.rank * self.num_local  # global index of the first local expert
        self.act = ACTIVATION_FNS[cfg.activation]
        width = expert_width_per_rank(f, etp)

        def stacked(*shape, width_dim):
            split = dict(expert_tp_dim=width_dim, expert_tp_full_size=f) if etp > 1 else {}
            return tag(nn.Parameter(torch.empty(self.num_local, *shape, device=device)),
                       ShardSpec(dim=0, full_size=e, padded_size=e, group="ep", **split))

        self.gate_proj = stacked(width, h, width_dim=1) if cfg.gated_mlp else None
        self.up_proj = stacked(width, h, width_dim=1)
        self.down_proj = stacked(h, width, width_dim=2)

    def forward(self, x: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        """`x`: rows grouped by local expert, `sizes[i]` rows for local expert i; returns their outputs."""
        up = self.region.grouped_linear(self.up_proj) if self.gemm == "grouped" else None
        if up is None:
            return self._loop(x, sizes)
        h = up(x, sizes)
        if self.gate_proj is not None:
            h = self.act(self.region.grouped_linear(self.gate_proj)(x, sizes)) * h
        else:
            h = self.act(h)
        return self.region.grouped_linear(self.down_proj)(h, sizes)

    def _loop(self, x: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        """The same, one expert at a time (the reference; fp8 GEMMs and the split backward run this way)."""
        etp, region = self.expert_tp_group, self.region
        up, down = region.stacked_linear(self.up_proj, etp, "out"), region.stacked_linear(self.down_proj, etp, "in")
        gate = region.stacked_linear(self.gate_proj, etp, "out") if self.gate_proj is not None else None
        outs = []
        for i, rows in enumerate(x.split(sizes, 0)):
            h = up(rows, i)
            h = self.act(gate(rows, i)) * h if gate is not None else self.act(h)
            outs.append(down(h, i))
        return torch.cat(outs, 0)
