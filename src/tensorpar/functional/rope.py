"""Rotary position embeddings, in Hugging Face Llama's (rotate-half) convention, with the scaling types of
transformers' modeling_rope_utils: linear, dynamic (NTK), yarn, longrope and llama3, each computed as transformers
computes it.

`Rotary` is the RoPE of one kind of layer (Gemma 3's sliding layers have a base of their own): the frequencies of
its rotated dimensions (the first `partial_rotary_factor` of each head) and the factor cos and sin are scaled by
(yarn's and longrope's attention factor). Two types depend on how far the positions of a forward pass reach (its
`span`: the largest position + 1), as transformers' `dynamic_rope_update` makes them: dynamic NTK raises the base
beyond the model's max_position_embeddings, longrope switches from its short to its long factors beyond the
original pre-training length.
"""

from __future__ import annotations

import dataclasses
import math

import torch

ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "longrope", "llama3")
# The parameters each scaling type reads (beside rope_type); those marked required must be given.
_PARAMETERS = {
    "default": ((), ()),
    "linear": (("factor",), ()),
    "dynamic": (("factor",), ()),
    "yarn": (("factor", "original_max_position_embeddings"),
             ("attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "truncate")),
    "longrope": (("short_factor", "long_factor", "original_max_position_embeddings"), ("factor", "attention_factor")),
    "llama3": (("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"), ()),
}


def rope_type(scaling: dict | None) -> str:
    """The scaling type of a `rope_scaling` dict ("default" for None)."""
    return (scaling or {}).get("rope_type", (scaling or {}).get("type")) or "default"


def scaling_problems(scaling: dict | None, rotary_dim: int) -> list[str]:
    """Why `scaling` (a `ModelConfig.rope_scaling`) cannot be computed, as 'rope_scaling...' phrases ([] if it can)."""
    if scaling is None:
        return []
    if not isinstance(scaling, dict):
        return [f"rope_scaling must be a dict or None, got {scaling!r}"]
    kind = rope_type(scaling)
    if kind not in ROPE_TYPES:
        return [f"rope_scaling type {kind!r} is not supported (supported: {', '.join(ROPE_TYPES)})"]
    required, optional = _PARAMETERS[kind]
    problems = [f"rope_scaling type {kind!r} needs {name!r}" for name in required if scaling.get(name) is None]
    unknown = sorted(set(scaling) - set(required) - set(optional) - {"rope_type", "type"})
    if unknown:
        problems.append(f"rope_scaling type {kind!r} does not take {', '.join(map(repr, unknown))}")
    if kind == "longrope":
        for name in ("short_factor", "long_factor"):
            if len(scaling.get(name) or ()) != rotary_dim // 2:
                problems.append(f"rope_scaling {name} must hold {rotary_dim // 2} numbers (half the rotary "
                                f"dimension), got {len(scaling.get(name) or ())}")
    if kind == "llama3" and not problems and scaling["high_freq_factor"] <= scaling["low_freq_factor"]:
        problems.append("rope_scaling high_freq_factor must exceed low_freq_factor")
    return problems


def _default(dim: int, theta: float) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def _yarn(dim: int, theta: float, s: dict, max_positions: int) -> tuple[torch.Tensor, float]:
    factor, original = s.get("factor"), s["original_max_position_embeddings"]
    factor = max_positions / original if factor is None else factor

    def mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = s.get("attention_factor")
    if attention is None:
        attention = (float(mscale(factor, s["mscale"]) / mscale(factor, s["mscale_all_dim"]))
                     if s.get("mscale") and s.get("mscale_all_dim") else mscale(factor))
    beta_fast, beta_slow = s.get("beta_fast") or 32, s.get("beta_slow") or 1

    def correction_dim(rotations):
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / ((high + 0.001 if low == high else high)
                                                                              - low), 0, 1)
    keep = 1 - ramp
    return interpolation * (1 - keep) + extrapolation * keep, attention


def _longrope(dim: int, theta: float, s: dict, max_positions: int, span: int | None) -> tuple[torch.Tensor, float]:
    original = s["original_max_position_embeddings"]
    factor = s.get("factor") or max_positions / original
    attention = s.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    ext = torch.tensor(s["long_factor"] if span is not None and span > original else s["short_factor"],
                       dtype=torch.float32)
    return 1.0 / (ext * theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)), attention


def _llama3(dim: int, theta: float, s: dict) -> torch.Tensor:
    inv_freq = _default(dim, theta)
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def frequencies(dim: int, theta: float, scaling: dict | None = None, max_positions: int = 0,
                span: int | None = None) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [dim / 2], attention factor) of RoPE over `dim` rotated dimensions, as transformers'
    `ROPE_INIT_FUNCTIONS` compute them; `span`: the largest position + 1 of the forward pass (dynamic, longrope)."""
    kind = rope_type(scaling)
    if kind == "default":
        return _default(dim, theta), 1.0
    if kind == "linear":
        return _default(dim, theta) / scaling["factor"], 1.0
    if kind == "dynamic":
        factor, length = scaling["factor"], max(span or 0, max_positions)
        base = theta * ((factor * length / max_positions) - (factor - 1)) ** (dim / (dim - 2))
        return _default(dim, base), 1.0
    if kind == "yarn":
        return _yarn(dim, theta, scaling, max_positions)
    if kind == "longrope":
        return _longrope(dim, theta, scaling, max_positions, span)
    if kind == "llama3":
        return _llama3(dim, theta, scaling), 1.0
    raise NotImplementedError(f"RoPE scaling '{kind}' is not supported (supported: {', '.join(ROPE_TYPES)})")


@dataclasses.dataclass(frozen=True)
class Rotary:
    """RoPE of one kind of layer: base `theta`, `scaling` (a `ModelConfig.rope_scaling`), the model's
    `max_positions` (dynamic NTK and longrope read it), on the first `dim` dimensions of each head."""

    dim: int
    theta: float
    scaling: dict | None = None
    max_positions: int = 0
    _memo: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)

    @property
    def depends_on_span(self) -> bool:
        return rope_type(self.scaling) in ("dynamic", "longrope")

    @property
    def switch_length(self) -> int | None:
        """longrope's original length, beyond which its long factors apply (None for the other types)."""
        return self.scaling["original_max_position_embeddings"] if rope_type(self.scaling) == "longrope" else None

    def tables(self, positions: torch.Tensor, dtype: torch.dtype, span=None):
        """cos and sin of integer `positions` (see `rope_cos_sin`) for a forward pass whose positions reach `span`
        (the largest + 1; only the span-dependent types read it): an int, or a tensor of the positions' shape giving
        each position the span of its own sequence (generation: each row's; a server step: each sequence's)."""
        if self.depends_on_span and torch.is_tensor(span):
            spans = span.expand_as(positions)
            values = spans.unique()
            table = [frequencies(self.dim, self.theta, self.scaling, self.max_positions, int(v)) for v in values]
            index = torch.searchsorted(values, spans.contiguous())
            inv_freq = torch.stack([t[0] for t in table]).to(positions.device)[index]
            return rope_cos_sin(positions, inv_freq, dtype, table[0][1])  # the attention factor is the config's
        if self.depends_on_span:  # recomputed per forward pass: a step of generation moves the span
            inv_freq, attention = frequencies(self.dim, self.theta, self.scaling, self.max_positions, span)
        else:
            key = str(positions.device)
            if key not in self._memo:
                inv_freq, attention = frequencies(self.dim, self.theta, self.scaling, self.max_positions)
                self._memo[key] = (inv_freq.to(positions.device), attention)
            inv_freq, attention = self._memo[key]
        return rope_cos_sin(positions, inv_freq, dtype, attention)


def rope_tables(rotaries: dict[str, Rotary], positions: torch.Tensor, dtype: torch.dtype,
                span=None) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """cos and sin of `positions` for each layer type of `rotaries` (computed once per distinct `Rotary`)."""
    made: dict[int, tuple] = {}
    for rotary in rotaries.values():
        if id(rotary) not in made:
            made[id(rotary)] = rotary.tables(positions, dtype, span)
    return {kind: made[id(rotary)] for kind, rotary in rotaries.items()}


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype, scale: float = 1.0):
    """cos and sin (times `scale`, the attention factor of yarn and longrope) for integer `positions`: [S, dim] for
    positions [S] (shared by the batch), [B, 1, S, dim] for per-row positions [B, S] (packed documents, left-padded
    prompts); both broadcast over [B, heads, S, dim]. `inv_freq`: [dim / 2], or one set per position
    (positions.shape + [dim / 2])."""
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
    """Rotate `x` [B, heads, S, head_dim] by the angles in cos/sin ([S, dim] or [B, 1, S, dim]): its first `dim`
    dimensions (all of them, unless the RoPE is partial); the rest pass through."""
    dim = cos.shape[-1]
    if dim == x.shape[-1]:
        return x * cos + _rotate_half(x) * sin
    rotated, passed = x[..., :dim], x[..., dim:]
    return torch.cat([rotated * cos + _rotate_half(rotated) * sin, passed], dim=-1)


def apply_rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`apply_rope` for rotary dimensions laid out as interleaved pairs (x0, x1), (x2, x3), ... (DeepSeek's weights):
    each pair rotated by one angle, the result in rotate-half layout (first elements, then second ones), as
    transformers' `apply_rotary_pos_emb_interleave`. cos/sin: `rope_cos_sin`'s."""
    cos, sin = cos[..., : cos.shape[-1] // 2], sin[..., : sin.shape[-1] // 2]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def mscale_softmax_factor(scaling: dict | None) -> float:
    """What DeepSeek's attention multiplies its softmax scale by under scaled RoPE: mscale(factor, mscale_all_dim)^2,
    mscale(s, m) = 0.1 m ln(s) + 1, when the scaling sets `mscale_all_dim` (transformers' `yarn_apply_mscale`),
    else 1."""
    mscale_all_dim = (scaling or {}).get("mscale_all_dim") or 0
    if rope_type(scaling) == "default" or not mscale_all_dim or scaling["factor"] <= 1:
        return 1.0
    return (0.1 * mscale_all_dim * math.log(scaling["factor"]) + 1.0) ** 2
