"""The routed experts held by one expert-parallel rank: num_experts / ep MLPs as stacked weights.

``gate_proj`` / ``up_proj`` [E_local, F, H] and ``down_proj`` [E_local, H, F] are the slices
[ep_rank * E_local, (ep_rank + 1) * E_local) of the dense [E, ...] tensors (ShardSpec dim 0 over the
"ep" group), so a checkpoint stores every expert under its global index and any EP size reloads it.
Each expert computes the dense MLP's function (act(x Wg^T) * (x Wu^T)) Wd^T, or act(x Wu^T) Wd^T
ungated; routed experts have no biases. No communication here.
"""

from __future__ import annotations

import torch
from torch import nn

from tensorpar.errors import LayoutError
from tensorpar.layers.mlp import ACTIVATION_FNS
from tensorpar.layers.sharding import ShardSpec, tag


def experts_per_rank(num_experts: int, ep: int) -> int:
    """num_experts / ep, or a LayoutError naming the EP sizes that divide num_experts."""
    if num_experts % ep:
        valid = [d for d in range(1, num_experts + 1) if num_experts % d == 0]
        raise LayoutError(f"num_experts = {num_experts} is not divisible by the expert-parallel size {ep}: each EP "
                          f"rank holds num_experts / ep experts; EP sizes that divide it: {valid}")
    return num_experts // ep


class GroupedExperts(nn.Module):
    def __init__(self, cfg, ep_group, device=None):
        super().__init__()
        e, h, f = cfg.num_experts, cfg.hidden_size, cfg.expert_ffn_size
        self.num_local = experts_per_rank(e, ep_group.size)
        self.first = ep_group.rank * self.num_local  # global index of the first local expert
        self.act = ACTIVATION_FNS[cfg.activation]

        def stacked(*shape):
            return tag(nn.Parameter(torch.empty(self.num_local, *shape, device=device)),
                       ShardSpec(dim=0, full_size=e, padded_size=e, group="ep"))

        self.gate_proj = stacked(f, h) if cfg.gated_mlp else None
        self.up_proj = stacked(f, h)
        self.down_proj = stacked(h, f)

    def forward(self, x: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        """`x`: rows grouped by local expert, `sizes[i]` rows for local expert i; returns their outputs."""
        # unbind once (its backward stacks the experts' gradients in one op; indexing each would allocate a
        # whole zero gradient per expert)
        up, down = self.up_proj.unbind(0), self.down_proj.unbind(0)
        gate = self.gate_proj.unbind(0) if self.gate_proj is not None else None
        outs = []
        for i, rows in enumerate(x.split(sizes, 0)):
            h = rows @ up[i].t()
            h = self.act(rows @ gate[i].t()) * h if gate is not None else self.act(h)
            outs.append(h @ down[i].t())
        return torch.cat(outs, 0)
