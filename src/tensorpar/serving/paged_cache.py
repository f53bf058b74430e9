"""The paged KV cache: one pool of fixed-size blocks per rank, sharded by heads, and the view one step runs through.

Each rank holds, per layer, keys and values for `num_blocks * block_size` token slots of its own KV heads
(`ParallelAttention.local_kv_heads`), [slots, local_kv_heads, head_dim]: 1/tp of the dense model's, and no
communication (as `tensorpar.inference.KVCache`). Which slots belong to which sequence is told by the block tables
(`tensorpar.serving.blocks`) that every step carries.

A step packs the new tokens of several sequences into one row [1, T]: a prefill chunk of one, one token of another
(decoding), and so on. The projections and MLPs run on the packed row; attention, through `PagedStep`, the duck-typed
cache `Transformer.cached_hidden` takes:

- `append(layer, k, v)` writes the new keys and values [1, kv_heads, T, d] to their slots and returns every key each
  sequence attends to, gathered from its blocks: [B, kv_heads, L, d], L the longest sequence's blocks x block_size;
- `attend(q, k, v)` pairs queries with keys sequence by sequence: all decoding sequences in one batched product (one
  query each, a mask hiding their unused slots), each prefill chunk on its own (causal from its first position).

So no query ever meets another sequence's keys, and the result does not depend on what else is in the step. A layer
with a sliding window keeps every block as the others do and masks the keys before its window (its attention, not
its memory, is that of the window).
"""

from __future__ import annotations

import dataclasses

import torch

from tensorpar.functional.attention_pattern import AttentionPattern
from tensorpar.serving.blocks import blocks_for


@dataclasses.dataclass(frozen=True)
class Segment:
    """One sequence's part of a step: `length` new tokens at positions start..start+length-1, its keys and values
    (those already cached and the new ones) in `blocks`; `reach`: the span its RoPE sees (see `PagedStep.spans`),
    None for the segment's end."""

    start: int
    length: int
    blocks: tuple[int, ...]
    reach: int | None = None


class PagedKVPool:
    """This rank's keys and values: per layer [num_blocks * block_size, local_kv_heads, head_dim] (an attention's
    `cache_layout`: latent attention pools its compressed latent and rotary key, one "head" each)."""

    def __init__(self, layer_keys, num_blocks: int, block_size: int, local_kv_heads: int, head_dim: int, *,
                 dtype: torch.dtype = torch.float32, device=None, value_layout: tuple[int, int] | None = None):
        slots = num_blocks * block_size
        value_heads, value_dim = value_layout or (local_kv_heads, head_dim)
        self.k = {str(key): torch.zeros((slots, local_kv_heads, head_dim), dtype=dtype, device=device)
                  for key in layer_keys}
        self.v = {str(key): torch.zeros((slots, value_heads, value_dim), dtype=dtype, device=device)
                  for key in layer_keys}
        self.num_blocks, self.block_size, self.device = num_blocks, block_size, device

    @classmethod
    def for_model(cls, model, num_blocks: int, block_size: int, *, dtype: torch.dtype | None = None) -> "PagedKVPool":
        """An empty pool for every layer of `model` (what its attention caches: this rank's KV heads), on the model's
        device."""
        (heads, dim), values = next(iter(model.decoder_layers().values())).attn.cache_layout()
        param = next(model.parameters())
        return cls(model.decoder_keys, num_blocks, block_size, heads, dim, dtype=dtype or param.dtype,
                   device=param.device, value_layout=values)

    @staticmethod
    def bytes_per_token(model, dtype: torch.dtype) -> int:
        """Bytes one token's keys and values take on this rank, over all layers."""
        (heads, dim), (value_heads, value_dim) = next(iter(model.decoder_layers().values())).attn.cache_layout()
        return len(model.decoder_keys) * (heads * dim + value_heads * value_dim) * torch.empty((), dtype=dtype).element_size()

    def memory_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.k.values(), *self.v.values()))

    def step(self, segments: list[Segment]) -> "PagedStep":
        return PagedStep(self, segments)


def _slots(blocks, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    table = torch.as_tensor(blocks, dtype=torch.long)
    return table[positions // block_size] * block_size + positions % block_size


class PagedStep:
    """The cache one step's forward runs through (see the module docstring)."""

    def __init__(self, pool: PagedKVPool, segments: list[Segment]):
        self.pool, self.segments = pool, segments
        bs, device = pool.block_size, pool.device
        self.ends = [s.start + s.length for s in segments]
        width = max(blocks_for(end, bs) for end in self.ends) * bs  # L: every sequence's keys padded to the longest
        positions, write, gather = [], [], []
        for seg, end in zip(segments, self.ends):
            new = torch.arange(seg.start, end)
            positions.append(new)
            write.append(_slots(seg.blocks, new, bs))
            held = torch.arange(blocks_for(end, bs) * bs)
            row = torch.zeros(width, dtype=torch.long)  # padding slots point at slot 0: masked out below
            row[: held.numel()] = _slots(seg.blocks, held, bs)
            gather.append(row)
        self.positions = torch.cat(positions)[None].to(device)  # [1, T]
        self.write_slots = torch.cat(write).to(device)
        self.gather_slots = torch.stack(gather).to(device)  # [B, L]
        offsets = [0]
        for seg in segments:
            offsets.append(offsets[-1] + seg.length)
        self.offsets = offsets
        self.decode = [i for i, seg in enumerate(segments) if seg.length == 1]
        self.prefill = [i for i, seg in enumerate(segments) if seg.length > 1]
        key_pos = torch.arange(width, device=device)
        ends = torch.tensor([self.ends[i] for i in self.decode], device=device)
        self.decode_mask = (key_pos[None, :] < ends[:, None])[:, None, None]  # [Bd, 1, 1, L]
        self.decode_key_pos, self.decode_ends = key_pos, ends
        self.decode_tokens = torch.tensor([offsets[i] for i in self.decode], dtype=torch.long, device=device)
        self.decode_rows = torch.tensor(self.decode, dtype=torch.long, device=device)
        self.all_decode = len(self.decode) == len(segments)

    def append(self, layer_key, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v [1, kv_heads, T, d] to their slots; every sequence's keys and values, [B, kv_heads, L, d]."""
        key = str(layer_key)
        out = []
        for store, new in ((self.pool.k[key], k), (self.pool.v[key], v)):
            store.index_copy_(0, self.write_slots, new[0].transpose(0, 1).to(store.dtype))
            out.append(store[self.gather_slots].permute(0, 2, 1, 3))
        return out[0], out[1]

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               pattern: AttentionPattern = AttentionPattern()) -> torch.Tensor:
        """softmax(scores) v of the packed queries [1, heads, T, d] over their own sequence's keys, the scores as
        `pattern` makes them (scale, soft cap, window): [1, heads, T, dv]."""
        out = q.new_empty(q.shape[:-1] + v.shape[-1:])
        if self.decode:
            qd = q[0].index_select(1, self.decode_tokens).transpose(0, 1)[:, :, None]  # [Bd, heads, 1, d]
            kd, vd = (k, v) if self.all_decode else (k[self.decode_rows], v[self.decode_rows])
            mask = self.decode_mask
            if pattern.window is not None:  # the query sits at end - 1: keys from end - window on
                start = self.decode_key_pos[None, :] >= (self.decode_ends - pattern.window)[:, None]
                mask = mask & start[:, None, None]
            od = pattern.attend(qd, kd.to(qd.dtype), vd.to(qd.dtype), mask)
            out[0].index_copy_(1, self.decode_tokens, od[:, :, 0].transpose(0, 1))
        for i in self.prefill:
            seg, a, b = self.segments[i], self.offsets[i], self.offsets[i + 1]
            end = self.ends[i]
            ki, vi = k[i:i + 1, :, :end].to(q.dtype), v[i:i + 1, :, :end].to(q.dtype)
            if seg.start == 0 and not pattern.windowed(end):
                out[:, :, a:b] = pattern.attend(q[:, :, a:b], ki, vi, is_causal=True)
            else:
                mask = pattern.visible(torch.arange(seg.start, end, device=q.device), torch.arange(end, device=q.device))
                out[:, :, a:b] = pattern.attend(q[:, :, a:b], ki, vi, mask)
        return out

    def spans(self, positions: torch.Tensor) -> torch.Tensor:
        """How far each packed token's sequence reaches, [1, T]: its segment's `reach` (the engine gives the
        sequence's length, every token it has: what transformers' forward pass of that step would reach, the whole
        prompt for each chunk of a chunked prefill), else the segment's end. RoPE that depends on it (dynamic NTK,
        longrope) sees each sequence's own."""
        reach = [end if seg.reach is None else seg.reach for seg, end in zip(self.segments, self.ends)]
        return torch.cat([torch.full((seg.length,), r) for seg, r in zip(self.segments, reach)])[None].to(
            positions.device)

    def advance(self, s: int) -> None:
        """Nothing to count: the scheduler keeps each sequence's length."""
