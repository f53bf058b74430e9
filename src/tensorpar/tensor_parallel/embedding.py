"""Vocabulary-parallel embedding (Megatron-LM), or a replicated one (the book chapter's whole table per rank)."""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from tensorpar.distributed.comm import Group
from tensorpar.distributed.sharding import ShardSpec, make_generator, padded, tag, take_shard
from tensorpar.errors import TensorparError
from tensorpar.tensor_parallel.mappings import scatter_to_sp
from tensorpar.tensor_parallel.region import TPRegion, as_region


def default_embedding_init(weight: torch.Tensor, generator: torch.Generator) -> None:
    """nn.Embedding's own initialisation: N(0, 1)."""
    nn.init.normal_(weight, generator=generator)


class VocabParallelEmbedding(nn.Module):
    """An embedding table whose rows (the vocabulary) are split across the TP group.

    The vocabulary is padded to a multiple of the TP size; rank r holds rows
    [r*V_pad/tp, (r+1)*V_pad/tp). Padding rows are zero and never looked up.

    Forward: ids outside this rank's rows are masked and their vectors zeroed, then the partial
    embeddings are summed over the TP group of `region` (a `TPRegion`, or a mesh / group: plain
    collectives) by `reduce_from_tp` (all-reduce / identity in backward) or, with sequence
    parallelism, by `reduce_scatter_to_sp` (reduce-scatter / all-gather in backward), which leaves
    each rank its sequence shard.

    With ``replicated=True`` every rank holds the whole table and looks up locally (no
    communication); under sequence parallelism the output is then split by `scatter_to_sp`
    (split / all-gather in backward, so each rank's weight gradient covers the whole sequence).

    ``padding_idx`` (nn.Embedding's): the row its lookups return without training it; the rank that holds it
    gives those positions a detached copy of the row.
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        region=None,
        *,
        replicated: bool = False,
        init_method: Callable[[torch.Tensor, torch.Generator], None] | None = None,
        seed: int | None = None,
        device=None,
        dtype=None,
        init: bool = True,
        padding_idx: int | None = None,
    ):
        super().__init__()
        self.padding_idx = padding_idx
        self.region: TPRegion = as_region(region)
        self.tp_group: Group = self.region.group
        self.sequence_parallel = self.region.sequence_parallel
        tp, rank = self.tp_group.size, self.tp_group.rank
        self.num_embeddings = self.vocab_size = num_embeddings
        self.embedding_dim = embedding_dim
        self.replicated = replicated
        if replicated:
            self.padded_vocab_size = num_embeddings
            self.vocab_start, self.rows_per_rank = 0, num_embeddings
        else:
            self.padded_vocab_size = padded(num_embeddings, tp)
            self.rows_per_rank = self.padded_vocab_size // tp
            self.vocab_start = rank * self.rows_per_rank
        # Real (unpadded) rows on this rank: [vocab_start, vocab_end).
        self.vocab_end = min(self.vocab_start + self.rows_per_rank, num_embeddings)
        spec = (
            ShardSpec(dim=None)
            if replicated
            else ShardSpec(dim=0, full_size=num_embeddings, padded_size=self.padded_vocab_size)
        )
        self.weight = tag(nn.Parameter(torch.empty(self.rows_per_rank, embedding_dim, device=device, dtype=dtype)), spec)
        if init:
            full = torch.empty(num_embeddings, embedding_dim)
            (init_method or default_embedding_init)(full, make_generator(seed))
            self._load_full(full)

    def _load_full(self, weight: torch.Tensor) -> None:
        """Set this rank's rows from the full [vocab, dim] table (padding rows become zero)."""
        if tuple(weight.shape) != (self.num_embeddings, self.embedding_dim):
            raise ValueError(
                f"VocabParallelEmbedding: full weight has shape {tuple(weight.shape)}, "
                f"expected {(self.num_embeddings, self.embedding_dim)}"
            )
        with torch.no_grad():
            if self.replicated:
                self.weight.copy_(weight)
            else:
                self.weight.copy_(
                    take_shard(weight, 0, self.tp_group.rank, self.tp_group.size, pad_to=self.padded_vocab_size)
                )

    @classmethod
    def from_dense(cls, module: nn.Embedding, region=None, **kwargs):
        """This rank's rows of an unsharded nn.Embedding (copied, not shared)."""
        if not isinstance(module, nn.Embedding):
            raise TensorparError(f"{cls.__name__}.from_dense takes a torch nn.Embedding, got "
                                 f"{type(module).__name__}")
        kwargs.setdefault("device", module.weight.device)
        kwargs.setdefault("dtype", module.weight.dtype)
        layer = cls(module.num_embeddings, module.embedding_dim, region, init=False, **kwargs)
        layer._load_full(module.weight.detach())
        return layer

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.replicated or self.tp_group.size == 1:
            out = self._untrained_padding(ids, self.region.lookup(ids, self.weight))
            return scatter_to_sp(out, self.tp_group) if self.sequence_parallel else out
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local_ids = (ids - self.vocab_start).masked_fill(outside, 0)
        out = self.region.lookup(local_ids, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return self.region.reduce(self._untrained_padding(ids, out))

    def _untrained_padding(self, ids: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """`out` with the positions of `padding_idx` (if this rank holds its row) looking it up without a gradient."""
        pad = self.padding_idx
        if pad is None or not self.vocab_start <= pad < self.vocab_end or not (
                torch.is_grad_enabled() and self.weight.requires_grad):
            return out
        row = self.weight[pad - self.vocab_start].detach().to(out.dtype)
        return torch.where((ids == pad).unsqueeze(-1), row, out)

    def extra_repr(self) -> str:
        return (
            f"{self.num_embeddings}, {self.embedding_dim}, tp={self.tp_group.size}, "
            f"rows=[{self.vocab_start}, {self.vocab_end}) of padded {self.padded_vocab_size}, "
            f"replicated={self.replicated}, sequence_parallel={self.sequence_parallel}, padding_idx={self.padding_idx}"
        )
