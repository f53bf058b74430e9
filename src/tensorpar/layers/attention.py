"""Tensor-parallel self-attention with grouped-query attention, whole heads per rank.

Q is column-parallel (each rank holds num_heads / tp query heads); K and V likewise when there
are at least as many KV heads as ranks. With fewer KV heads than ranks (Llama-70B's 8 KV heads
at TP 16, say) each KV head is replicated on the tp / num_kv_heads consecutive ranks whose
query heads use it, and its gradient is summed across them. The output projection is
row-parallel: one all-reduce (or reduce-scatter under sequence parallelism) per attention.

What the config varies, the layer computes for its own heads: q and k normalised before RoPE (per head, or over the
whole projection with its sums of squares all-reduced: `tensorpar.layers.norms`), the RoPE of its layer type, and
its `AttentionPattern`: the score scale, Gemma 2's soft cap, the sliding window of a sliding layer.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from tensorpar.context_parallel.ring_attention import ContextSplit, context_attention
from tensorpar.distributed.comm import as_group
from tensorpar.distributed.sharding import ShardSpec, tag
from tensorpar.errors import LayoutError
from tensorpar.functional.attention_pattern import AttentionPattern
from tensorpar.functional.document_mask import PackedDocuments
from tensorpar.functional.dropout import fork_rng_seeded, mix_seed
from tensorpar.functional.rope import apply_rope
from tensorpar.functional.varlen_attention import document_attention
from tensorpar.layout import divide
from tensorpar.layers.micro_batch import MicroBatchContext
from tensorpar.layers.norms import HeadNorm, ProjectionNorm, replica_grad_reduce
from tensorpar.layout.rules import kv_heads_per_rank
from tensorpar.tensor_parallel.linear import ColumnParallelLinear, RowParallelLinear
from tensorpar.tensor_parallel.lora import (Adapter, LoraSite, LoraSpec, add_column_adapters, adapter_region,
                                           column_factors, lora_site)
from tensorpar.tensor_parallel.region import Projection, as_region


class KVParallelLinear(nn.Module):
    """The K or V projection: `num_kv_heads` heads of `head_dim` split across TP ranks, or replicated on
    groups of consecutive ranks when there are fewer heads than ranks (gradients summed over the copies: an
    all-reduce over the TP group of a buffer holding one slot per distinct shard, in the backward).

    Its product is applied by the attention, which enters the TP region with q, k and v together
    (`TPRegion.enter` with the three projections). `lora`: a LoRA adapter on it (A replicated, B split as the weight,
    its replicas' gradients summed as the weight's), which the attention adds (`add_column_adapters`).
    """

    def __init__(self, in_features: int, num_kv_heads: int, head_dim: int, tp_group=None, bias: bool = True,
                 device=None, lora: LoraSite | None = None, sequence_parallel: bool = False):
        super().__init__()
        self.tp_group = as_group(tp_group)
        self.local_heads, self.replicas = kv_heads_per_rank(num_kv_heads, self.tp_group.size)
        self.in_features, self.out_features = in_features, num_kv_heads * head_dim
        spec = ShardSpec(dim=0, full_size=self.out_features, padded_size=self.out_features, replicas=self.replicas)
        rows = self.local_heads * head_dim
        self.weight = tag(nn.Parameter(torch.empty(rows, in_features, device=device)), spec)
        self.bias = tag(nn.Parameter(torch.empty(rows, device=device)), spec) if bias else None
        self.lora = lora
        if lora is not None:
            self.lora_A, self.lora_B = column_factors(lora, in_features, rows, spec, sequence_parallel, device)

    def projection(self) -> Projection:
        """The product's weight and bias; replicated heads sum their gradients over the copies."""
        return Projection(self.weight, self.bias, replica_grad_reduce(self.tp_group, self.replicas))

    def adapter(self) -> Adapter | None:
        """The LoRA adapter (None without one); B's gradient summed over the copies as the weight's."""
        if self.lora is None:
            return None
        return Adapter(self.lora_A.weight, self.lora_B.weight, self.lora, self.training,
                       replica_grad_reduce(self.tp_group, self.replicas))

    def extra_repr(self) -> str:
        return f"{self.in_features}, {self.out_features}, local_heads={self.local_heads}, replicas={self.replicas}"


def _qk_norms(cfg, region, local_heads: int, local_kv_heads: int, kv_replicas: int, device):
    """The norms of q and k (None, None without qk_norm): each head's, or the whole projection's."""
    if cfg.qk_norm == "head":
        return tuple(HeadNorm(cfg.head_dim, cfg.norm_eps, region, device, cfg.norm_offset) for _ in range(2))
    if cfg.qk_norm == "projection":
        group, hd = region.group, cfg.head_dim
        return (ProjectionNorm(cfg.num_heads, local_heads, hd, cfg.norm_eps, group, 1, device, cfg.norm_offset),
                ProjectionNorm(cfg.kv_heads, local_kv_heads, hd, cfg.norm_eps, group, kv_replicas, device,
                               cfg.norm_offset))
    return None, None


class ParallelAttention(nn.Module):
    """Causal self-attention: [B, S, H] (or [B, S/tp, H] under sequence parallelism) in and out."""

    def __init__(self, cfg, region=None, layer_index: int = 0, device=None, exit_region=None,
                 document_attention: str = "auto", lora: LoraSpec | None = None):
        """`region`: the model's `TPRegion` (or a mesh / group: plain collectives); `exit_region`, if given, the
        one the output projection leaves by (default: `region`); `document_attention`: the kernel of attention
        within packed documents (`tensorpar.functional.varlen_attention`); `lora`: the run's LoRA adapters (on the
        projections its targets name)."""
        super().__init__()
        self.document_attention = document_attention
        self.region = as_region(region)
        self.tp_group = self.region.group
        tp = self.tp_group.size
        self.sequence_parallel, self.layer_index = self.region.sequence_parallel, layer_index
        self.head_dim = cfg.head_dim
        self.local_heads = divide(cfg.num_heads, tp, "num_heads")
        self.local_kv_heads, self.kv_replicas = kv_heads_per_rank(cfg.kv_heads, tp)
        self.dropout = cfg.dropout
        self.layer_type = cfg.layer_type(layer_index)
        self.pattern = AttentionPattern(cfg.attention_scale, cfg.attn_logit_softcap, cfg.attention_window(layer_index))
        h, hd = cfg.hidden_size, cfg.head_dim
        qkv_bias, sp = cfg.attention_qkv_bias, self.sequence_parallel
        site = functools.partial(lora_site, lora, layer_index)
        self.q_proj = ColumnParallelLinear(h, cfg.num_heads * hd, self.region, qkv_bias, device=device, init=False,
                                           lora=site("q"))
        self.k_proj = KVParallelLinear(h, cfg.kv_heads, hd, self.tp_group, qkv_bias, device, site("k"), sp)
        self.v_proj = KVParallelLinear(h, cfg.kv_heads, hd, self.tp_group, qkv_bias, device, site("v"), sp)
        self.o_proj = RowParallelLinear(cfg.num_heads * hd, h, exit_region or self.region, cfg.bias, device=device,
                                        init=False, lora=site("o"))
        qkv = (self.q_proj, self.k_proj, self.v_proj)
        self.adapter_region = adapter_region(self.region, any(p.lora is not None for p in qkv))
        self.q_norm, self.k_norm = _qk_norms(cfg, self.region, self.local_heads, self.local_kv_heads,
                                             self.kv_replicas, device)

    def _repeat_kv(self, k, v):
        if self.local_kv_heads == self.local_heads:
            return k, v
        repeat = self.local_heads // self.local_kv_heads
        return k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)

    def cache_layout(self) -> tuple[tuple[int, int], tuple[int, int]]:
        """(heads, dim) of what a KV cache holds per token and layer on this rank, as (keys, values)."""
        return (self.local_kv_heads, self.head_dim), (self.local_kv_heads, self.head_dim)

    def core(self, q, k, v, dropout_seed: int | None, context: ContextSplit | None = None,
             documents: PackedDocuments | None = None):
        """softmax(scores) v over this rank's heads (the part selective recomputation recomputes), the scores as the
        layer's pattern makes them (scale, soft cap, window); with `context`, over the whole sequence of which this
        CP rank holds its chunks (ring or all-gather); with `documents` (of the whole window), within each packed
        document only, by the placement's kernel (`document_attention`)."""
        dropout = self.dropout if self.training else 0.0
        if context is not None:
            seed = mix_seed(dropout_seed, self.layer_index, 2, self.tp_group.rank) if dropout > 0 else None
            return context_attention(q, k, v, context, dropout, seed, documents, self.pattern)
        if dropout > 0:  # inside the TP region: each rank's heads get their own masks
            with fork_rng_seeded(mix_seed(dropout_seed, self.layer_index, 2, self.tp_group.rank), q.device):
                return self._attend(q, k, v, documents, dropout)
        return self._attend(q, k, v, documents, dropout)

    def _attend(self, q, k, v, documents: PackedDocuments | None, dropout: float):
        if documents is not None:
            return document_attention(q, k, v, documents, self.document_attention, dropout, self.pattern)
        k, v = self._repeat_kv(k, v)
        # A window is a boolean mask (causal within the window); else SDPA's own causal mask.
        mask = self.pattern.causal_mask(q.shape[2], q.device) if self.pattern.windowed(q.shape[2]) else None
        return self.pattern.attend(q, k, v, mask, mask is None, dropout)

    def cached_core(self, q, k, v, kv_cache):
        """Attention of the new queries over every cached position (inference: no dropout, no recomputation). The
        cache laid the keys out (`append`), so it pairs them with the queries: `kv_cache.attend(q, k, v, pattern)`."""
        k, v = self._repeat_kv(k, v)
        return kv_cache.attend(q, k, v, self.pattern)

    def forward(self, x: torch.Tensor, ctx: MicroBatchContext = MicroBatchContext()):
        """Attention of the micro-batch `ctx` describes: with its `kv_cache` (inference, no sequence parallelism)
        `ctx.rope` holds the new tokens' absolute positions, their keys and values go into the cache and attention
        spans every cached one; with its `documents` (of the whole window), within each packed document only."""
        kv_cache = ctx.kv_cache
        if kv_cache is not None and self.sequence_parallel:
            raise LayoutError("the KV-cache path runs without sequence parallelism")
        qkv = (self.q_proj, self.k_proj, self.v_proj)
        q, k, v = self.region.enter(x, [p.projection() for p in qkv])
        if self.adapter_region is not None:
            q, k, v = add_column_adapters(self.adapter_region, x, [q, k, v], [p.adapter() for p in qkv], ctx)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        b, s = q.shape[:2]
        q = q.view(b, s, self.local_heads, self.head_dim).transpose(1, 2)
        k = k.view(b, s, self.local_kv_heads, self.head_dim).transpose(1, 2)
        v = v.view(b, s, self.local_kv_heads, self.head_dim).transpose(1, 2)
        if ctx.rope is not None:
            cos, sin = ctx.rope[self.layer_type]
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if kv_cache is not None:
            k, v = kv_cache.append(self.layer_index, k, v)
            out = self.cached_core(q, k, v, kv_cache)
        elif ctx.recompute_core:
            out = torch.utils.checkpoint.checkpoint(self.core, q, k, v, ctx.dropout_seed, ctx.cp, ctx.documents,
                                                    use_reentrant=False)
        else:
            out = self.core(q, k, v, ctx.dropout_seed, ctx.cp, ctx.documents)
        out = out.transpose(1, 2).reshape(b, s, self.local_heads * self.head_dim)
        return self.o_proj(out, ctx)
