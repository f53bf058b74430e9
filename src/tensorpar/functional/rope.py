"""Rotary position embeddings, in Hugging Face Llama's (rotate-half) convention, with Llama 3 and YaRN scaling; on
the whole head or its first dimensions (partial rotary), and DeepSeek's interleaved pairs."""

from __future__ import annotations

import math

import torch


def inverse_frequencies(head_dim: int, theta: float, scaling: dict | None = None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if not scaling or scaling.get("rope_type", scaling.get("type", "default")) == "default":
        return inv_freq
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "yarn":
        return yarn_inverse_frequencies(head_dim, theta, scaling)
    if kind != "llama3":
        raise NotImplementedError(f"RoPE scaling '{kind}' is not supported (supported: default, llama3, yarn)")
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


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature for a context `scale`: 0.1 mscale ln(scale) + 1 (1 when not scaled up)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_inverse_frequencies(dim: int, theta: float, scaling: dict) -> torch.Tensor:
    """YaRN (Peng et al. 2023): each frequency interpolated by `factor`, extrapolated, or blended between the two by
    a linear ramp over the dimensions whose wavelength falls between `beta_fast` and `beta_slow` rotations of the
    pre-training length `original_max_position_embeddings` (as transformers' `_compute_yarn_parameters`)."""
    factor, old_len = scaling["factor"], scaling["original_max_position_embeddings"]
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # a ramp of one step, not a division by zero
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    extrapolated, interpolated = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    return interpolated * ramp + extrapolated * (1 - ramp)


def rope_attention_factor(scaling: dict | None) -> float:
    """What YaRN multiplies cos and sin by (1 for the other kinds): `attention_factor` if given, else
    mscale(factor, mscale) / mscale(factor, mscale_all_dim) with both, else mscale(factor)."""
    if not scaling or scaling.get("rope_type", scaling.get("type")) != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor, mscale, mscale_all_dim = scaling["factor"], scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
    return yarn_mscale(factor)


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype, scale: float = 1.0):
    """cos and sin for integer `positions`: [S, head_dim] for positions [S] (shared by the batch), [B, 1, S, head_dim]
    for per-row positions [B, S] (packed documents, left-padded prompts); both broadcast over [B, heads, S, head_dim].
    `scale`: YaRN's attention factor, which multiplies both."""
    freqs = positions.float().unsqueeze(-1) * inv_freq.to(positions.device)
    emb = torch.cat([freqs, freqs], dim=-1)
    if positions.dim() == 2:
        emb = emb.unsqueeze(1)
    cos, sin = emb.cos(), emb.sin()
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    return cos.to(dtype), sin.to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate `x` [B, heads, S, head_dim] by the angles in cos/sin ([S, d] or [B, 1, S, d]); with d < head_dim
    (partial rotary), its first d dimensions, the rest passed through."""
    d = cos.shape[-1]
    if d < x.shape[-1]:
        return torch.cat([apply_rope(x[..., :d], cos, sin), x[..., d:]], dim=-1)
    return x * cos + _rotate_half(x) * sin


def apply_rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`apply_rope` for rotary dimensions laid out as interleaved pairs (x0, x1), (x2, x3), ... (DeepSeek's weights):
    each pair rotated by one angle, the result in rotate-half layout (first elements, then second ones), as
    transformers' `apply_rotary_pos_emb_interleave`. cos/sin: `rope_cos_sin`'s."""
    cos, sin = cos[..., : cos.shape[-1] // 2], sin[..., : sin.shape[-1] // 2]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def mscale_softmax_factor(scaling: dict | None) -> float:
    """What DeepSeek's attention multiplies its softmax scale by under scaled RoPE: mscale(factor, mscale_all_dim)^2
    when the scaling sets `mscale_all_dim` (transformers' `yarn_apply_mscale`), else 1."""
    if not scaling or scaling.get("rope_type", scaling.get("type", "default")) == "default":
        return 1.0
    mscale_all_dim = scaling.get("mscale_all_dim") or 0
    return yarn_mscale(scaling["factor"], mscale_all_dim) ** 2 if mscale_all_dim else 1.0
