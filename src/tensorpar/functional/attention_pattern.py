"""How one attention layer turns queries and keys into weights: the score scale, an optional soft cap of the
scores (Gemma 2: cap * tanh(scores / cap)) and an optional sliding window (Mistral, Gemma, Qwen2's upper layers).

A query at position q sees the key at position k when k <= q and, with a window of w, q - k < w: its own position
and the w - 1 before it (transformers' `sliding_window_overlay`). `attend` runs torch's SDPA when it can (no soft
cap) and the same arithmetic written out otherwise (SDPA has no soft cap); the context-parallel ring computes its
blocks with `scores` and `visible` itself.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F


@dataclasses.dataclass(frozen=True)
class AttentionPattern:
    """`scale`: the scores' factor (None: 1 / sqrt(head_dim)); `softcap`: scores -> softcap * tanh(scores / softcap)
    (None: none); `window`: how many positions a query sees, its own included (None: all earlier ones)."""

    scale: float | None = None
    softcap: float | None = None
    window: int | None = None

    def scale_for(self, head_dim: int) -> float:
        return 1.0 / math.sqrt(head_dim) if self.scale is None else self.scale

    def windowed(self, span: int) -> bool:
        """Whether the window hides anything from a query among `span` positions."""
        return self.window is not None and self.window < span

    def visible(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
        """[Q, K] bool (or broadcast over leading dimensions): True where the query at `q_pos[i]` may attend the key
        at `k_pos[j]` (causal, within the window)."""
        q, k = q_pos.unsqueeze(-1), k_pos.unsqueeze(-2)
        seen = k <= q
        return seen if self.window is None else seen & (q - k < self.window)

    def causal_mask(self, length: int, device=None) -> torch.Tensor:
        """`visible` of `length` positions over themselves, [S, S]."""
        positions = torch.arange(length, device=device)
        return self.visible(positions, positions)

    def scores(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """q k^T times the scale, soft-capped."""
        return self.cap(torch.matmul(q, k.transpose(-1, -2)) * self.scale_for(q.shape[-1]))

    def cap(self, scores: torch.Tensor) -> torch.Tensor:
        """The soft cap of scaled scores: softcap * tanh(scores / softcap) (unchanged without one)."""
        return scores if self.softcap is None else torch.tanh(scores / self.softcap) * self.softcap

    def block_visible(self, q_start: int, k_start: int, q_len: int, k_len: int, device=None) -> torch.Tensor | None:
        """`visible` of the queries at q_start.. over the keys at k_start.. (None: every pair is visible)."""
        if k_start + k_len - 1 <= q_start and (self.window is None or q_start + q_len - 1 - k_start < self.window):
            return None
        return self.visible(torch.arange(q_start, q_start + q_len, device=device),
                            torch.arange(k_start, k_start + k_len, device=device))

    def block_seen(self, q_start: int, k_start: int, q_len: int, k_len: int) -> bool:
        """Whether any query at q_start.. sees any key at k_start.. (causally, within the window)."""
        if k_start > q_start + q_len - 1:
            return False
        return self.window is None or q_start - (k_start + k_len - 1) < self.window

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None,
               is_causal: bool = False, dropout_p: float = 0.0) -> torch.Tensor:
        """softmax(scores + mask) v for q [B, H, Q, D], k and v [B, H, K, D] (heads already repeated); `mask` bool,
        True where attended, or `is_causal` (queries at the last Q of the K positions)."""
        if self.softcap is None:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=is_causal,
                                                  scale=self.scale)
        s = self.scores(q, k)
        if is_causal:
            mask = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril(k.shape[2] - q.shape[2])
        if mask is not None:
            s = s.masked_fill(~mask, float("-inf"))
        p = torch.softmax(s.float(), dim=-1).to(q.dtype)
        if dropout_p > 0:
            p = F.dropout(p, dropout_p)
        return torch.matmul(p, v)
