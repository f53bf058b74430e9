"""The mixture-of-experts feed-forward layer: router, routed experts over the EP group, optional shared experts.

    y = sum_{j in top-k(x)} w_j(x) * expert_j(x)  [+ shared_experts(x)]

Tokens: each rank routes distinct tokens. Under sequence parallelism its sequence shard; without it, a TP
group holds the same [B, S, H] activation, and each TP rank takes 1/tp of the B * S tokens (`scatter_to_sp`
on the token dim: split / all-gather in backward) and all-gathers the outputs after (`gather_from_sp` with a
plain split in backward), so that expert parallelism can fold over the TP ranks. Expert-TP (`expert_tp_group`:
each expert's width split over it) is the dispatcher's and the experts' business. The
router's weight is replicated on the TP ranks and its gradient summed over them (`copy_to_tp`). The shared
experts are a tensor-parallel `ParallelMLP` of num_shared_experts times the expert width; with
`shared_expert_gate` (Qwen2-MoE) their output is scaled per token by sigmoid(x w^T), w [1, H] replicated on
the TP ranks (under sequence parallelism each rank sees its sequence shard, so w enters through `copy_to_tp`:
forward identity, backward all-reduce over TP; without it every rank computes the whole gradient).

Auxiliary losses (tensorpar.expert_parallel.router) are not returned: their gradient is injected in the backward
(`_AddAuxLossGrad`, Megatron's MoEAuxLossAutoScaler), so that they reach the parameters of any pipeline
stage. `aux_scale` is the factor the caller multiplies the model's loss by before its backward (loss scale /
micro-batches), which their gradient takes too; this rank's share of them is weighted so that averaging
gradients over DP x CP (summing expert gradients over expert-DP) gives the gradient of
    loss + router_aux_loss_coef * mean over sequences of the balance loss + router_z_loss_coef * z-loss.

Per training forward the layer adds to `stats` (read and reset by the training loop): routing choices per
expert, dropped choices, and this rank's share of the two loss values.
"""

from __future__ import annotations

import torch
from torch import nn

from tensorpar.distributed.sharding import ShardSpec, tag
from tensorpar.errors import LayoutError
from tensorpar.expert_parallel.dispatch import AllToAllDispatcher
from tensorpar.expert_parallel.experts import GroupedExperts
from tensorpar.expert_parallel.router import TopKRouter, balance_statistics, capacity, keep_mask
from tensorpar.tensor_parallel.mappings import gather_from_sp, scatter_to_sp
from tensorpar.tensor_parallel.mlp import ParallelMLP
from tensorpar.tensor_parallel.region import as_region

# The layout of a MoE layer's per-step statistics (`MoEStats.vector`): the E counts of routing choices, then these.
STAT_FIELDS = ("choices", "dropped", "aux_loss_sum", "sequences", "z_loss_sum", "tokens")


class _AddAuxLossGrad(torch.autograd.Function):
    """Forward: `y` unchanged. Backward: `y`'s gradient, and `scale` as the gradient of the scalar `aux_loss`."""

    @staticmethod
    def forward(ctx, y, aux_loss, scale):
        ctx.scale = scale
        return y.view_as(y)

    @staticmethod
    def backward(ctx, grad):
        return grad, torch.full((), ctx.scale, dtype=torch.float32, device=grad.device), None


class MoEStats:
    """Sums over the forwards since the last `reset()`: choices per expert [E], then STAT_FIELDS[1:]."""

    def __init__(self, num_experts: int):
        self.num_experts = num_experts
        self.vector: torch.Tensor | None = None

    def add(self, per_expert: torch.Tensor, *values: torch.Tensor) -> None:
        v = torch.cat([per_expert.detach().float().flatten(), torch.stack([x.detach().float() for x in values])])
        self.vector = v if self.vector is None else self.vector + v

    def reset(self) -> None:
        self.vector = None


class MoELayer(nn.Module):
    def __init__(self, cfg, region, ep_group, cp_group, device=None, expert_tp_group=None, expert_gemm="grouped"):
        """`region`: the model's `TPRegion` (its TP group, sequence parallelism, and how the router's, the shared
        experts' and the experts' weights get their gradients); `expert_gemm`: how the experts' GEMMs run."""
        super().__init__()
        self.cfg = cfg
        self.region = region = as_region(region)
        self.tp_group, self.ep_group, self.cp_group = region.group, ep_group, cp_group
        self.sequence_parallel = region.sequence_parallel
        self.router = TopKRouter(cfg, region, device=device)
        self.experts = GroupedExperts(cfg, ep_group, expert_tp_group, device=device, region=region, gemm=expert_gemm)
        self.dispatcher = AllToAllDispatcher(ep_group, cfg.num_experts, self.experts.num_local, expert_tp_group)
        self.shared_experts = None
        if cfg.num_shared_experts:
            self.shared_experts = ParallelMLP(cfg.replace(ffn_hidden_size=cfg.num_shared_experts * cfg.expert_ffn_size),
                                              region, device=device)
        self.shared_expert_gate = None
        if cfg.shared_expert_gate:
            self.shared_expert_gate = tag(nn.Parameter(torch.empty(1, cfg.hidden_size, device=device)),
                                          ShardSpec(dim=None, reduce_grad_across_tp=self.sequence_parallel))
        self.stats = MoEStats(cfg.num_experts)

    def _local_tokens(self, x: torch.Tensor, context):
        """(this rank's tokens [n, H], their sequence [n] and position [n], whether they are 1/tp of the TP
        group's, the full sequence length)."""
        b, s, h = x.shape
        tp, sp = self.tp_group, self.sequence_parallel
        seq_len = context.seq_len if context is not None else s * (tp.size if sp else 1)
        positions = context.positions(x.device) if context is not None else torch.arange(seq_len, device=x.device)
        if sp:
            positions = positions.chunk(tp.size)[tp.rank]
        tokens = x.reshape(b * s, h)
        seq_index = torch.arange(b, device=x.device).repeat_interleave(s)
        positions = positions.repeat(b)
        split = tp.size > 1 and not sp
        if split and (b * s) % tp.size:
            if torch.is_grad_enabled():
                raise LayoutError(f"an MoE layer splits the {b * s} tokens of a micro-batch over the {tp.size} TP "
                                  f"ranks: use a micro-batch size x sequence length divisible by {tp.size}, or "
                                  f"--sequence-parallel")
            split = False  # inference (e.g. one new token): every TP rank routes all tokens; no gradients to share
        if split:
            tokens = scatter_to_sp(tokens, tp, dim=0)
            seq_index, positions = (t.chunk(tp.size)[tp.rank] for t in (seq_index, positions))
        return tokens, seq_index, positions, split, seq_len

    def forward(self, x: torch.Tensor, context=None, aux_scale: float = 1.0, record_stats: bool = True) -> torch.Tensor:
        """`x`: [B, S(/cp)(/tp under SP), H], this rank's part of the layer's input; returns the same layout.
        `record_stats=False`: this call recomputes a forward (full activation recomputation, in the backward),
        whose statistics were already counted."""
        cfg = self.cfg
        num_seqs = x.shape[0]
        tokens, seq_index, positions, split, seq_len = self._local_tokens(x, context)
        # The ranks whose tokens share sequences with this rank's.
        groups = [g for g, on in ((self.tp_group, self.tp_group.size > 1 and (split or self.sequence_parallel)),
                                  (self.cp_group, self.cp_group.size > 1)) if on]
        routing = self.router(tokens)
        keep = None
        if cfg.capacity_factor is not None:
            limit = capacity(cfg.capacity_factor, seq_len, cfg.experts_per_token, cfg.num_experts)
            keep = keep_mask(routing.experts, seq_index, positions, num_seqs, seq_len, cfg.num_experts, limit,
                             groups)
        sent = self.dispatcher.dispatch(tokens, routing.experts, keep)
        out = self.dispatcher.combine(self.experts(sent.rows, sent.sizes), sent)
        # in the residual stream's dtype: under autocast the experts' matmuls return bf16 for fp32 tokens
        weights = routing.weights.flatten()[sent.choices].to(tokens.dtype)
        y = torch.zeros_like(tokens).index_add(0, sent.choices // cfg.experts_per_token,
                                               out.to(tokens.dtype) * weights[:, None])
        if split:
            y = gather_from_sp(y, self.tp_group, dim=0, grad_is_partial=False)
        y = y.view_as(x)
        if self.training and torch.is_grad_enabled():
            y = self._auxiliary_losses(y, routing, keep, seq_index, num_seqs, seq_len, groups, aux_scale,
                                       record_stats)
        if self.shared_experts is not None:
            y = y + self._shared(x)
        return y

    def _shared(self, x: torch.Tensor) -> torch.Tensor:
        out = self.shared_experts(x)
        if self.shared_expert_gate is None:
            return out
        # Replicated on the TP ranks; under SP each saw its sequence shard, so its gradient is summed over them.
        gate = self.region.linear(x, self.shared_expert_gate, summed=self.sequence_parallel)
        return torch.sigmoid(gate) * out

    def _auxiliary_losses(self, y, routing, keep, seq_index, num_seqs, seq_len, groups, aux_scale, record_stats):
        cfg, cp = self.cfg, self.cp_group.size
        choices, local_probs, full_probs = balance_statistics(routing, seq_index, num_seqs, groups)
        share = choices / (seq_len * cfg.experts_per_token)
        # This rank's share (its tokens' part of P), times cp like the CP-split cross-entropy's gradient.
        aux = cfg.num_experts * (share * local_probs / seq_len).sum() / num_seqs * cp
        z2 = torch.logsumexp(routing.logits, -1).square()
        z = z2.sum() / (num_seqs * seq_len) * cp
        loss = cfg.router_aux_loss_coef * aux + cfg.router_z_loss_coef * z
        if loss.requires_grad:
            y = _AddAuxLossGrad.apply(y, loss, aux_scale)
        if record_stats:
            first = all(g.rank == 0 for g in groups)  # one rank of those sharing the sequences reports them
            full_aux = cfg.num_experts * (share * full_probs / seq_len).sum(-1)  # [B]
            dropped = (~keep).sum() if keep is not None else torch.zeros((), device=y.device)
            self.stats.add(choices.sum(0) * first,
                           torch.tensor(float(routing.experts.numel()), device=y.device), dropped,
                           full_aux.sum() * first, torch.tensor(float(num_seqs * first), device=y.device),
                           z2.detach().sum(), torch.tensor(float(z2.numel()), device=y.device))
        return y
