"""The router of a mixture-of-experts layer: scores, top-k choice, and the statistics of its two losses.

    logits = tokens @ W_r^T                     [n, E], in fp32
    softmax: p = softmax(logits); weights = top-k of p (renormalised to sum 1 when `norm_topk_prob`)
    sigmoid: s = sigmoid(logits); weights = s of the top-k (normalised to sum 1 when `norm_topk_prob`); p = s / sum(s)
             for the aux loss
    weights *= routed_scaling_factor

DeepSeek-V3's choice (sigmoid scores): the top-k of s + b, b a per-expert bias that only chooses (the weights stay
s's). With `n_group` > 1 the experts fall into n_group equal groups, each scored by the sum of its best two s + b,
and a token chooses among the experts of its `topk_group` best groups only (group-limited routing: with experts
placed group by group on the EP ranks, a token's rows go to at most topk_group of them). Auxiliary-loss-free
balancing (`expert_bias`, Wang et al. 2024): after each optimizer step b moves by `bias_update_speed` towards
balance, b_e += speed * sign(mean load - load_e), from the step's global routing counts (`update_expert_bias`,
called by the training loop with counts summed over every rank: the same b on every rank and layout). b is a
persistent buffer of the router (fp32, never trained), so checkpoints and Hugging Face folders
(`e_score_correction_bias`) carry it.

Load-balancing loss (Switch / GShard form, per sequence, as DeepSeek-V3's sequence-wise loss): for each
sequence b of S tokens, ``E * sum_e f_be * P_be`` with f_be the share of b's k * S routing choices that
picked expert e and P_be the mean of p over b's tokens (1 when perfectly balanced); the loss is its mean
over the sequences, times `router_aux_loss_coef`. Router z-loss (ST-MoE): the mean over tokens of
logsumexp(logits)^2, times `router_z_loss_coef`. Per sequence and per token, neither depends on how the
tokens are laid out over ranks or micro-batches: the statistics of a sequence split over TP (sequence
parallel) or CP ranks are summed over them (`sum_over`: one all-reduce per group) before use.

Capacity (`capacity_factor`, optional): expert e takes at most C = ceil(capacity_factor * S * k / E) of
a sequence's routing choices; first-choice slots before second-choice ones, earlier positions first
(Switch's priority), the rest are dropped. The decision needs the whole sequence's choices, which the
ranks holding its parts all-gather (`gather_over`), so every layout drops the same tokens.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F
from torch import nn

from tensorpar.distributed.sharding import ShardSpec, tag
from tensorpar.functional.autocast import without_autocast
from tensorpar.tensor_parallel.region import as_region


@dataclasses.dataclass
class Routing:
    logits: torch.Tensor  # [n, E] fp32
    probs: torch.Tensor  # [n, E] fp32: what the load-balancing loss averages
    experts: torch.Tensor  # [n, k] int64: the chosen experts, best first
    weights: torch.Tensor  # [n, k] fp32: their weights in the combination


class TopKRouter(nn.Module):
    """A linear router (no bias) replicated on every TP rank. Each TP rank routes its own tokens (sequence shard or
    token slice), so the weight enters through `copy_to_tp` (backward: all-reduce over TP). With `expert_bias` it
    holds the balancing bias [E] (a buffer: it chooses, it is not trained)."""

    def __init__(self, cfg, region, device=None):
        super().__init__()
        self.region = region = as_region(region)
        self.tp_group = tp_group = region.group
        self.num_experts, self.k = cfg.num_experts, cfg.experts_per_token
        self.score, self.norm_topk_prob = cfg.router_score, cfg.norm_topk_prob
        self.n_group, self.topk_group, self.scaling = cfg.n_group, cfg.topk_group, cfg.routed_scaling_factor
        self.weight = tag(nn.Parameter(torch.empty(cfg.num_experts, cfg.hidden_size, device=device)),
                          ShardSpec(dim=None, reduce_grad_across_tp=tp_group.size > 1))
        self.register_buffer("expert_bias", torch.zeros(cfg.num_experts, device=device) if cfg.expert_bias else None)

    def _choose(self, scores: torch.Tensor) -> torch.Tensor:
        """[n, k] experts of the top-k of `scores` (+ the bias), within each token's `topk_group` best groups."""
        choice = scores if self.expert_bias is None else scores + self.expert_bias
        if self.n_group > 1:
            n = choice.shape[0]
            grouped = choice.view(n, self.n_group, -1)
            best = grouped.topk(2, dim=-1).values.sum(-1).topk(self.topk_group, dim=-1).indices  # [n, topk_group]
            allowed = torch.zeros(n, self.n_group, dtype=torch.bool, device=choice.device).scatter_(1, best, True)
            choice = grouped.masked_fill(~allowed[..., None], float("-inf")).view(n, -1)
        return choice.topk(self.k, dim=-1).indices

    def _logits(self, tokens: torch.Tensor) -> torch.Tensor:
        """[n, E] fp32. Sigmoid routing computes them in the weight's dtype without autocast (fp32 in eval, generate
        and serve under bf16 autocast), as DeepSeek-V3 keeps its gating and transformers its DeepSeek-V3 / GLM-4.5
        router in fp32: bf16 logits change the experts chosen with the balancing bias (3.6% of DeepSeek-V3's
        tokens on random inputs)."""
        summed = self.tp_group.size > 1
        if self.score != "sigmoid":
            return self.region.linear(tokens, self.weight, summed=summed).float()
        with without_autocast(tokens.device.type):
            return self.region.linear(tokens.to(self.weight.dtype), self.weight, summed=summed).float()

    def forward(self, tokens: torch.Tensor) -> Routing:
        logits = self._logits(tokens)
        if self.score == "softmax":
            probs = logits.softmax(-1)
            weights, experts = probs.topk(self.k, dim=-1)
            if self.norm_topk_prob:
                weights = weights / weights.sum(-1, keepdim=True)
        else:
            scores = logits.sigmoid()
            experts = self._choose(scores)
            weights = scores.gather(1, experts)
            if self.norm_topk_prob:
                weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
            probs = scores / scores.sum(-1, keepdim=True)
        if self.scaling != 1.0:
            weights = weights * self.scaling
        return Routing(logits, probs, experts, weights)


@torch.no_grad()
def update_expert_bias(bias: torch.Tensor, load: torch.Tensor, speed: float) -> None:
    """Auxiliary-loss-free balancing (see the module docstring): `bias` += `speed` * sign(mean(load) - load), in place;
    `load`: the routing choices each expert received over the step, summed over every rank."""
    load = load.to(device=bias.device, dtype=torch.float64)
    bias += (speed * torch.sign(load.mean() - load)).to(bias.dtype)


def sum_over(t: torch.Tensor, groups) -> torch.Tensor:
    """`t` summed over each group of `groups` in turn (in place; the groups holding the parts of the sequences)."""
    for g in groups:
        g.all_reduce(t)
    return t


def gather_over(t: torch.Tensor, groups) -> torch.Tensor:
    """The rows of `t` of every rank of `groups` (all-gathered along dim 0, group by group)."""
    for g in groups:
        t = g.all_gather(t, dim=0)
    return t


def balance_statistics(routing: Routing, seq_index: torch.Tensor, num_seqs: int, groups):
    """(choices [B, E]: how many of each sequence's routing choices picked each expert, summed over `groups`;
    local_probs [B, E]: this rank's sum of p per sequence (differentiable); full_probs: that sum over `groups`)."""
    n, k = routing.experts.shape
    e = routing.probs.shape[-1]
    choices = torch.zeros(num_seqs, e, device=seq_index.device)
    choices.index_put_((seq_index[:, None].expand(n, k), routing.experts), torch.ones(n, k, device=choices.device),
                       accumulate=True)
    local_probs = torch.zeros(num_seqs, e, device=seq_index.device).index_add(0, seq_index, routing.probs)
    both = sum_over(torch.cat([choices, local_probs.detach()], -1), groups)
    return both[:, :e], local_probs, both[:, e:]


def capacity(capacity_factor: float, seq_len: int, k: int, num_experts: int) -> int:
    """Routing choices one expert takes per sequence."""
    return math.ceil(capacity_factor * seq_len * k / num_experts)


def keep_mask(experts: torch.Tensor, seq_index: torch.Tensor, positions: torch.Tensor, num_seqs: int, seq_len: int,
              num_experts: int, limit: int, groups) -> torch.Tensor:
    """[n, k] bool: which of this rank's routing choices fit their expert's capacity `limit` in their sequence."""
    n, k = experts.shape
    rows = gather_over(torch.cat([seq_index[:, None], positions[:, None], experts], -1), groups)
    table = torch.zeros(num_seqs, seq_len, k, dtype=torch.long, device=experts.device)
    table[rows[:, 0], rows[:, 1]] = rows[:, 2:]
    onehot = F.one_hot(table.transpose(1, 2).reshape(num_seqs, k * seq_len), num_experts)  # slot-major order
    taken_before = onehot.cumsum(1) - onehot  # choices of the same expert ahead in priority
    rank = (taken_before * onehot).sum(-1).view(num_seqs, k, seq_len).transpose(1, 2)  # [B, S, k]
    return rank[seq_index, positions] < limit
