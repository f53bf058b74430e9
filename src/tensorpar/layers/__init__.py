"""A model's building blocks, and the public tensor-parallel API.

The layers here compose the parallel dimensions: `ParallelAttention` (heads split over TP, the sequence over CP,
KV heads replicated when fewer than the TP ranks) and `Norm` (replicated weights, sequence-sharded under SP). The
tensor-parallel layers themselves live in `tensorpar.tensor_parallel` and are re-exported here:
column/row-parallel linear, vocab-parallel embedding, LM head and loss, and the `TPRegion` they share
(built by `tp_region`).
"""

from tensorpar.distributed.sharding import ShardSpec, shard_spec
from tensorpar.layers.attention import ParallelAttention
from tensorpar.layers.norms import Norm
from tensorpar.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from tensorpar.tensor_parallel.embedding import VocabParallelEmbedding
from tensorpar.tensor_parallel.linear import ColumnParallelLinear, RowParallelLinear
from tensorpar.tensor_parallel.lm_head import VocabParallelLMHead
from tensorpar.tensor_parallel.region import TPRegion, tp_region

__all__ = [
    "ColumnParallelLinear",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "VocabParallelLMHead",
    "TPRegion",
    "tp_region",
    "vocab_parallel_cross_entropy",
    "ShardSpec",
    "shard_spec",
    "ParallelAttention",
    "Norm",
]
