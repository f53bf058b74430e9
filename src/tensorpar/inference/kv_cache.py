"""A key/value cache for tensor-parallel decoding, sharded by heads like the attention itself.

Each rank keeps only its own KV heads (`ParallelAttention.local_kv_heads`: its share of the KV
heads, or the one replicated KV head its query heads use when there are fewer KV heads than
ranks), so the cache costs 1/tp of the dense model's per rank and needs no communication.

Per layer, k and v are preallocated [B, local_kv_heads, max_len, head_dim] (an attention's `cache_layout`: latent
attention caches its compressed latent and rotary key instead, [B, 1, max_len, kv_lora_rank] and
[B, 1, max_len, qk_rope_head_dim], whole on every rank). Slots 0..length-1
are filled. A forward step appends its new keys and values in every layer at slots
length..length+s-1 (`append`, which returns views of everything so far) and then `advance(s)`.

Rows of a batch may be left-padded (`pad[b]` padding slots before row b's first token): padding
slots are never attended to, and a row's absolute position is its slot minus its padding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tensorpar.errors import TensorparError


class KVCache:
    def __init__(self, layer_keys, batch: int, local_kv_heads: int, max_len: int, head_dim: int, *,
                 dtype: torch.dtype = torch.float32, device=None, pad: torch.Tensor | None = None,
                 value_layout: tuple[int, int] | None = None):
        """`value_layout`: (heads, dim) of the values when they differ from the keys' (local_kv_heads, head_dim)."""
        value_heads, value_dim = value_layout or (local_kv_heads, head_dim)
        self.k = {str(key): torch.zeros((batch, local_kv_heads, max_len, head_dim), dtype=dtype, device=device)
                  for key in layer_keys}
        self.v = {str(key): torch.zeros((batch, value_heads, max_len, value_dim), dtype=dtype, device=device)
                  for key in layer_keys}
        self.batch, self.max_len = batch, max_len
        self.length = 0
        if pad is not None:
            pad = torch.as_tensor(pad, dtype=torch.long, device=device)
            if pad.shape != (batch,) or bool((pad < 0).any()):
                raise TensorparError(f"pad must hold one non-negative count per row ({batch}), got {pad.tolist()}")
            pad = pad if bool(pad.any()) else None
        self.pad = pad  # None: no row is padded

    @classmethod
    def for_model(cls, model, batch: int, max_len: int, *, dtype: torch.dtype | None = None, pad=None) -> "KVCache":
        """An empty cache for every layer of `model` (what its attention caches: this rank's KV heads), on the
        model's device."""
        (heads, dim), values = next(iter(model.decoder_layers().values())).attn.cache_layout()
        param = next(model.parameters())
        return cls(model.decoder_keys, batch, heads, max_len, dim, dtype=dtype or param.dtype, device=param.device,
                   pad=pad, value_layout=values)

    def append(self, layer_key, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v [B, heads, s, dim] at slots length..length+s-1 of this layer; return views
        of slots 0..length+s-1 (everything this step attends to). The length moves on only with `advance`."""
        key, end = str(layer_key), self.length + k.shape[2]
        if end > self.max_len:
            raise TensorparError(f"KV cache full: {end} positions needed, {self.max_len} allocated")
        self.k[key][:, :, self.length:end] = k
        self.v[key][:, :, self.length:end] = v
        return self.k[key][:, :, :end], self.v[key][:, :, :end]

    def advance(self, s: int) -> None:
        """Count the s positions every layer has just appended."""
        self.length += s

    def start_positions(self):
        """Absolute position of the next token: an int, or a [B] tensor when rows are left-padded."""
        return self.length if self.pad is None else self.length - self.pad

    def attention_mask(self, s: int) -> tuple[torch.Tensor | None, bool]:
        """(attn_mask, is_causal) for scaled_dot_product_attention of s new queries at slots length.. over
        all length+s cached keys: causal within the new block, everything before it, no padding slots."""
        if self.pad is None:
            if s == 1:
                return None, False  # one new token attends to everything
            if self.length == 0:
                return None, True  # prefill of an empty cache: plain causal attention
        device = next(iter(self.k.values())).device
        q_slot = torch.arange(self.length, self.length + s, device=device)[:, None]
        k_slot = torch.arange(self.length + s, device=device)[None, :]
        mask = k_slot <= q_slot  # [s, L]
        if self.pad is not None:
            # A padding query attends to itself only (its output is never used; this keeps its row finite).
            mask = (mask & (k_slot >= self.pad[:, None, None])) | (k_slot == q_slot)  # [B, s, L]
            mask = mask[:, None]  # [B, 1, s, L]: the same for every head
        return mask, False

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None) -> torch.Tensor:
        """softmax(q k^T * scale) v (default scale 1 / sqrt(d)) of the s new queries [B, heads, s, d] over the keys
        and values `append` returned (heads repeated for grouped-query attention, latents expanded), masked by
        `attention_mask(s)`."""
        mask, is_causal = self.attention_mask(q.shape[2])
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale)

    def memory_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.k.values(), *self.v.values()))
