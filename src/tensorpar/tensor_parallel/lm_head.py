"""The output head over a vocabulary split across TP ranks, for any vocabulary size.

A dense head ``logits = h W^T`` with W of shape [V, H] is column-parallel over the vocabulary.
V rarely divides by TP (GPT-2's 50257, Llama 2's 32000 + 1, Qwen's 151936 at TP 3), so the
vocabulary is padded to a multiple of TP with zero rows, exactly as tensorpar's Transformer and
Megatron-LM do: rank r holds rows [r * V_pad / tp, (r + 1) * V_pad / tp). Its logits feed
`vocab_parallel_cross_entropy(logits, targets, tp_group, vocab_size=head.vocab_size)`, which
never gathers them and leaves the padding columns out of the max, the sum and the gradient::

    head = VocabParallelLMHead.from_dense(nn.Linear(hidden, 50257, bias=False), tp_group)
    loss = vocab_parallel_cross_entropy(head(h), targets, tp_group, vocab_size=head.vocab_size)
"""

from __future__ import annotations

import torch
from torch import nn

from tensorpar.distributed.sharding import ShardSpec, padded, tag, take_shard
from tensorpar.tensor_parallel.chunked_loss import chunked_head_cross_entropy
from tensorpar.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from tensorpar.tensor_parallel.linear import ColumnParallelLinear, InitMethod, full_linear_params
from tensorpar.tensor_parallel.region import as_region


def soft_cap(logits: torch.Tensor, cap: float | None) -> torch.Tensor:
    """cap * tanh(logits / cap) (Gemma 2's final soft cap; `logits` unchanged for None): elementwise, so each rank caps
    its own vocabulary columns and nothing is gathered. Padding columns stay 0."""
    return logits if cap is None else torch.tanh(logits / cap) * cap


class VocabParallelLMHead(ColumnParallelLinear):
    """``logits = h W^T (+ b)`` with W's vocabulary rows split across the TP group, padded to a multiple of TP.

    Forward: the input enters the TP region through `region.enter` (`copy_to_tp`: identity / all-reduce in
    backward, or with sequence parallelism `gather_from_sp`: all-gather / reduce-scatter in backward); each rank
    computes its vocabulary slice of the logits, [..., padded_vocab_size / tp]; nothing else is communicated.
    The padding rows (and bias entries) are zero, so the padding logits are zero: pass
    ``vocab_size=head.vocab_size`` to the loss so that they never count.
    ``VocabParallelLMHead.from_dense(nn.Linear(hidden, vocab), mesh)`` takes this rank's padded shard of a dense
    head; `VocabParallelLMHead.tied(embedding)` is the head of a model whose embedding is tied to it.
    ``init=False`` leaves the shard uninitialised, for a caller that loads it.
    """

    def __init__(
        self,
        in_features: int,
        vocab_size: int,
        region=None,
        bias: bool = False,
        *,
        init_method: InitMethod | None = None,
        seed: int | None = None,
        device=None,
        dtype=None,
        init: bool = True,
    ):
        region = as_region(region).without_fp8()  # the head's GEMM stays in the compute dtype, as in the peers
        padded_vocab_size = padded(vocab_size, region.group.size)
        super().__init__(in_features, padded_vocab_size, region, bias, device=device, dtype=dtype, init=False)
        self.vocab_size, self.padded_vocab_size = vocab_size, padded_vocab_size
        self.out_features = vocab_size  # the dense layer's; the shards hold padded_vocab_size / tp rows
        spec = ShardSpec(dim=0, full_size=vocab_size, padded_size=self.padded_vocab_size)
        tag(self.weight, spec)
        if self.bias is not None:
            tag(self.bias, spec)
        if init:
            self._load_full(*full_linear_params(in_features, vocab_size, bias, init_method, seed))

    @staticmethod
    def tied(embedding) -> "TiedLMHead":
        """The head of a model whose output weights are its (vocabulary-parallel) embedding's: the same forward,
        on the embedding's weight, with no parameter of its own."""
        return TiedLMHead(embedding)

    def loss(self, h: torch.Tensor, targets: torch.Tensor, *, chunk_tokens: int, label_smoothing: float = 0.0,
             ignore_index: int = -100, reduction: str = "mean", softcap: float | None = None) -> torch.Tensor:
        """``vocab_parallel_cross_entropy(self(h), targets, ...)`` without the logits: `h` enters the region as in
        the forward (`region.entry`: identity / all-reduce, or SP all-gather / reduce-scatter), then the head
        and the loss run fused, `chunk_tokens` tokens at a time (`chunked_head_cross_entropy`: all-reduce max
        and all-reduce sum forward, per chunk in training, else once; nothing more in the backward). `softcap`: the logits soft-capped first,
        each rank its own columns (`soft_cap`)."""
        if self.region.weight_grads is not None:
            # The split backward defers the head's weight gradient to the queue; the fused backward computes it
            # with the input gradient, so the zero-bubble schedules keep the unfused head and loss.
            return vocab_parallel_cross_entropy(soft_cap(self(h), softcap), targets, self.tp_group,
                                                vocab_size=self.vocab_size,
                                                label_smoothing=label_smoothing, ignore_index=ignore_index,
                                                reduction=reduction)
        return chunked_head_cross_entropy(self.region.entry(h), self.weight, self.bias, targets, self.tp_group,
                                          vocab_size=self.vocab_size, chunk_tokens=chunk_tokens,
                                          ignore_index=ignore_index, label_smoothing=label_smoothing,
                                          reduction=reduction, softcap=softcap)

    @property
    def vocab_start(self) -> int:
        """The first vocabulary row of this rank's shard."""
        return self.tp_group.rank * self.out_per_rank

    def _load_full(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        """Set this rank's rows from the dense [vocab, in] weight (and [vocab] bias), padding rows zero."""
        if tuple(weight.shape) != (self.vocab_size, self.in_features):
            raise ValueError(f"VocabParallelLMHead: full weight has shape {tuple(weight.shape)}, "
                             f"expected {(self.vocab_size, self.in_features)}")
        tp, rank = self.tp_group.size, self.tp_group.rank
        with torch.no_grad():
            self.weight.copy_(take_shard(weight, 0, rank, tp, pad_to=self.padded_vocab_size))
            if self.bias is not None:
                if bias is None:
                    raise ValueError("VocabParallelLMHead has a bias but the dense layer has none")
                self.bias.copy_(take_shard(bias, 0, rank, tp, pad_to=self.padded_vocab_size))

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, vocab_size={self.vocab_size}, padded to {self.padded_vocab_size}, "
                f"tp={self.tp_group.size}, rows=[{self.vocab_start}, {self.vocab_start + self.out_per_rank}), "
                f"bias={self.bias is not None}, sequence_parallel={self.sequence_parallel}")


class TiedLMHead(VocabParallelLMHead):
    """`VocabParallelLMHead` whose weight is a `VocabParallelEmbedding`'s (tied embeddings). It registers no
    parameter: the model's parameters, checkpoints and optimizer see the embedding's weight once."""

    def __init__(self, embedding):
        nn.Module.__init__(self)
        object.__setattr__(self, "_embedding", embedding)  # not a submodule: its weight is the embedding's
        self.region, self.tp_group = embedding.region.without_fp8(), embedding.tp_group
        self.sequence_parallel = self.region.sequence_parallel
        self.in_features, self.vocab_size = embedding.embedding_dim, embedding.vocab_size
        self.padded_vocab_size, self.out_features = embedding.padded_vocab_size, embedding.vocab_size
        self.out_per_rank, self.gather_output, self.bias = embedding.rows_per_rank, False, None

    @property
    def weight(self) -> torch.Tensor:
        return self._embedding.weight
