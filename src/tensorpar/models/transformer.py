"""The tensor-parallel transformer (GPT-2 and Llama families), readable top to bottom.

    ids -> VocabParallelEmbedding (+ learned positions) -> dropout
        -> N x [ x + dropout(attention(norm(x))) ; x + dropout(mlp(norm(x))) ]
        -> norm -> vocabulary-parallel logits -> vocab_parallel_cross_entropy

In a mixture-of-experts model the mlp of every `moe_layer_freq`-th layer is an `MoELayer`, whose routed
experts are split over the mesh's expert-parallel group (tensorpar.expert_parallel).

Without sequence parallelism every TP rank holds the whole [B, S, H] activation between the
TP regions; with it, each rank holds a [B, S/tp, H] sequence shard there (norms, dropout and
residuals on shards) and the regions are entered by all-gather and left by reduce-scatter.
The sequence length must then divide by TP: it is refused with a clear error otherwise.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from tensorpar.config.choices import RECOMPUTE_MODES
from tensorpar.context_parallel.cp_mappings import mean_from_cp
from tensorpar.context_parallel.ring_attention import ContextSplit, check_context_split
from tensorpar.distributed.comm import as_group
from tensorpar.distributed.sharding import ShardSpec, retag, tag
from tensorpar.errors import LayoutError, TensorparError
from tensorpar.expert_parallel import MoELayer
from tensorpar.functional.document_mask import PackedDocuments
from tensorpar.functional.dropout import mix_seed, seeded_dropout
from tensorpar.functional.rope import inverse_frequencies, rope_cos_sin
from tensorpar.layers.attention import ParallelAttention
from tensorpar.layers.norms import Norm
from tensorpar.models.config import ModelConfig
from tensorpar.models.init import init_weights
from tensorpar.pipeline_parallel.weight_grad import WeightGradQueue
from tensorpar.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from tensorpar.tensor_parallel.embedding import VocabParallelEmbedding
from tensorpar.tensor_parallel.lm_head import VocabParallelLMHead
from tensorpar.tensor_parallel.mappings import copy_to_tp
from tensorpar.tensor_parallel.mlp import ParallelMLP
from tensorpar.tensor_parallel.fp8_scaling import Fp8Recipe
from tensorpar.tensor_parallel.region import TPRegion, tp_region


class TransformerBlock(nn.Module):
    def __init__(self, cfg: ModelConfig, region: TPRegion, layer_index: int, device=None, ep_group=None,
                 cp_group=None, expert_tp_group=None, exit_region: TPRegion | None = None):
        """`exit_region`: the region the MLP's down projection leaves by, when not `region` (full recomputation)."""
        super().__init__()
        self.layer_index, self.dropout = layer_index, cfg.dropout
        self.tp_group, self.sequence_parallel = region.group, region.sequence_parallel
        self.attn_norm = Norm(cfg.hidden_size, cfg.norm, cfg.norm_eps, region, device=device)
        self.attn = ParallelAttention(cfg, region, layer_index, device=device)
        self.mlp_norm = Norm(cfg.hidden_size, cfg.norm, cfg.norm_eps, region, device=device)
        self.moe = cfg.is_moe_layer(layer_index)
        if self.moe:
            self.mlp = MoELayer(cfg, region, as_group(ep_group, "ep"), as_group(cp_group, "cp"), device=device,
                                expert_tp_group=as_group(expert_tp_group, "expert_tp"))
        else:
            self.mlp = ParallelMLP(cfg, region, device=device, exit_region=exit_region)

    def _drop(self, x, site: int, dropout_seed, context):
        """Residual dropout, outside the TP regions: same mask on every TP rank unless the sequence is sharded."""
        if not self.training or self.dropout == 0:
            return x
        shard = sequence_shard(self.tp_group, self.sequence_parallel, context)
        return seeded_dropout(x, self.dropout, mix_seed(dropout_seed, self.layer_index, site, shard), True)

    def forward(self, x, rope=None, dropout_seed: int | None = None, recompute_core: bool = False,
                kv_cache=None, layer_key=None, context: ContextSplit | None = None, aux_scale: float = 1.0,
                record_stats: bool = True, documents: PackedDocuments | None = None):
        attn = self.attn(self.attn_norm(x), rope, dropout_seed, recompute_core, kv_cache=kv_cache, layer_key=layer_key,
                         context=context, documents=documents)
        x = x + self._drop(attn, 0, dropout_seed, context)
        h = self.mlp_norm(x)
        h = self.mlp(h, context, aux_scale, record_stats) if self.moe else self.mlp(h)
        return x + self._drop(h, 1, dropout_seed, context)


def _recomputable(layer):
    """`layer` as the function activation checkpointing calls twice: the forward, then its recomputation in
    the backward, which is told so (`record_stats=False`: an MoE layer's routing statistics count once)."""
    calls = 0

    def run(*args, **kwargs):
        nonlocal calls
        calls += 1
        return layer(*args, record_stats=calls == 1, **kwargs)

    return run


def sequence_shard(tp_group, sequence_parallel: bool, context: ContextSplit | None) -> int:
    """Which part of the sequence this rank's activations hold outside the TP regions (for dropout seeds):
    0 on every rank without sequence or context parallelism, else distinct per CP rank and (with SP) TP rank."""
    shard = tp_group.rank if sequence_parallel else 0
    return shard + (context.group.rank * tp_group.size if context is not None else 0)


class Transformer(nn.Module):
    """A GPT-2 or Llama-style decoder whose layers are split across `mesh`'s TP group.

    `forward(ids)` returns this rank's vocabulary shard of the logits, [B, S, padded_vocab / tp];
    `forward(ids, targets)` the mean next-token cross-entropy over targets that are not -100.
    Weights are initialised from `seed` as full tensors and then sharded, so any TP size starts
    from the same dense model (``init=False`` leaves them uninitialised, for loading).

    A pipeline stage is the same class holding `layers` (global indices; parameter names keep
    them, so checkpoints and initialisation agree across layouts), the embedding when
    `first_stage`, and the final norm and head when `last_stage`; its forward then takes and/or
    returns hidden states. With tied embeddings the last stage holds a copy of the embedding
    (`ShardSpec.pipeline_duplicate`), kept equal to the first stage's by summing their gradients.

    ``tp_overlap`` (the default) hides the TP collectives at the edges of each TP region behind the
    GEMMs beside them (tensorpar.tensor_parallel.tp_overlap); ``tp_overlap=False`` issues them as plain
    blocking collectives (the same function, the same bytes), to measure the difference. With
    ``weight_grads`` (a `WeightGradQueue`, for the zero-bubble schedules) every layer's backward leaves its
    weight gradients in the queue. Both go into the model's `TPRegion` (`self.region`), which every layer
    asks how to enter and leave a TP region.

    ``loss_chunk_tokens``: the training loss runs the head and the cross-entropy fused, that many tokens at a
    time, never holding the whole [B, S, V / tp] logits (`VocabParallelLMHead.loss`); None: logits, then the
    loss. `logits()` (eval, generation) is the same either way.

    ``fp8``: an `Fp8Recipe`: the GEMMs of the column/row-parallel linears and of the experts run in fp8
    (`TPRegion.fp8`); the embedding, head, norms, router and attention keep the parameters' dtype.
    """

    def __init__(
        self,
        cfg: ModelConfig,
        mesh=None,
        *,
        sequence_parallel: bool = False,
        recompute: str = "none",
        seed: int = 0,
        init: bool = True,
        device=None,
        layers=None,
        first_stage: bool = True,
        last_stage: bool = True,
        cp_impl: str = "ring",
        cp_split: str = "zigzag",
        tp_overlap: bool = True,
        weight_grads: WeightGradQueue | None = None,
        loss_chunk_tokens: int | None = None,
        fp8: Fp8Recipe | None = None,
    ):
        super().__init__()
        if recompute not in RECOMPUTE_MODES:
            raise TensorparError(f"recompute must be one of {RECOMPUTE_MODES}, got {recompute!r}")
        self.cfg = cfg
        self.tp_group = as_group(mesh, "tp")
        self.cp_group = as_group(mesh, "cp")
        self.ep_group = as_group(mesh, "ep")
        self.expert_tp_group = as_group(mesh, "expert_tp")
        self.cp_split, self.cp_impl = cp_split, cp_impl
        self.region = tp_region(self.tp_group, sequence_parallel=sequence_parallel, overlap=tp_overlap,
                                weight_grads=weight_grads, fp8=fp8)
        self.sequence_parallel = self.region.sequence_parallel
        self.recompute = recompute
        if loss_chunk_tokens is not None and loss_chunk_tokens < 1:
            raise TensorparError(f"loss_chunk_tokens must be a positive number of tokens or None, "
                                 f"got {loss_chunk_tokens}")
        self.loss_chunk_tokens = loss_chunk_tokens
        device = device if device is not None else getattr(mesh, "device", None)
        region = self.region
        # Full recomputation stops re-running a block's forward once every tensor its backward saved is back, so a
        # plain row-parallel exit's reduction is not repeated; in the overlapped exit that reduction runs inside the
        # op that saves them, and would be. The block's last exit (the MLP's) therefore leaves by plain collectives.
        exit_region = region.without_overlap() if recompute == "full" else region

        self.first_stage, self.last_stage = first_stage, last_stage
        layers = range(cfg.num_layers) if layers is None else layers
        self.embed = self.pos_embed = self.final_norm = self.head = None
        self._build_inputs(device)
        # Keyed by global layer index, so that a stage's parameter names are the dense model's.
        self.layers = nn.ModuleDict({str(i): TransformerBlock(cfg, region, i, device, self.ep_group, self.cp_group,
                                                              self.expert_tp_group, exit_region)
                                     for i in layers})
        self._build_outputs(device)
        if cfg.position == "rope":
            self.register_buffer("inv_freq", inverse_frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
                                 .to(device), persistent=False)
        if init:
            init_weights(self, seed)

    def _build_inputs(self, device) -> None:
        """The embedding (on the first stage, and its tied copy on the last) and the learned positions."""
        cfg, first, last = self.cfg, self.first_stage, self.last_stage
        if first or (last and cfg.tie_embeddings):
            self.embed = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, self.region, device=device,
                                                init=False)
            if not first:  # the head's copy of the first stage's embedding
                retag(self.embed.weight, pipeline_duplicate=True)
            if not (first and last) and cfg.tie_embeddings:
                retag(self.embed.weight, pipeline_tied=True)
        if first and cfg.position == "learned":
            self.pos_embed = tag(nn.Parameter(torch.empty(cfg.max_seq_len, cfg.hidden_size, device=device)),
                                 ShardSpec(dim=None, reduce_grad_across_tp=self.sequence_parallel))

    def _build_outputs(self, device) -> None:
        """The final norm and the LM head (the embedding's, tied) on the last stage."""
        if not self.last_stage:
            return
        cfg = self.cfg
        self.final_norm = Norm(cfg.hidden_size, cfg.norm, cfg.norm_eps, self.region, device=device)
        if cfg.tie_embeddings:
            self.head = VocabParallelLMHead.tied(self.embed)
        else:
            self.head = VocabParallelLMHead(cfg.hidden_size, cfg.vocab_size, self.region, bias=False, device=device,
                                            init=False)

    # -- pieces -------------------------------------------------------------------------------

    def check_sequence(self, seq_len: int) -> None:
        """`seq_len`: the whole sequence (all CP ranks' positions)."""
        tp, cp = self.tp_group.size, self.cp_group.size
        check_context_split(seq_len, cp)
        if self.sequence_parallel and (seq_len // cp) % tp:
            raise LayoutError(
                f"sequence length {seq_len} is not divisible by the tensor-parallel size {tp}; sequence parallelism "
                f"splits the sequence evenly across TP ranks: use a multiple of {tp} or drop --sequence-parallel"
            )
        if self.cfg.position == "learned" and seq_len > self.cfg.max_seq_len:
            raise TensorparError(f"sequence length {seq_len} exceeds the model's {self.cfg.max_seq_len} positions")

    def context(self, seq_len: int) -> ContextSplit | None:
        """How a sequence of `seq_len` positions lies across the CP ranks (None without context parallelism)."""
        if self.cp_group.size == 1:
            return None
        return ContextSplit(self.cp_group, seq_len, self.cp_split, self.cp_impl)

    def positions(self, seq_len: int, context: ContextSplit | None, device,
                  documents: PackedDocuments | None = None) -> torch.Tensor:
        """The positions of this rank's tokens (all of them without context parallelism): in the window, [S], or
        with `documents` (the window's packed documents) in each token's document, [B, S]."""
        if documents is not None:
            return documents.position if context is None else context.local(documents.position)
        return torch.arange(seq_len, device=device) if context is None else context.positions(device)

    def embed_tokens(self, ids: torch.Tensor, dropout_seed: int | None = None,
                     context: ContextSplit | None = None, documents: PackedDocuments | None = None) -> torch.Tensor:
        """Embed this rank's token ids (its CP chunks of the sequence when `context` is given)."""
        h = self.embed(ids)
        if self.pos_embed is not None:
            seq_len = context.seq_len if context is not None else ids.shape[1]
            pos = self.region.lookup(self.positions(seq_len, context, ids.device, documents), self.pos_embed)
            if self.sequence_parallel:
                # Each rank adds the positions of its shard; the gradient of the [(B,) S, H] slice is summed across TP.
                pos = copy_to_tp(pos, self.tp_group).chunk(self.tp_group.size, -2)[self.tp_group.rank]
            h = h + pos
        if self.training and self.cfg.dropout > 0:
            shard = sequence_shard(self.tp_group, self.sequence_parallel, context)
            h = seeded_dropout(h, self.cfg.dropout, mix_seed(dropout_seed, 2**20, shard), True)
        return h

    def rope(self, seq_len: int, dtype: torch.dtype, context: ContextSplit | None = None,
             documents: PackedDocuments | None = None):
        """cos/sin of this rank's positions (its CP chunks' under context parallelism; in their documents with
        `documents`)."""
        if self.cfg.position != "rope":
            return None
        return rope_cos_sin(self.positions(seq_len, context, self.inv_freq.device, documents), self.inv_freq, dtype)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Vocabulary-sharded logits of the full sequence: [B, S, padded_vocab / tp]."""
        return self.head(h)

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The mean next-token loss over the targets that are not -100 (under context parallelism, of every CP rank)."""
        loss = vocab_parallel_cross_entropy(logits, targets, self.tp_group, vocab_size=self.cfg.vocab_size)
        return mean_from_cp(loss, (targets != -100).sum(), self.cp_group)

    def head_loss(self, h: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """`loss(logits(h), targets)`, with the head and the loss fused per `loss_chunk_tokens` when the model was
        built with it (under the zero-bubble split backward the head keeps the unfused path: see its `loss`)."""
        if self.loss_chunk_tokens is None:
            return self.loss(self.logits(h), targets)
        loss = self.head.loss(h, targets, chunk_tokens=self.loss_chunk_tokens)
        return mean_from_cp(loss, (targets != -100).sum(), self.cp_group)

    # -- forward ------------------------------------------------------------------------------

    def forward(self, ids: torch.Tensor, targets: torch.Tensor | None = None, dropout_seed: int | None = None,
                aux_scale: float = 1.0, documents: PackedDocuments | None = None):
        """`ids` [B, S] on the first stage, hidden states [B, S(/cp)(/tp), H] on the others; returns the loss
        (targets [B, S] given) or the logits on the last stage, hidden states on the others. Under context
        parallelism every CP rank gets the whole sequence's ids and targets and keeps its own chunks; its logits
        and hidden states are those of its chunks.

        `documents`: the packed documents of the whole window ([B, S], `PackedDocuments.from_tokens(ids, eos)`,
        on every stage): attention within each document only, positions counted from each document's start.

        MoE models: the router losses are not in the returned loss; their gradients join the backward pass
        scaled by `aux_scale`, the factor the caller multiplies the returned loss by before calling backward."""
        return self.forward_layers(ids, list(self.layers), targets, dropout_seed, embed=self.first_stage,
                                   head=self.last_stage, aux_scale=aux_scale, documents=documents)

    def moe_layers(self) -> dict[int, MoELayer]:
        """This rank's MoE layers by global layer index."""
        return {int(key): block.mlp for key, block in self.layers.items() if block.moe}

    def forward_layers(self, x, layer_keys, targets=None, dropout_seed=None, *, embed: bool, head: bool,
                       aux_scale: float = 1.0, documents: PackedDocuments | None = None):
        """Run the layers `layer_keys` (one pipeline chunk), starting from token ids if `embed`, ending in
        the loss (or logits) if `head`; hidden states in and out otherwise. `documents`: as in `forward`."""
        if self.training and self.cfg.dropout > 0 and dropout_seed is None:
            raise TensorparError("dropout is on: pass dropout_seed to the forward pass (the trainer does)")
        if embed:
            seq_len = x.shape[1]
            self.check_sequence(seq_len)
            context = self.context(seq_len)
            if documents is not None and documents.index.shape != x.shape:
                raise TensorparError(f"documents of shape {tuple(documents.index.shape)} for token ids of shape "
                                     f"{tuple(x.shape)}: give the documents of the same windows")
            h = self.embed_tokens(x if context is None else context.local(x), dropout_seed, context, documents)
        else:
            h = x
            seq_len = h.shape[1] * (self.tp_group.size if self.sequence_parallel else 1) * self.cp_group.size
            context = self.context(seq_len)
        rope = self.rope(seq_len, h.dtype, context, documents)  # like transformers: cos/sin in the hidden states' dtype
        for key in layer_keys:
            layer = self.layers[str(key)]
            if self.recompute == "full" and self.training:
                h = checkpoint(_recomputable(layer), h, rope, dropout_seed, context=context, aux_scale=aux_scale,
                               documents=documents, use_reentrant=False)
            else:
                h = layer(h, rope, dropout_seed, recompute_core=self.recompute == "selective" and self.training,
                          context=context, aux_scale=aux_scale, documents=documents)
        if not head:
            return h
        h = self.final_norm(h)
        if targets is None:
            return self.logits(h)
        return self.head_loss(h, targets if context is None else context.local(targets))

    def forward_cached(self, ids: torch.Tensor, cache, start_pos=None) -> torch.Tensor:
        """Inference with a KV cache (tensorpar.inference.KVCache): run the new tokens `ids` [B, s] whose first one
        sits at absolute position `start_pos` (an int, or a [B] tensor for left-padded rows; default: where the
        cache ends), append their keys and values, and return this rank's vocabulary shard of the logits of the
        LAST position: [B, padded_vocab / tp]. Whole model on one TP group: no sequence or pipeline parallelism."""
        if self.sequence_parallel or self.cp_group.size > 1:
            raise LayoutError("generation with a KV cache runs without sequence or context parallelism: build the "
                              "model with sequence_parallel=False and cp = 1 (the weights are the same)")
        if not (self.first_stage and self.last_stage):
            raise LayoutError("generation with a KV cache needs the whole model on every rank (pipeline size 1)")
        start_pos = cache.start_positions() if start_pos is None else start_pos
        positions = (torch.as_tensor(start_pos, device=ids.device)[..., None]
                     + torch.arange(ids.shape[1], device=ids.device)).clamp(min=0)  # [s] or [B, s]; padding -> 0
        h = self.embed(ids)
        if self.pos_embed is not None:
            if int(positions.max()) >= self.cfg.max_seq_len:
                raise TensorparError(f"position {int(positions.max())} exceeds the model's "
                                     f"{self.cfg.max_seq_len} learned positions")
            h = h + self.pos_embed[positions]
        rope = rope_cos_sin(positions, self.inv_freq, h.dtype) if self.cfg.position == "rope" else None
        for key, layer in self.layers.items():
            h = layer(h, rope, kv_cache=cache, layer_key=key)
        cache.advance(ids.shape[1])
        return self.logits(self.final_norm(h[:, -1]))

    def mask_padding(self, logits: torch.Tensor) -> torch.Tensor:
        """Set this rank's padding columns to -inf, so that they never win an argmax or a sample."""
        start = self.tp_group.rank * logits.shape[-1]
        valid = max(0, min(logits.shape[-1], self.cfg.vocab_size - start))
        if valid < logits.shape[-1]:
            logits = logits.clone()
            logits[..., valid:] = float("-inf")
        return logits
