"""Tensor-parallel building blocks: column/row-parallel linear, vocab-parallel embedding, LM head and loss."""

from tensorpar.layers.cross_entropy import vocab_parallel_cross_entropy
from tensorpar.layers.embedding import VocabParallelEmbedding
from tensorpar.layers.linear import ColumnParallelLinear, RowParallelLinear
from tensorpar.layers.lm_head import VocabParallelLMHead
from tensorpar.layers.region import TPRegion
from tensorpar.layers.sharding import ShardSpec, shard_spec

__all__ = [
    "ColumnParallelLinear",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "VocabParallelLMHead",
    "TPRegion",
    "vocab_parallel_cross_entropy",
    "ShardSpec",
    "shard_spec",
]
