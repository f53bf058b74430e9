"""One transformer block: x + dropout(attention(norm(x))), then x + dropout(mlp(norm(x))) (the MLP a mixture of
experts on MoE layers). Its forward takes the hidden states and the micro-batch's `MicroBatchContext`.

Where the norms sit is the config's `norm_placement`: before each sublayer ("pre": `attn_norm`, `mlp_norm`), before
and after ("sandwich", Gemma: also `post_attn_norm`, `post_mlp_norm` on the sublayer's output, before the residual
sum) or after only ("post", OLMo 2: `post_attn_norm`, `post_mlp_norm`)."""

from __future__ import annotations

from torch import nn

from tensorpar.context_parallel.ring_attention import ContextSplit
from tensorpar.expert_parallel import MoELayer
from tensorpar.functional.dropout import mix_seed, seeded_dropout
from tensorpar.layers.attention import ParallelAttention
from tensorpar.layers.latent_attention import LatentAttention
from tensorpar.layers.micro_batch import MicroBatchContext
from tensorpar.layers.norms import Norm
from tensorpar.tensor_parallel.mlp import ParallelMLP


class TransformerBlock(nn.Module):
    def __init__(self, cfg, placement, layer_index: int, device=None):
        """`placement`: the model's `Placement` (its TP region, and the exit region of the MLP's down projection)."""
        super().__init__()
        region = placement.region
        self.layer_index, self.dropout = layer_index, cfg.dropout
        self.tp_group, self.sequence_parallel = region.group, region.sequence_parallel
        before, after = cfg.norm_placement in ("pre", "sandwich"), cfg.norm_placement in ("sandwich", "post")
        norm = lambda wanted: Norm(cfg.hidden_size, cfg.norm, cfg.norm_eps, region, device=device,  # noqa: E731
                                   offset=cfg.norm_offset) if wanted else None
        self.attn_norm = norm(before)
        if cfg.is_mla:  # its documents' mask is SDPA's dense one (its own values' width, its latent KV cache)
            self.attn = LatentAttention(cfg, region, layer_index, device=device)
        else:
            self.attn = ParallelAttention(cfg, region, layer_index, device=device,
                                          document_attention=placement.document_attention, lora=placement.lora)
        self.post_attn_norm = norm(after)
        self.mlp_norm = norm(before)
        self.moe = cfg.is_moe_layer(layer_index)
        if self.moe:
            self.mlp = MoELayer(cfg, region, placement.ep_group, placement.cp_group, device=device,
                                expert_tp_group=placement.expert_tp_group, expert_gemm=placement.expert_gemm)
        else:
            self.mlp = ParallelMLP(cfg, region, device=device, exit_region=placement.exit_region, lora=placement.lora,
                                   layer_index=layer_index)
        self.post_mlp_norm = norm(after)

    def _drop(self, x, site: int, ctx: MicroBatchContext):
        """Residual dropout, outside the TP regions: same mask on every TP rank unless the sequence is sharded."""
        if not self.training or self.dropout == 0:
            return x
        shard = sequence_shard(self.tp_group, self.sequence_parallel, ctx.cp)
        return seeded_dropout(x, self.dropout, mix_seed(ctx.dropout_seed, self.layer_index, site, shard), True)

    def forward(self, x, ctx: MicroBatchContext = MicroBatchContext()):
        h = self.attn(_maybe(self.attn_norm, x), ctx)
        x = x + self._drop(_maybe(self.post_attn_norm, h), 0, ctx)
        h = _maybe(self.mlp_norm, x)
        h = self.mlp(h, ctx.cp, ctx.aux_scale, ctx.record_stats) if self.moe else self.mlp(h, ctx)
        return x + self._drop(_maybe(self.post_mlp_norm, h), 1, ctx)


def _maybe(norm, x):
    """`norm(x)`, or `x` where the block has no norm there."""
    return x if norm is None else norm(x)


def recomputable(layer):
    """`layer` as the function activation checkpointing calls twice: the forward, then its recomputation in
    the backward, which is told so (`record_stats=False`: an MoE layer's routing statistics count once). It takes
    the layer's inputs, the `MicroBatchContext` last."""
    calls = 0

    def run(*args):
        nonlocal calls
        calls += 1
        *inputs, ctx = args
        return layer(*inputs, ctx.replace(record_stats=calls == 1))

    return run


def sequence_shard(tp_group, sequence_parallel: bool, context: ContextSplit | None) -> int:
    """Which part of the sequence this rank's activations hold outside the TP regions (for dropout seeds):
    0 on every rank without sequence or context parallelism, else distinct per CP rank and (with SP) TP rank."""
    shard = tp_group.rank if sequence_parallel else 0
    return shard + (context.group.rank * tp_group.size if context is not None else 0)
