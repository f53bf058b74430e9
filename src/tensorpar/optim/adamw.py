"""AdamW with the usual two parameter groups: weight decay on matrices, none on biases and norms."""

from __future__ import annotations

import torch
from torch import nn

from tensorpar.errors import TensorparError


def takes_weight_decay(param: torch.Tensor | torch.Size) -> bool:
    """Matrices and embeddings (ndim >= 2) decay; biases and norm weights do not. Takes a parameter or its shape
    (ZeRO-3 frees a parameter's storage between uses)."""
    return len(getattr(param, "shape", param)) >= 2


def build_optimizer(
    model: nn.Module,
    lr: float,
    weight_decay: float,
    betas: tuple[float, float] = (0.9, 0.95),
    eps: float = 1e-8,
) -> torch.optim.AdamW:
    """AdamW over `model`'s trainable parameters, in two groups (in this order):

    0. ``weight_decay=weight_decay``: parameters with ndim >= 2 (linear weights, embeddings);
    1. ``weight_decay=0.0``: parameters with ndim < 2 (biases, norm weights and biases).

    Within a group parameters keep `model.named_parameters()` order, so every rank (and every
    TP size) builds the same groups; frozen parameters (``requires_grad=False``) are left out.
    No communication: AdamW is elementwise, so each rank steps its own shards.
    """
    decay, no_decay = [], []
    for _, p in model.named_parameters():
        if p.requires_grad:
            (decay if takes_weight_decay(p) else no_decay).append(p)
    if not decay and not no_decay:
        raise TensorparError(f"build_optimizer: {type(model).__name__} has no trainable parameters")
    groups = [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return adamw(groups, lr=lr, betas=betas, eps=eps)


def adamw(groups: list[dict], lr: float, betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8) -> torch.optim.AdamW:
    """torch's AdamW over parameter groups, in its fastest exact form for where the parameters live: the fused
    kernel when they are all on CUDA (one kernel for every tensor; the same arithmetic), else foreach (on CPU
    torch runs it as a per-tensor loop, which is what the CPU parity tests were written against)."""
    params = [p for g in groups for p in g["params"]]
    fused = bool(params) and all(p.is_cuda for p in params)
    return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, foreach=not fused, fused=fused)
