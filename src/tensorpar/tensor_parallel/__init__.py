"""Tensor parallelism (Megatron-LM): each weight matrix split over the TP group, and sequence parallelism.

- `mappings`: the collectives TP owns, as autograd conjugates (f / g: copy_to_tp, reduce_from_tp; SP's
  gather_from_sp, reduce_scatter_to_sp; ...);
- `region`: `TPRegion` (built by `tp_region`), how a run's layers enter and leave a TP region: its edges'
  communication (`region_edges`: plain or overlapped (`tp_overlap`), with or without SP) composed with how its
  GEMMs run (`region_gemms`: dense, fp8 or with a split backward);
- `linear` (ColumnParallelLinear, RowParallelLinear), `mlp` (ParallelMLP), `embedding` (VocabParallelEmbedding,
  with `lookup`), `lm_head` (VocabParallelLMHead), `cross_entropy` (the vocab-parallel loss) and `chunked_loss`
  (the head and the loss fused per chunk of tokens: `VocabParallelLMHead.loss`).
"""

from tensorpar.tensor_parallel.chunked_loss import chunked_head_cross_entropy
from tensorpar.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from tensorpar.tensor_parallel.embedding import VocabParallelEmbedding
from tensorpar.tensor_parallel.linear import ColumnParallelLinear, RowParallelLinear
from tensorpar.tensor_parallel.lm_head import TiedLMHead, VocabParallelLMHead
from tensorpar.tensor_parallel.mlp import ParallelMLP
from tensorpar.tensor_parallel.region import TPRegion, tp_region

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "ParallelMLP", "VocabParallelEmbedding", "VocabParallelLMHead",
           "TiedLMHead", "TPRegion", "tp_region", "vocab_parallel_cross_entropy",
           "chunked_head_cross_entropy"]
