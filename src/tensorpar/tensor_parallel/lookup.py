"""An embedding lookup whose weight gradient is summed in fp32, whatever the table's dtype."""

from __future__ import annotations

import torch
import torch.nn.functional as F


class _LookupWithWideGrad(torch.autograd.Function):
    """`weight[ids]` whose backward sums each row's gradients in fp32 before rounding to the table's dtype.

    PyTorch's CPU embedding backward accumulates in the weight's dtype: in bf16 a row looked up a few hundred
    times stops growing once its sum is 2^8 times the addends (a byte-level vocabulary's space: about 15% of
    all tokens). Local: no communication.
    """

    @staticmethod
    def forward(ctx, ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(ids)
        ctx.weight_shape, ctx.weight_dtype = weight.shape, weight.dtype
        return F.embedding(ids, weight)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (ids,) = ctx.saved_tensors
        wide = torch.zeros(ctx.weight_shape, dtype=torch.float32, device=grad.device)
        wide.index_add_(0, ids.reshape(-1), grad.reshape(-1, grad.shape[-1]).float())
        return None, wide.to(ctx.weight_dtype)


def embedding_lookup(ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`F.embedding(ids, weight)`, with the weight gradient accumulated in fp32 when the table is bf16/fp16."""
    if weight.dtype in (torch.bfloat16, torch.float16) and weight.requires_grad and torch.is_grad_enabled():
        return _LookupWithWideGrad.apply(ids, weight)
    return F.embedding(ids, weight)
