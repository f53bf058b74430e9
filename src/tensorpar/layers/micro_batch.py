"""What every block of one forward pass needs to know about the micro-batch it runs, as one value."""

from __future__ import annotations

import dataclasses

import torch

from tensorpar.context_parallel.ring_attention import ContextSplit
from tensorpar.functional.document_mask import PackedDocuments


@dataclasses.dataclass(frozen=True)
class MicroBatchContext:
    """- `rope`: cos/sin of this rank's positions by layer type ("full_attention", "sliding_attention"; None for
      learned positions);
    - `dropout_seed`: the micro-batch's dropout seed (masks are derived from it per layer, site and shard);
    - `cp`: how the sequence lies over the context-parallel ranks (None without CP);
    - `documents`: the packed documents of the whole window (attention within each), or None;
    - `aux_scale`: what the loss's backward is scaled by (MoE router losses join the backward scaled by it);
    - `recompute_core`: selective recomputation (attention's core recomputed in the backward);
    - `kv_cache`: inference: the new tokens' keys and values go there and attention spans the cache;
    - `record_stats`: False when full recomputation replays a forward (MoE statistics count once)."""

    rope: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = None
    dropout_seed: int | None = None
    cp: ContextSplit | None = None
    documents: PackedDocuments | None = None
    aux_scale: float = 1.0
    recompute_core: bool = False
    kv_cache: object = None
    record_stats: bool = True

    def replace(self, **changes) -> "MicroBatchContext":
        return dataclasses.replace(self, **changes)
