"""The mean next-token loss of a model over token windows (validation during training, `tensorpar eval`)."""

from __future__ import annotations

import torch

from tensorpar.optim.precision import autocast


@torch.no_grad()
def evaluate(model, windows: torch.Tensor, batch_size: int, device, dtype: str) -> float:
    """Mean next-token loss over `windows` [N, L+1] (every rank gets the same value)."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for start in range(0, windows.shape[0], batch_size):
        batch = windows[start : start + batch_size].to(device)
        with autocast(device, dtype):
            loss = model(batch[:, :-1], batch[:, 1:])
        total += loss.item() * batch[:, 1:].numel()
        count += batch[:, 1:].numel()
    model.train(was_training)
    return total / max(count, 1)
