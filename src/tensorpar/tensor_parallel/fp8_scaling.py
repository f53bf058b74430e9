"""FP8 numerics: dynamic power-of-two scales, quantisation, and the scaled GEMM.

A tensor t is held in fp8 as ``q = fp8(t * s)`` with ``s = 2^floor(log2(fmax / amax))``, fmax the format's
largest finite value (e4m3: 448, e5m2: 57344) and amax the current max |t| (dynamic scaling, as torchao and
torchtitan run it: no history of past amaxes). The scale is a power of two so that scaling is exact: ``q / s``
is exactly representable in bf16 and fp32, dequantising and quantising again with the same scale gives the
same q, and a scale taken from the amax of the whole tensor is the same whichever rank computes it.

`Fp8Recipe` says how a run's GEMMs are scaled (``--fp8-recipe``):

- ``tensorwise``: one scale per tensor. Forward x W^T with x and W in e4m3; backward, the output gradient in
  e5m2 for both the input gradient (g W) and the weight gradient (g^T x).
- ``rowwise``: one scale per row: per token of x and per output feature of W in the forward (e4m3); the input
  gradient g W with g scaled per token and W per input feature (e4m3). The weight gradient g^T x runs in the
  compute dtype (torchao's ``rowwise_with_gw_hp``): it sums over the tokens, and rowwise scales for it would
  run along the tokens, one scale for all of a feature's tokens, so that one outlier token sets the precision
  of every other token's contribution: the problem rowwise scaling exists to avoid.

`scaled_mm` runs ``torch._scaled_mm`` on a GPU where the shapes allow it and otherwise computes the same
product of the same fp8 values in fp32 (a GPU's _scaled_mm needs dimensions that are multiples of 16 and a
bf16 output for rowwise scales; a CPU has no fp8 units): the quantised values, and so the result up to summation
order, are the same.
"""

from __future__ import annotations

import dataclasses

import torch

from tensorpar.config.choices import FP8_RECIPES
from tensorpar.errors import TensorparError

E4M3 = getattr(torch, "float8_e4m3fn", None)
E5M2 = getattr(torch, "float8_e5m2", None)
FP8_MAX = {E4M3: 448.0, E5M2: 57344.0}
_MIN_AMAX = 1e-30  # an all-zero tensor gets a large finite scale, not inf * 0


def fp8_unsupported(device: torch.device | str) -> str | None:
    """Why fp8 GEMMs cannot run on `device` (None when they can): a torch without float8 dtypes or
    ``_scaled_mm``, or a GPU below compute capability 8.9 (Ada, Hopper and later have fp8 tensor cores)."""
    if E4M3 is None or E5M2 is None or not hasattr(torch, "_scaled_mm"):
        return f"torch {torch.__version__} has no float8 dtypes or torch._scaled_mm (fp8 needs torch >= 2.4)"
    device = torch.device(device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            return "CUDA is not available"
        major, minor = torch.cuda.get_device_capability(device)
        if (major, minor) < (8, 9):
            return (f"{torch.cuda.get_device_name(device)} has compute capability {major}.{minor}; fp8 GEMMs need "
                    f"8.9 or later (Ada, Hopper, Blackwell)")
    return None


def check_fp8(dtype: str, device: str | None) -> None:
    """Refuse ``--dtype fp8`` on a device (None: this machine's GPU if any, else the CPU) that cannot run it."""
    if dtype != "fp8":
        return
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    why = fp8_unsupported(device)
    if why:
        raise TensorparError(f"--dtype fp8 cannot run on {device}: {why}; use --dtype bf16")


def amax(t: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """max |t| in fp32: of the whole tensor (dim None: a scalar), or along `dim`, kept with size 1."""
    t = t.detach()
    if dim is None:
        return t.abs().amax().float() if t.numel() else t.new_zeros((), dtype=torch.float32)
    return t.abs().amax(dim=dim, keepdim=True).float()


def pow2_scale(amax_: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The power-of-two scale that maps `amax_` into the range of `dtype` (e4m3 / e5m2)."""
    return torch.exp2(torch.floor(torch.log2(FP8_MAX[dtype] / amax_.clamp(min=_MIN_AMAX))))


def quantize(t: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp8(t * scale), saturated at the format's largest value."""
    fmax = FP8_MAX[dtype]
    return (t.float() * scale).clamp(-fmax, fmax).to(dtype)


def _native(a: torch.Tensor, b: torch.Tensor, rowwise: bool, out_dtype: torch.dtype) -> bool:
    """Whether torch._scaled_mm runs this product: on CUDA within cuBLASLt's constraints. On a CPU (no fp8 matrix
    units) the same fp8 values are multiplied in fp32: torch's CPU _scaled_mm takes 175 ms for an e4m3 x e4m3
    [128, 128] x [128, 352] product on an AVX-512 Xeon, 500 times the fp32 product's 0.35 ms."""
    if a.device.type != "cuda" or a.shape[1] % 16 or b.shape[0] % 16:
        return False
    return not rowwise or (out_dtype == torch.bfloat16 and a.dtype == b.dtype == E4M3)


def scaled_mm(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor,
              out_dtype: torch.dtype) -> torch.Tensor:
    """(a / a_scale) @ (b / b_scale)^T with fp32 accumulation, in `out_dtype`. `a` [M, K] and `b` [N, K] are fp8;
    `a_scale` is a scalar or [M, 1], `b_scale` a scalar or [N, 1] (the scales they were quantised with)."""
    a, b = a.contiguous(), b.contiguous()
    rowwise = a_scale.dim() > 0 or b_scale.dim() > 0
    if rowwise:  # _scaled_mm takes rowwise scales as [M, 1] and [1, N], both given when either is
        a_scale = a_scale.expand(a.shape[0], 1) if a_scale.dim() == 0 else a_scale
        b_scale = b_scale.expand(b.shape[0], 1) if b_scale.dim() == 0 else b_scale
    inv_a, inv_b = (1.0 / a_scale).float().contiguous(), (1.0 / b_scale).float().contiguous()
    if _native(a, b, rowwise, out_dtype):
        return torch._scaled_mm(a, b.t(), inv_a, inv_b.t() if rowwise else inv_b, out_dtype=out_dtype)
    return ((a.float() * inv_a) @ (b.float() * inv_b).t()).to(out_dtype)


@dataclasses.dataclass
class Fp8Stats:
    """The largest amax seen since the last `take()`, per kind of tensor ("input", "weight", "grad_output"): a
    window on the ranges the scales follow, reported with the metrics."""

    amax: dict = dataclasses.field(default_factory=dict)

    def observe(self, kind: str, value: torch.Tensor) -> None:
        value = value.detach().amax() if value.numel() else value.new_zeros(())
        seen = self.amax.get(kind)
        self.amax[kind] = value if seen is None else torch.maximum(seen, value)

    def take(self, group=None, device=None) -> dict[str, float]:
        """{"fp8_amax_<kind>": value} since the last call, then forget them. With `group` (a collective every one of
        its ranks makes), the largest over its ranks, each of which saw only its own tokens, TP shards, experts and
        pipeline stage: one all-reduce (max) of the three kinds on `device` (a kind no rank saw is left out)."""
        if group is not None:
            kinds = ("grad_output", "input", "weight")
            local = torch.stack([self.amax[k].detach().float().reshape(()).to(device) if k in self.amax
                                 else torch.full((), -1.0, device=device) for k in kinds])
            values = group.all_reduce(local, op="max").tolist()
            self.amax = {k: v for k, v in zip(kinds, values) if v >= 0}
        out = {f"fp8_amax_{k}": float(v) for k, v in sorted(self.amax.items())}
        self.amax.clear()
        return out


@dataclasses.dataclass(frozen=True)
class Fp8Recipe:
    """How a run's parallel linears scale their fp8 GEMMs (see the module docstring)."""

    name: str = "tensorwise"
    stats: Fp8Stats = dataclasses.field(default_factory=Fp8Stats, compare=False)

    def __post_init__(self):
        if self.name not in FP8_RECIPES:
            raise ValueError(f"unknown fp8 recipe {self.name!r}; choose one of {', '.join(FP8_RECIPES)}")

    @classmethod
    def of(cls, precision) -> "Fp8Recipe | None":
        """The recipe a run's `Precision` asks for (None unless its GEMMs run in fp8)."""
        return cls(precision.fp8_recipe) if precision.fp8 else None

    @property
    def rowwise(self) -> bool:
        return self.name == "rowwise"

    @property
    def grad_dtype(self) -> torch.dtype:
        """The output gradient's format: e5m2's range for tensorwise scales, e4m3's precision for rowwise ones."""
        return E4M3 if self.rowwise else E5M2
