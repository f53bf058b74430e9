"""Rotary position embeddings, in Hugging Face Llama's (rotate-half) convention, with Llama 3 scaling."""

from __future__ import annotations

import math

import torch


def inverse_frequencies(head_dim: int, theta: float, scaling: dict | None = None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if not scaling or scaling.get("rope_type", scaling.get("type", "default")) == "default":
        return inv_freq
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind != "llama3":
        raise NotImplementedError(f"RoPE scaling '{kind}' is not supported (supported: default, llama3)")
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype):
    """cos and sin for integer `positions`: [S, head_dim] for positions [S] (shared by the batch), [B, 1, S, head_dim]
    for per-row positions [B, S] (packed documents, left-padded prompts); both broadcast over [B, heads, S, head_dim]."""
    freqs = positions.float().unsqueeze(-1) * inv_freq.to(positions.device)
    emb = torch.cat([freqs, freqs], dim=-1)
    if positions.dim() == 2:
        emb = emb.unsqueeze(1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate `x` [B, heads, S, head_dim] by the angles in cos/sin ([S, head_dim] or [B, 1, S, head_dim])."""
    return x * cos + _rotate_half(x) * sin
