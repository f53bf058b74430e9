"""Multi-token prediction (DeepSeek-V3, GLM-4.5): modules that predict token t + 1 + k from position t.

Module k (1-based, of `num_mtp_layers`) takes the previous depth's hidden states h^{k-1} (depth 0: the last layer's
output, before the final norm) and the embeddings of the tokens k positions ahead, and runs a block of its own:

    h^k = block_k( eh_proj [ enorm(embed(t_{i+k})) ; hnorm(h^{k-1}_i) ] ),   logits_k = head(norm_k(h^k))

with the model's embedding and head (shared; as in transformers' `MtpLayer`, the next depth takes norm_k(h^k)). Its
loss is the mean cross-entropy of token i + 1 + k at position i, over the positions that have one. The modules live
on the last pipeline stage, which then holds a copy of the embedding (`ShardSpec.pipeline_duplicate`, its gradient
summed with the first stage's, as a tied embedding's). They are blocks of the model keyed by global index
num_layers + k - 1 (a Hugging Face checkpoint's layer numbering), so that ZeRO-3 gathers each as a unit and MoE
statistics count their routers.

Training only: the training loss returned stays the next-token loss (the one `eval` reports); the mean of the
modules' losses joins its backward times `mtp_loss_weight` (`with_mtp_loss`), and each depth's summed loss and
target count are kept in `MTPStats` for the step's metrics (`mtp_loss`). Evaluation and generation skip them.

Tensor parallelism: the projection eh_proj [H, 2H] is row-parallel. Its input, the two normalised halves
concatenated, enters the TP region (`TPRegion.entry`: forward nothing or, under SP, an all-gather; backward
all-reduce or reduce-scatter) and each rank multiplies its slice of the 2H features; the partial sums leave by
all-reduce (SP: reduce-scatter), where the block expects its input.
"""

from __future__ import annotations

import torch
from torch import nn

from tensorpar.layers.micro_batch import MicroBatchContext
from tensorpar.layers.norms import Norm
from tensorpar.models.block import TransformerBlock
from tensorpar.tensor_parallel.linear import RowParallelLinear


class _WithExtraLoss(torch.autograd.Function):
    """Forward: `loss` unchanged. Backward: its gradient g to `loss`, and g x `weight` to `extra`: the objective
    loss + weight x extra, whose reported value stays `loss`."""

    @staticmethod
    def forward(ctx, loss, extra, weight: float):
        ctx.weight = weight
        return loss.view_as(loss)

    @staticmethod
    def backward(ctx, grad):
        return grad, grad * ctx.weight, None


def with_mtp_loss(loss: torch.Tensor, mtp_loss: torch.Tensor, weight: float) -> torch.Tensor:
    """`loss` whose backward also back-propagates `weight` x `mtp_loss` (scaled as `loss` is)."""
    return _WithExtraLoss.apply(loss, mtp_loss, weight)


def shifted(ids: torch.Tensor, targets: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(the input ids of depth `k`, its targets), [B, S] each, from a window's `ids` and `targets` (ids shifted by
    one): position i holds token i + k and predicts token i + 1 + k. The stream the window knows is ids followed by
    the last target; later positions take token 0 and the ignore index."""
    stream = torch.cat([ids, targets[:, -1:].clamp(min=0)], dim=1)
    pad = ids.new_zeros(ids.shape[0], k - 1)
    return (torch.cat([stream[:, k:], pad], dim=1),
            torch.cat([targets[:, k:], targets.new_full((ids.shape[0], k), -100)], dim=1))


class MTPStats:
    """Per depth, the summed loss and the count of targets since the last `reset` (one rank of a TP group keeps
    them: the others hold the same values): [2 x num_mtp_layers]."""

    def __init__(self, depths: int):
        self.depths, self.vector = depths, None

    def add(self, depth: int, loss_sum: torch.Tensor, count: torch.Tensor) -> None:
        if self.vector is None:
            self.vector = torch.zeros(2 * self.depths, device=loss_sum.device)
        self.vector[2 * depth] += loss_sum.detach().float()
        self.vector[2 * depth + 1] += count.float()

    def reset(self) -> None:
        self.vector = None


class MultiTokenPrediction(nn.Module):
    """One module (see the module docstring): `forward(h, embedded, ctx)` returns h^k; `norm` precedes the head."""

    def __init__(self, cfg, placement, layer_index: int, device=None):
        super().__init__()
        region = placement.region
        self.region, self.tp_group = region, region.group
        h = cfg.hidden_size
        self.enorm = Norm(h, cfg.norm, cfg.norm_eps, region, device=device)
        self.hnorm = Norm(h, cfg.norm, cfg.norm_eps, region, device=device)
        self.eh_proj = RowParallelLinear(2 * h, h, region, bias=False, device=device, init=False)
        self.block = TransformerBlock(cfg, placement, layer_index, device)
        self.norm = Norm(h, cfg.norm, cfg.norm_eps, region, device=device)
        self.moe = self.block.moe

    @property
    def mlp(self):
        """The block's MLP (its `MoELayer` when `moe`)."""
        return self.block.mlp

    def forward(self, h: torch.Tensor, embedded: torch.Tensor, ctx: MicroBatchContext = MicroBatchContext()):
        x = self.region.entry(torch.cat([self.enorm(embedded), self.hnorm(h)], dim=-1))
        x = x.chunk(self.tp_group.size, dim=-1)[self.tp_group.rank]  # this rank's input features
        return self.block(self.eh_proj(x), ctx)
