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

A layer with a sliding window of w (`AttentionPattern.window`) keeps only the keys and values of its last w - 1
slots between steps, as transformers' sliding-window cache does: a step's queries see those and the step's own,
and no later query needs any older. Its memory is that of w - 1 positions, however long the generation.
"""

from __future__ import annotations

import torch

from tensorpar.errors import TensorparError
from tensorpar.functional.attention_pattern import AttentionPattern


class KVCache:
    def __init__(self, layer_keys, batch: int, local_kv_heads: int, max_len: int, head_dim: int, *,
                 dtype: torch.dtype = torch.float32, device=None, pad: torch.Tensor | None = None,
                 windows: dict | None = None, value_layout: tuple[int, int] | None = None):
        """`windows`: layer key -> its sliding window (layers not named, or None: they keep every slot);
        `value_layout`: (heads, dim) of the values when they differ from the keys' (local_kv_heads, head_dim)."""
        self.windows = {str(key): w for key, w in (windows or {}).items() if w is not None}
        value_heads, value_dim = value_layout or (local_kv_heads, head_dim)

        def slots(key, heads, dim):
            return torch.zeros((batch, heads, 0 if str(key) in self.windows else max_len, dim), dtype=dtype,
                               device=device)

        self.k = {str(key): slots(key, local_kv_heads, head_dim) for key in layer_keys}
        self.v = {str(key): slots(key, value_heads, value_dim) for key in layer_keys}
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
        """An empty cache for every decoder layer of `model` (what its attention caches: this rank's KV heads), on
        the model's device."""
        layers = model.decoder_layers()
        (heads, dim), values = next(iter(layers.values())).attn.cache_layout()
        param = next(model.parameters())
        windows = {key: layer.attn.pattern.window for key, layer in layers.items()}
        return cls(list(layers), batch, heads, max_len, dim, dtype=dtype or param.dtype, device=param.device, pad=pad,
                   windows=windows, value_layout=values)

    def append(self, layer_key, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v [B, heads, s, dim] at slots length..length+s-1 of this layer; return views
        of every slot this step attends to: 0..length+s-1, or for a sliding layer the last w - 1 slots before
        the step and the step's. The length moves on only with `advance`."""
        key, end = str(layer_key), self.length + k.shape[2]
        if end > self.max_len:
            raise TensorparError(f"KV cache full: {end} positions needed, {self.max_len} allocated")
        if key in self.windows:
            keys, values = torch.cat([self.k[key], k], dim=2), torch.cat([self.v[key], v], dim=2)
            keep = min(self.windows[key] - 1, keys.shape[2])
            self.k[key] = keys[:, :, keys.shape[2] - keep:].clone()
            self.v[key] = values[:, :, values.shape[2] - keep:].clone()
            return keys, values
        self.k[key][:, :, self.length:end] = k
        self.v[key][:, :, self.length:end] = v
        return self.k[key][:, :, :end], self.v[key][:, :, :end]

    def advance(self, s: int) -> None:
        """Count the s positions every layer has just appended."""
        self.length += s

    def start_positions(self):
        """Absolute position of the next token: an int, or a [B] tensor when rows are left-padded."""
        return self.length if self.pad is None else self.length - self.pad

    @staticmethod
    def spans(positions: torch.Tensor):
        """How far each row's positions reach (the largest + 1): an int for positions shared by the rows ([s]), a
        [B, 1] tensor for per-row positions ([B, s]). RoPE that depends on it (dynamic NTK, longrope) reads it."""
        return int(positions.max()) + 1 if positions.dim() == 1 else positions.amax(-1, keepdim=True) + 1

    def attention_mask(self, s: int, keys: int | None = None,
                       window: int | None = None) -> tuple[torch.Tensor | None, bool]:
        """(attn_mask, is_causal) for attention of s new queries at slots length.. over the `keys` slots that end
        with theirs (default: all length + s): causal within the new block, everything before it within the
        `window`, no padding slots."""
        keys = self.length + s if keys is None else keys
        first = self.length + s - keys  # the slot of the first key
        windowed = window is not None and self.length + s - 1 - first >= window
        if self.pad is None and not windowed and first == 0:
            if s == 1:
                return None, False  # one new token attends to everything
            if self.length == 0:
                return None, True  # prefill of an empty cache: plain causal attention
        device = next(iter(self.k.values())).device
        q_slot = torch.arange(self.length, self.length + s, device=device)[:, None]
        k_slot = torch.arange(first, first + keys, device=device)[None, :]
        mask = AttentionPattern(window=window).visible(q_slot[:, 0], k_slot[0])  # [s, keys]
        if self.pad is not None:
            # A padding query attends to itself only (its output is never used; this keeps its row finite).
            mask = (mask & (k_slot >= self.pad[:, None, None])) | (k_slot == q_slot)  # [B, s, keys]
            mask = mask[:, None]  # [B, 1, s, keys]: the same for every head
        return mask, False

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               pattern: AttentionPattern = AttentionPattern()) -> torch.Tensor:
        """softmax(scores) v of the s new queries [B, heads, s, d] over the keys and values `append` returned
        (heads repeated for grouped-query attention), the scores as `pattern` makes them (scale, soft cap), masked by
        `attention_mask` (within its window)."""
        mask, is_causal = self.attention_mask(q.shape[2], k.shape[2], pattern.window)
        return pattern.attend(q, k, v, mask, is_causal)

    def memory_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.k.values(), *self.v.values()))
