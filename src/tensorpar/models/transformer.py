"""The tensor-parallel transformer (GPT-2 and Llama families), readable top to bottom.

    ids -> VocabParallelEmbedding (x embedding_multiplier) (+ learned positions) -> dropout
        -> N x [ x + dropout(attention(norm(x))) ; x + dropout(mlp(norm(x))) ]
        -> norm -> vocabulary-parallel logits (soft-capped) -> vocab_parallel_cross_entropy

(the norms where the config's `norm_placement` puts them: tensorpar.models.block).

In a mixture-of-experts model the mlp of every `moe_layer_freq`-th layer is an `MoELayer`, whose routed
experts are split over the mesh's expert-parallel group (tensorpar.expert_parallel). Latent attention
(tensorpar.layers.latent_attention) replaces the attention when the config sets `kv_lora_rank`, and multi-token
prediction modules (tensorpar.models.mtp) follow the layers on the last stage when it sets `num_mtp_layers`.

Without sequence parallelism every TP rank holds the whole [B, S, H] activation between the
TP regions; with it, each rank holds a [B, S/tp, H] sequence shard there (norms, dropout and
residuals on shards) and the regions are entered by all-gather and left by reduce-scatter.
The sequence length must then divide by TP: it is refused with a clear error otherwise.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from tensorpar.context_parallel.cp_mappings import mean_from_cp
from tensorpar.context_parallel.ring_attention import ContextSplit
from tensorpar.distributed.sharding import ShardSpec, retag, tag
from tensorpar.errors import LayoutError, TensorparError
from tensorpar.expert_parallel import MoELayer
from tensorpar.functional.document_mask import PackedDocuments
from tensorpar.functional.dropout import mix_seed, seeded_dropout
from tensorpar.functional.rope import Rotary, rope_tables
from tensorpar.layout import require
from tensorpar.layout.rules import (context_split_problem, positions_problem, require_model_config,
                                    sequence_parallel_problem)
from tensorpar.layers.micro_batch import MicroBatchContext
from tensorpar.layers.norms import Norm
from tensorpar.models.block import TransformerBlock, recomputable, sequence_shard
from tensorpar.models.config import ModelConfig
from tensorpar.models.init import init_weights
from tensorpar.models.mtp import MTPStats, MultiTokenPrediction, shifted, with_mtp_loss
from tensorpar.models.placement import Placement, as_placement
from tensorpar.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from tensorpar.tensor_parallel.embedding import VocabParallelEmbedding
from tensorpar.tensor_parallel.lm_head import VocabParallelLMHead, soft_cap
from tensorpar.tensor_parallel.lora import is_adapter
from tensorpar.tensor_parallel.mappings import copy_to_tp


def rotaries(cfg: ModelConfig) -> dict[str, Rotary] | None:
    """The RoPE of each layer type (None with learned positions): sliding layers take their own base, unscaled, when
    the config gives one (Gemma 3), else the global RoPE."""
    if cfg.position != "rope":
        return None
    full = Rotary(cfg.rotary_dim, cfg.rope_theta, cfg.rope_scaling, cfg.max_seq_len)
    local = full if cfg.rope_local_theta is None else Rotary(cfg.rotary_dim, cfg.rope_local_theta, None,
                                                             cfg.max_seq_len)
    return {"full_attention": full, "sliding_attention": local}


def _mean_over_valid(loss_sum: torch.Tensor, targets: torch.Tensor, cp_group) -> torch.Tensor:
    """A rank's summed loss over its valid targets as their mean (0 where it has none), then the token-weighted mean
    over the CP ranks."""
    count = (targets != -100).sum()
    return mean_from_cp(loss_sum / count.clamp(min=1), count, cp_group)


def _check_ids(ids, targets) -> None:
    """Token ids [B, S] of an integer dtype, and targets of their shape: a 1-d or float tensor fails deep inside."""
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.dtype not in (torch.int64, torch.int32):
        what = f"a {ids.dim()}-d {ids.dtype} tensor" if isinstance(ids, torch.Tensor) else type(ids).__name__
        raise TensorparError(f"token ids must be an int64 or int32 tensor [batch, seq] (one sequence: ids[None]), "
                             f"got {what}")
    if targets is not None and (not isinstance(targets, torch.Tensor) or targets.shape != ids.shape):
        shape = list(targets.shape) if isinstance(targets, torch.Tensor) else type(targets).__name__
        raise TensorparError(f"targets must be a tensor of the token ids' shape {list(ids.shape)}, got {shape}")


class Transformer(nn.Module):
    """A GPT-2 or Llama-style decoder: its architecture `cfg`, laid on the ranks as its `Placement` says
    (tensorpar.models.placement: the TP region, CP, EP, the pipeline stage, recomputation, the loss's chunks;
    None or a mesh: the default placement on it).

    `forward(ids)` returns this rank's vocabulary shard of the logits, [B, S, padded_vocab / tp];
    `forward(ids, targets)` the mean next-token cross-entropy over targets that are not -100.
    Weights are initialised from `seed` as full tensors and then sharded, so any TP size starts
    from the same dense model (``init=False`` leaves them uninitialised, for loading).

    A pipeline stage is the same class holding its stage's layers (global indices; parameter names keep
    them, so checkpoints and initialisation agree across layouts), the embedding when it holds the first
    stage, and the final norm and head when it holds the last; its forward then takes and/or
    returns hidden states. With tied embeddings the last stage holds a copy of the embedding
    (`ShardSpec.pipeline_duplicate`), kept equal to the first stage's by summing their gradients.

    Each layer asks the placement's `TPRegion` (`self.region`) how to enter and leave a TP region: SP, the
    collectives overlapped with the GEMMs, a zero-bubble schedule's `WeightGradQueue`, fp8 GEMMs (the embedding,
    head, norms, router and attention keep the parameters' dtype). With `loss_chunk_tokens` the training loss runs
    the head and the cross-entropy fused, that many tokens at a time, never holding the whole [B, S, V / tp]
    logits; `logits()` (eval, generation) is the same either way. Every block of a forward pass gets one
    `MicroBatchContext` (rotary tables, dropout seed, CP split, packed documents, ...).

    With the placement's `lora` the linears it targets carry LoRA adapters (`tensorpar.tensor_parallel.lora`), which
    are then the only parameters that require gradients: every other weight is frozen.
    """

    def __init__(self, cfg: ModelConfig, placement: Placement | None = None, *, seed: int = 0, init: bool = True):
        super().__init__()
        require_model_config(cfg)
        placement = as_placement(placement)
        self.cfg, self.placement, self.region = cfg, placement, placement.region
        # The groups by name, as a mesh has them: sharded initialisation and checkpoints ask the model for them.
        self.tp_group, self.cp_group = placement.region.group, placement.cp_group
        self.ep_group, self.expert_tp_group = placement.ep_group, placement.expert_tp_group
        self.sequence_parallel = self.region.sequence_parallel
        self.recompute, self.loss_chunk_tokens = placement.recompute, placement.loss_chunk_tokens
        self.first_stage, self.last_stage = placement.stage.first, placement.stage.last
        device = placement.device
        layers = range(cfg.num_layers) if placement.stage.layers is None else placement.stage.layers
        self.embed = self.pos_embed = self.final_norm = self.head = None
        self._build_inputs(device)
        # Keyed by global layer index, so that a stage's parameter names are the dense model's.
        self.layers = nn.ModuleDict({str(i): TransformerBlock(cfg, placement, i, device) for i in layers})
        self.decoder_keys = list(self.layers)
        self._build_outputs(device)
        self.rotaries = rotaries(cfg)
        if placement.lora is not None:
            for name, p in self.named_parameters():
                p.requires_grad_(is_adapter(name))
        if init:
            init_weights(self, seed)

    def _build_inputs(self, device) -> None:
        """The embedding (on the first stage, and its tied copy on the last) and the learned positions."""
        cfg, first, last = self.cfg, self.first_stage, self.last_stage
        shared = cfg.tie_embeddings or cfg.num_mtp_layers > 0  # the last stage uses the embedding too
        if first or (last and shared):
            self.embed = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, self.region, device=device,
                                                init=False, padding_idx=cfg.pad_token_id)
            if not first:  # the head's copy of the first stage's embedding
                retag(self.embed.weight, pipeline_duplicate=True)
            if not (first and last) and shared:
                retag(self.embed.weight, pipeline_tied=True)
        if first and cfg.position == "learned":
            self.pos_embed = tag(nn.Parameter(torch.empty(cfg.max_seq_len, cfg.hidden_size, device=device)),
                                 ShardSpec(dim=None, reduce_grad_across_tp=self.sequence_parallel))

    def _build_outputs(self, device) -> None:
        """The final norm and the LM head (the embedding's, tied) on the last stage, and the multi-token prediction
        modules (blocks num_layers.. of `layers`)."""
        self.mtp_keys, self.mtp_stats = [], None
        if not self.last_stage:
            return
        cfg = self.cfg
        self.final_norm = Norm(cfg.hidden_size, cfg.norm, cfg.norm_eps, self.region, device=device,
                               offset=cfg.norm_offset)
        if cfg.tie_embeddings:
            self.head = VocabParallelLMHead.tied(self.embed)
        else:
            self.head = VocabParallelLMHead(cfg.hidden_size, cfg.vocab_size, self.region, bias=False, device=device,
                                            init=False)
        for i in range(cfg.num_layers, cfg.num_blocks):
            self.layers[str(i)] = MultiTokenPrediction(cfg, self.placement, i, device)
            self.mtp_keys.append(str(i))
        if self.mtp_keys:
            self.mtp_stats = MTPStats(len(self.mtp_keys))

    # -- pieces -------------------------------------------------------------------------------

    def check_sequence(self, seq_len: int) -> None:
        """`seq_len`: the whole sequence (all CP ranks' positions), checked by the layout's rules."""
        tp, cp = self.tp_group.size, self.cp_group.size
        require(positions_problem(self.cfg, seq_len))
        require(context_split_problem(seq_len, cp))
        if self.sequence_parallel:
            require(sequence_parallel_problem(seq_len, tp, cp))

    def context(self, seq_len: int) -> ContextSplit | None:
        """How a sequence of `seq_len` positions lies across the CP ranks (None without context parallelism)."""
        return self.placement.context(seq_len)

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
        h = self.scaled_embedding(ids)
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

    def scaled_embedding(self, ids: torch.Tensor) -> torch.Tensor:
        """The embedding of `ids` times the config's `embedding_multiplier` (rounded to the embedding's dtype first,
        as Gemma's is)."""
        h = self.embed(ids)
        multiplier = self.cfg.embedding_multiplier
        return h if multiplier == 1.0 else h * torch.tensor(multiplier, dtype=h.dtype, device=h.device)

    def rope(self, seq_len: int, h: torch.Tensor, context: ContextSplit | None = None,
             documents: PackedDocuments | None = None):
        """cos/sin of this rank's positions (its CP chunks' under context parallelism; in their documents with
        `documents`), by layer type, in `h`'s dtype and on its device."""
        if self.rotaries is None:
            return None
        positions = self.positions(seq_len, context, h.device, documents)
        span = None  # the largest position + 1 of the whole sequence: for RoPE that depends on it only
        if any(r.depends_on_span for r in self.rotaries.values()):
            span = seq_len if documents is None else int(documents.position.max()) + 1
        return rope_tables(self.rotaries, positions, h.dtype, span)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Vocabulary-sharded logits of the full sequence: [B, S, padded_vocab / tp] (soft-capped, with a final
        soft cap, each rank its own columns)."""
        return soft_cap(self.head(h), self.cfg.final_logit_softcap)

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The mean next-token loss over the targets that are not -100 (under context parallelism, of every CP rank;
        a CP rank whose positions hold none, as a chat's prompt may, adds nothing)."""
        loss = vocab_parallel_cross_entropy(logits, targets, self.tp_group, vocab_size=self.cfg.vocab_size,
                                            reduction="sum")
        return _mean_over_valid(loss, targets, self.cp_group)

    def _head_loss_sum(self, h: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """This rank's summed loss of the head over `h`: fused per `loss_chunk_tokens` when the model was built with
        it (under the zero-bubble split backward the head keeps the unfused path: see its `loss`)."""
        if self.loss_chunk_tokens is None:
            return vocab_parallel_cross_entropy(self.logits(h), targets, self.tp_group,
                                                vocab_size=self.cfg.vocab_size, reduction="sum")
        return self.head.loss(h, targets, chunk_tokens=self.loss_chunk_tokens, reduction="sum",
                              softcap=self.cfg.final_logit_softcap)

    def head_loss(self, h: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """`loss(logits(h), targets)`, the head and the loss fused per chunk when the model was built so."""
        return _mean_over_valid(self._head_loss_sum(h, targets), targets, self.cp_group)

    def mtp_loss(self, h: torch.Tensor, ids: torch.Tensor, targets: torch.Tensor, ctx: MicroBatchContext,
                 context: ContextSplit | None) -> torch.Tensor:
        """The mean over the multi-token prediction modules of their losses (tensorpar.models.mtp), from the last
        layer's output `h` and the window's `ids` and `targets` (whole: every CP rank keeps its chunks); each depth's
        summed loss and target count go to `mtp_stats`."""
        losses = []
        for depth, key in enumerate(self.mtp_keys):
            ids_k, targets_k = shifted(ids, targets, depth + 1)
            if context is not None:
                ids_k, targets_k = context.local(ids_k), context.local(targets_k)
            module = self.layers[key]
            if self.recompute == "full":
                h = checkpoint(recomputable(module), h, self.embed(ids_k), ctx, use_reentrant=False)
            else:
                h = module(h, self.embed(ids_k), ctx)
            h = module.norm(h)
            loss_sum = self._head_loss_sum(h, targets_k)
            if self.tp_group.rank == 0:
                self.mtp_stats.add(depth, loss_sum, (targets_k != -100).sum())
            losses.append(_mean_over_valid(loss_sum, targets_k, self.cp_group))
        return torch.stack(losses).mean()

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
        return self.forward_layers(ids, self.decoder_keys, targets, dropout_seed, embed=self.first_stage,
                                   head=self.last_stage, aux_scale=aux_scale, documents=documents, inputs=ids)

    def moe_layers(self) -> dict[int, MoELayer]:
        """This rank's MoE layers by global layer index."""
        return {int(key): block.mlp for key, block in self.layers.items() if block.moe}

    def forward_layers(self, x, layer_keys, targets=None, dropout_seed=None, *, embed: bool, head: bool,
                       aux_scale: float = 1.0, documents: PackedDocuments | None = None,
                       inputs: torch.Tensor | None = None):
        """Run the layers `layer_keys` (one pipeline chunk), starting from token ids if `embed`, ending in
        the loss (or logits) if `head`; hidden states in and out otherwise. `documents`: as in `forward`. `inputs`:
        the window's token ids [B, S], which a training loss with multi-token prediction needs on the last stage."""
        if self.training and self.cfg.dropout > 0 and dropout_seed is None:
            raise TensorparError("dropout is on: pass dropout_seed to the forward pass (the trainer does)")
        if embed:
            _check_ids(x, targets)
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
        ctx = MicroBatchContext(self.rope(seq_len, h, context, documents), dropout_seed, context, documents,
                                aux_scale, recompute_core=self.recompute == "selective" and self.training)
        for key in layer_keys:
            layer = self.layers[str(key)]
            if self.recompute == "full" and self.training:
                h = checkpoint(recomputable(layer), h, ctx, use_reentrant=False)
            else:
                h = layer(h, ctx)
        if not head:
            return h
        out = self.final_norm(h)
        if targets is None:
            return self.logits(out)
        loss = self.head_loss(out, targets if context is None else context.local(targets))
        if self.mtp_keys and self.training and torch.is_grad_enabled():
            if inputs is None:
                raise TensorparError("multi-token prediction needs the window's token ids on the last stage: pass "
                                     "inputs= to forward_layers")
            loss = with_mtp_loss(loss, self.mtp_loss(h, inputs, targets, ctx, context), self.cfg.mtp_loss_weight)
        return loss

    def forward_cached(self, ids: torch.Tensor, cache, start_pos=None) -> torch.Tensor:
        """Inference with a KV cache (tensorpar.inference.KVCache): run the new tokens `ids` [B, s] whose first one
        sits at absolute position `start_pos` (an int, or a [B] tensor for left-padded rows; default: where the
        cache ends), append their keys and values, and return this rank's vocabulary shard of the logits of the
        LAST position: [B, padded_vocab / tp]. Whole model on one TP group: no sequence or pipeline parallelism."""
        start_pos = cache.start_positions() if start_pos is None else start_pos
        positions = (torch.as_tensor(start_pos, device=ids.device)[..., None]
                     + torch.arange(ids.shape[1], device=ids.device)).clamp(min=0)  # [s] or [B, s]; padding -> 0
        h = self.cached_hidden(ids, cache, positions)
        cache.advance(ids.shape[1])
        return self.logits(self.final_norm(h[:, -1]))

    def rope_switch_length(self) -> int | None:
        """The position from which longrope's long factors apply (its original length), for generation to compute the
        cache again there; None for the other RoPE types."""
        return None if self.rotaries is None else self.rotaries["full_attention"].switch_length

    def cached_hidden(self, ids: torch.Tensor, cache, positions: torch.Tensor) -> torch.Tensor:
        """The last layer's hidden states [B, s, H] (before the final norm) of the new tokens `ids` [B, s] at the
        absolute `positions` ([s] or [B, s]), their keys and values appended to `cache` (a `KVCache`, or any
        object with its `append` / `attend` methods, such as the server's paged cache)."""
        if self.sequence_parallel or self.cp_group.size > 1:
            raise LayoutError("generation with a KV cache runs without sequence or context parallelism: build the "
                              "model with sequence_parallel=False and cp = 1 (the weights are the same)")
        if not (self.first_stage and self.last_stage):
            raise LayoutError("generation with a KV cache needs the whole model on every rank (pipeline size 1)")
        h = self.scaled_embedding(ids)
        if self.pos_embed is not None:
            if int(positions.max()) >= self.cfg.max_seq_len:
                raise TensorparError(f"position {int(positions.max())} exceeds the model's "
                                     f"{self.cfg.max_seq_len} learned positions")
            h = h + self.pos_embed[positions]
        rope = None
        if self.rotaries is not None:
            # RoPE that depends on how far positions reach sees each sequence's own reach (the cache says which).
            span = cache.spans(positions) if any(r.depends_on_span for r in self.rotaries.values()) else None
            rope = rope_tables(self.rotaries, positions, h.dtype, span)
        ctx = MicroBatchContext(rope, kv_cache=cache)
        for layer in self.decoder_layers().values():
            h = layer(h, ctx)
        return h

    def decoder_layers(self) -> dict[str, TransformerBlock]:
        """This rank's decoder layers by key (the blocks of `layers` less the multi-token prediction modules)."""
        return {key: self.layers[key] for key in self.decoder_keys}

    def mask_padding(self, logits: torch.Tensor) -> torch.Tensor:
        """Set this rank's padding columns to -inf, so that they never win an argmax or a sample."""
        start = self.tp_group.rank * logits.shape[-1]
        valid = max(0, min(logits.shape[-1], self.cfg.vocab_size - start))
        if valid < logits.shape[-1]:
            logits = logits.clone()
            logits[..., valid:] = float("-inf")
        return logits
