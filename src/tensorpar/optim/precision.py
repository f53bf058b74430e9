"""Precision of the forward and backward pass.

``fp32``: everything in fp32. ``bf16``: the matmuls and attention run in bf16 under
torch.autocast, while the weights, gradients, their reductions and the optimizer stay fp32.
"""

from __future__ import annotations

import contextlib

import torch


def autocast(device: torch.device, dtype: str):
    """The context to run forward passes in for `dtype` ("fp32": a null context, "bf16": bf16 autocast)."""
    if dtype == "bf16":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()
