"""One GEMM for a stack of experts: rows grouped by expert times each expert's weight (`--expert-gemm grouped`).

``grouped_mm(x, weight, sizes)``: the first sizes[0] rows of x [R, in] times weight[0]^T, the next sizes[1] times
weight[1]^T, ..., as one call: torch's `_grouped_mm` where it runs (CPU, and CUDA: its CUTLASS kernel for bf16 on
sm90 / sm100, its own per-group loop otherwise), whose backward is grouped too; elsewhere (no `_grouped_mm`, or
operands that break its 16-byte alignment rules) the rows are padded into [n, max rows, in] and multiplied by one
bmm. Either computes the per-expert loop's products (on CPU bit for bit) in the dtype autocast gives the loop.
"""

from __future__ import annotations

import torch

from tensorpar.functional.autocast import autocast_dtype

_GROUPED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class _ContiguousGrad(torch.autograd.Function):
    """Forward: identity. Backward: the gradient made contiguous (`_grouped_mm`'s backward refuses an expanded
    one, such as the gradient of a sum)."""

    @staticmethod
    def forward(ctx, y):
        return y.view_as(y)

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()


def _aligned(t: torch.Tensor) -> bool:
    """`_grouped_mm`'s layout rules for a contiguous operand: its leading stride (its last dimension) a multiple of
    16 bytes, and on CUDA its data 16-byte aligned. The dimension, not `stride(-2)`: torch.compile fails on the stride
    of a dynamic shape."""
    elements = 16 // t.element_size()
    return t.shape[-1] % elements == 0 and (t.device.type != "cuda" or t.data_ptr() % 16 == 0)


def grouped_mm_runs(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether torch's `_grouped_mm` takes these operands (x [R, in] row-major, weight [n, out, in]). Under
    torch.compile only bf16: its fake-tensor rule refuses other dtypes, which eager CPU runs."""
    dtypes = (torch.bfloat16,) if torch.compiler.is_compiling() else _GROUPED_DTYPES
    return (hasattr(torch, "_grouped_mm") and x.device.type in ("cpu", "cuda") and x.dtype in dtypes
            and x.dtype == weight.dtype and x.is_contiguous() and weight.is_contiguous() and _aligned(x)
            and _aligned(weight) and weight.shape[-2] * weight.element_size() % 16 == 0)  # the backward's operands


def padded_bmm(x: torch.Tensor, weight: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """The same product by one bmm over the groups padded to the largest (zero rows, dropped after)."""
    n, longest = len(sizes), max(sizes, default=0)
    counts = torch.tensor(sizes, device=x.device)
    group = torch.repeat_interleave(torch.arange(n, device=x.device), counts)
    first = torch.cumsum(counts, 0) - counts
    slot = group * longest + torch.arange(x.shape[0], device=x.device) - first[group]
    padded = x.new_zeros(n * longest, x.shape[1]).index_copy(0, slot, x).view(n, longest, x.shape[1])
    return torch.bmm(padded, weight.transpose(1, 2)).view(n * longest, weight.shape[1]).index_select(0, slot)


def grouped_mm(x: torch.Tensor, weight: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """Rows of `x` [R, in] grouped by `sizes` (one count per slice of `weight` [n, out, in]) times their slice's
    transpose: [R, out]."""
    dtype = autocast_dtype(x)
    x, weight = x.to(dtype), weight.to(dtype)
    if grouped_mm_runs(x, weight):
        offsets = torch.tensor(sizes, device=x.device).cumsum(0).to(torch.int32)
        return _ContiguousGrad.apply(torch._grouped_mm(x, weight.transpose(-2, -1), offs=offsets))
    return padded_bmm(x, weight, sizes)
