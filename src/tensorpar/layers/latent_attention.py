"""Multi-head latent attention (DeepSeek-V2/V3, Kimi K2), tensor-parallel by heads.

    c_q  = RMSNorm(x W_qa)                      [B, S, q_lora_rank]     (or no latent: q = x W_q)
    c_kv = RMSNorm((x W_kva)[:kv_lora_rank])    [B, S, kv_lora_rank]    the compressed keys and values
    k_r  = RoPE((x W_kva)[kv_lora_rank:])       [B, S, qk_rope_head_dim], one rotary key shared by every head
    q    = c_q W_qb: per head [q_nope | RoPE(q_rope)]
    [k_nope | v] = c_kv W_kvb per head; k = [k_nope | k_r]
    out  = softmax(q k^T * scale) v W_o         scale = qk_head_dim^-1/2 x YaRN's mscale(factor, mscale_all_dim)^2

Tensor parallelism. The up-projections (W_qb, W_kvb: column-parallel) and the output projection (W_o: row-parallel)
are split by heads, like ordinary attention's q/k/v and output; the small down-projections (W_qa, W_kva) and the
latent norms are replicated. Without sequence parallelism every rank computes the same latents from the replicated x,
and they enter the TP region together (c_q, c_kv and the unrotated k_r concatenated, `copy_to_tp`): forward nothing,
backward one all-reduce of their gradient, [B, S, q_lora_rank + kv_lora_rank + qk_rope_head_dim] — for DeepSeek-V3
2,112 values a token where ordinary attention all-reduces its 7,168-wide input. The down-projections' weight
gradients are then whole on every rank: no further reduction. Under sequence parallelism the down-projections and
norms run on the rank's sequence shard ("sequence-parallel") and the latents are all-gathered into the region
(backward: reduce-scattered): the same 2,112 values a token instead of the hidden states; their replicated weights'
gradients are summed over TP (one all-reduce each, as a norm's under SP). The output projection leaves as ordinary
attention does: all-reduce, or reduce-scatter under SP. Without q_lora_rank the plain query projection enters from x
as ordinary attention's q/k/v do (one more all-reduce / all-gather of the hidden states).

Context parallelism: the ring passes each rank's expanded per-head keys (the shared rotary key repeated over its local
heads) and values, as for ordinary attention; the all-gather variant gathers the compressed latent and the rotary key
instead ([B, L/cp, kv_lora_rank + qk_rope_head_dim] per rank) and expands them locally (backward: the latent's
gradient reduce-scattered).

Generation caches the compressed latent (after its norm) and the rotated rotary key, (kv_lora_rank + qk_rope_head_dim)
values a token per layer, and expands them every step. The latent is shared by every head, so each TP rank holds the
whole of it: the cache is replicated over TP, not sharded by heads (`cache_layout`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tensorpar.context_parallel.ring_attention import ContextSplit, attend_gathered, context_attention
from tensorpar.distributed.sharding import ShardSpec, tag
from tensorpar.errors import LayoutError
from tensorpar.functional.attention_pattern import AttentionPattern
from tensorpar.functional.document_mask import PackedDocuments
from tensorpar.functional.dropout import fork_rng_seeded, mix_seed
from tensorpar.functional.rope import apply_rope, apply_rope_interleaved, mscale_softmax_factor
from tensorpar.layers.micro_batch import MicroBatchContext
from tensorpar.layers.norms import Norm
from tensorpar.layout import divide
from tensorpar.tensor_parallel.linear import ColumnParallelLinear, RowParallelLinear
from tensorpar.tensor_parallel.mappings import gather_from_sp
from tensorpar.tensor_parallel.region import as_region

LATENT_NORM_EPS = 1e-6  # DeepSeek's latent RMSNorms keep their own epsilon, whatever the model's rms_norm_eps


class ReplicatedLinear(nn.Module):
    """x W^T + b with W (and b) whole on every TP rank: the latent down-projections. Under sequence parallelism each
    rank multiplies its sequence shard and the gradients are summed over TP (`TPRegion.linear`, summed)."""

    def __init__(self, in_features: int, out_features: int, region, bias: bool, device=None):
        super().__init__()
        self.region = region
        spec = ShardSpec(dim=None, reduce_grad_across_tp=region.sequence_parallel)
        self.weight = tag(nn.Parameter(torch.empty(out_features, in_features, device=device)), spec)
        self.bias = tag(nn.Parameter(torch.empty(out_features, device=device)), spec) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.region.linear(x, self.weight, self.bias, summed=self.region.sequence_parallel)


def _widened(v: torch.Tensor, width: int) -> torch.Tensor:
    """Values zero-padded to the keys' `width`: SDPA's fused (flash) kernels take one head width for q, k and v, and
    otherwise fall back to the unfused one, which keeps the [S, S] probabilities of every head for the backward. The
    zero columns give zero outputs, cut off after."""
    return v if v.shape[-1] == width else F.pad(v, (0, width - v.shape[-1]))


def latent_softmax_scale(cfg) -> float:
    """The scale of latent attention's scores: (qk_nope_head_dim + qk_rope_head_dim)^-1/2, times YaRN's
    mscale(factor, mscale_all_dim)^2 when the RoPE scaling sets it (DeepSeek-V3)."""
    return (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5 * mscale_softmax_factor(cfg.rope_scaling)


class LatentAttention(nn.Module):
    """Causal multi-head latent attention: [B, S, H] (or [B, S/tp, H] under sequence parallelism) in and out. The
    forward takes what `ParallelAttention`'s does (`MicroBatchContext`); see the module docstring."""

    def __init__(self, cfg, region=None, layer_index: int = 0, device=None, exit_region=None):
        super().__init__()
        self.region = region = as_region(region)
        self.tp_group, self.sequence_parallel, self.layer_index = region.group, region.sequence_parallel, layer_index
        heads = cfg.num_heads
        self.local_heads = divide(heads, self.tp_group.size, "num_heads")
        self.nope, self.rope_dim, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.q_rank, self.kv_rank = cfg.q_lora_rank, cfg.kv_lora_rank
        self.rotate = apply_rope_interleaved if cfg.rope_interleave else apply_rope
        self.dropout, self.layer_type = cfg.dropout, cfg.layer_type(layer_index)
        self.pattern = AttentionPattern(scale=latent_softmax_scale(cfg))  # no soft cap, no window
        h, qk, down_bias = cfg.hidden_size, self.nope + self.rope_dim, cfg.attention_qkv_bias
        if self.q_rank is None:
            self.q_proj = ColumnParallelLinear(h, heads * qk, region, False, device=device, init=False)
        else:
            self.q_a_proj = ReplicatedLinear(h, self.q_rank, region, down_bias, device)
            self.q_a_norm = Norm(self.q_rank, "rmsnorm", LATENT_NORM_EPS, region, device=device)
            self.q_b_proj = ColumnParallelLinear(self.q_rank, heads * qk, region, False, device=device, init=False)
        self.kv_a_proj = ReplicatedLinear(h, self.kv_rank + self.rope_dim, region, down_bias, device)
        self.kv_a_norm = Norm(self.kv_rank, "rmsnorm", LATENT_NORM_EPS, region, device=device)
        self.kv_b_proj = ColumnParallelLinear(self.kv_rank, heads * (self.nope + self.v_dim), region, False,
                                              device=device, init=False)
        self.o_proj = RowParallelLinear(heads * self.v_dim, h, exit_region or region, cfg.bias, device=device,
                                        init=False)

    def cache_layout(self) -> tuple[tuple[int, int], tuple[int, int]]:
        """(heads, dim) of what a KV cache holds per token and layer, as (keys, values): the compressed latent and
        the rotary key, one "head" each, whole on every TP rank."""
        return (1, self.kv_rank), (1, self.rope_dim)

    def _latents(self, x: torch.Tensor) -> torch.Tensor:
        """[c_q | c_kv | k_r (not rotated)] of this rank's tokens, entered into the TP region (see the module
        docstring): [B, S, (q_lora_rank +) kv_lora_rank + qk_rope_head_dim] over the full sequence."""
        kv = self.kv_a_proj(x)
        parts = [self.kv_a_norm(kv[..., :self.kv_rank]), kv[..., self.kv_rank:]]
        if self.q_rank is not None:
            parts.insert(0, self.q_a_norm(self.q_a_proj(x)))
        return self.region.entry(torch.cat(parts, dim=-1))

    def _column(self, x: torch.Tensor, layer: ColumnParallelLinear) -> torch.Tensor:
        """A column-parallel up-projection of an input already in the TP region."""
        return self.region.column(x, [layer.projection()])[0]

    def expand(self, c_kv: torch.Tensor, k_rope: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys [B, heads, L, nope + rope] and values [B, heads, L, v] of this rank's heads from the latent
        [B, 1, L, kv_lora_rank] and the rotated rotary key [B, 1, L, rope]."""
        b, _, length, _ = c_kv.shape
        kv = self._column(c_kv[:, 0], self.kv_b_proj).view(b, length, self.local_heads, self.nope + self.v_dim)
        k_nope, v = kv.transpose(1, 2).split([self.nope, self.v_dim], dim=-1)
        k = torch.cat([k_nope, k_rope.expand(-1, self.local_heads, -1, -1)], dim=-1)
        return k, v

    def core(self, q, k, v, dropout_seed: int | None, context: ContextSplit | None = None,
             documents: PackedDocuments | None = None):
        """softmax(q k^T * scale) v over this rank's heads (what selective recomputation recomputes); with `context`,
        across the CP ranks (ring, which takes values narrower than the keys as they are); with `documents`, within
        each packed document."""
        dropout = self.dropout if self.training else 0.0
        seed = mix_seed(dropout_seed, self.layer_index, 2, self.tp_group.rank) if dropout > 0 else None
        if context is not None:
            return context_attention(q, k, v, context, dropout, seed, documents, self.pattern)
        mask = documents.causal_mask() if documents is not None else None
        v = _widened(v, q.shape[-1])
        if dropout > 0:
            with fork_rng_seeded(seed, q.device):
                out = self.pattern.attend(q, k, v, mask, mask is None, dropout)
        else:
            out = self.pattern.attend(q, k, v, mask, mask is None)
        return out[..., :self.v_dim]

    def _gathered_core(self, q, c_kv, k_rope, ctx: MicroBatchContext):
        """The all-gather form of context parallelism: the latent and the rotary key gathered over CP, expanded here."""
        cp = ctx.cp
        c_all, k_rope_all = (gather_from_sp(t.contiguous(), cp.group, dim=2) for t in (c_kv, k_rope))
        k, v = self.expand(c_all, k_rope_all)
        dropout = self.dropout if self.training else 0.0
        seed = mix_seed(ctx.dropout_seed, self.layer_index, 2, self.tp_group.rank) if dropout > 0 else None
        out = attend_gathered(q, k, _widened(v, q.shape[-1]), cp, dropout, seed, ctx.documents, self.pattern)
        return out[..., :self.v_dim]

    def forward(self, x: torch.Tensor, ctx: MicroBatchContext = MicroBatchContext()):
        """As `ParallelAttention.forward`: with `ctx.kv_cache` (inference) the new tokens' latents go into the cache
        and attention spans every cached position."""
        kv_cache = ctx.kv_cache
        if kv_cache is not None and self.sequence_parallel:
            raise LayoutError("the KV-cache path runs without sequence parallelism")
        latents = self._latents(x)
        b, s = latents.shape[:2]
        if self.q_rank is None:
            c_kv, k_rope = latents.split([self.kv_rank, self.rope_dim], dim=-1)
            q = self.region.enter(x, [self.q_proj.projection()])[0]
        else:
            c_q, c_kv, k_rope = latents.split([self.q_rank, self.kv_rank, self.rope_dim], dim=-1)
            q = self._column(c_q, self.q_b_proj)
        q_nope, q_rope = q.view(b, s, self.local_heads, -1).transpose(1, 2).split([self.nope, self.rope_dim], -1)
        c_kv, k_rope = c_kv.unsqueeze(1), k_rope.unsqueeze(1)  # [B, 1, S, .]: one "head", shared
        cos, sin = ctx.rope[self.layer_type]
        q = torch.cat([q_nope, self.rotate(q_rope, cos, sin)], dim=-1)
        k_rope = self.rotate(k_rope, cos, sin)
        if kv_cache is not None:
            c_kv, k_rope = kv_cache.append(self.layer_index, c_kv, k_rope)
            out = kv_cache.attend(q, *self.expand(c_kv, k_rope), self.pattern)
        elif ctx.cp is not None and ctx.cp.impl == "allgather":
            out = self._gathered_core(q, c_kv, k_rope, ctx)
        elif ctx.recompute_core:
            k, v = self.expand(c_kv, k_rope)
            out = torch.utils.checkpoint.checkpoint(self.core, q, k, v, ctx.dropout_seed, ctx.cp, ctx.documents,
                                                    use_reentrant=False)
        else:
            out = self.core(q, *self.expand(c_kv, k_rope), ctx.dropout_seed, ctx.cp, ctx.documents)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, self.local_heads * self.v_dim))
