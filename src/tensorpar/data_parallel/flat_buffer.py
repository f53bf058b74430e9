"""Parameters laid end to end in one flat tensor: what a DP bucket (ZeRO 0-2) and a ZeRO-3 unit both are.

The flat tensor is padded to a multiple of the size of the group that shards it, so that rank r's slice is
[r * padded / size, (r + 1) * padded / size). A bucket keeps its parameters as views of its flat buffer for the
whole run; a ZeRO-3 unit only between its all-gather and its free. Gradients are gathered into flat buffers of the
same layout (`add_grad`) and reduced with one collective per buffer.
"""

from __future__ import annotations

import math

import torch
from torch import nn


class FlatBuffer:
    """The layout of `params` in one flat tensor of `padded` elements (a multiple of `pad_to`)."""

    def __init__(self, params: list[nn.Parameter], pad_to: int):
        self.params = list(params)
        self.shapes = [p.shape for p in self.params]
        self.offsets, offset = [], 0
        for p in self.params:
            self.offsets.append(offset)
            offset += p.numel()
        self.numel = offset
        self.padded = math.ceil(offset / pad_to) * pad_to
        self.offset_of = {id(p): off for p, off in zip(self.params, self.offsets)}
        self.grad_buffer: torch.Tensor | None = None  # the gradients in this layout, while they are gathered

    def gradient_buffer(self, dtype: torch.dtype, in_use: "BytesInUse") -> torch.Tensor:
        """`grad_buffer`, allocated (zeros of `dtype`, counted in `in_use`) if there is none."""
        if self.grad_buffer is None:
            self.grad_buffer = torch.zeros(self.padded, dtype=dtype, device=self.params[0].device)
            in_use.add(nbytes(self.grad_buffer))
        return self.grad_buffer

    def pack(self) -> torch.Tensor:
        """A new flat tensor holding the parameters' values (zeros in the padding)."""
        first = self.params[0]
        flat = torch.zeros(self.padded, dtype=first.dtype, device=first.device)
        with torch.no_grad():
            for p, off in zip(self.params, self.offsets):
                flat[off : off + p.numel()].copy_(p.detach().flatten())
        return flat

    def bind(self, flat: torch.Tensor) -> None:
        """Make every parameter's data a view of its place in `flat`."""
        for p, off, shape in zip(self.params, self.offsets, self.shapes):
            p.data = flat[off : off + shape.numel()].view(shape)

    def slice_bounds(self, group) -> tuple[int, int]:
        """[lo, hi): the elements `group`'s rank owns when the buffer is sharded over `group`."""
        per_rank = self.padded // group.size
        return group.rank * per_rank, (group.rank + 1) * per_rank

    def add_grad(self, flat_grad: torch.Tensor, param: nn.Parameter) -> None:
        """Add `param`'s gradient into its place in `flat_grad` and drop the parameter's own."""
        offset = self.offset_of[id(param)]
        flat_grad[offset : offset + param.grad.numel()].add_(param.grad.detach().flatten())
        param.grad = None


class BytesInUse:
    """Bytes of some kind of buffer alive now, and the most alive at once since `reset_peak()`."""

    def __init__(self, now: int = 0):
        self.now = self.peak = now

    def add(self, nbytes: int) -> None:
        self.now += nbytes
        self.peak = max(self.peak, self.now)

    def sub(self, nbytes: int) -> None:
        self.now -= nbytes

    def reset_peak(self) -> None:
        self.peak = self.now


def nbytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()
