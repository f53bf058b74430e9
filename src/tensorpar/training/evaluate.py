"""The mean next-token loss of a model over token windows (validation during training, `tensorpar eval`)."""

from __future__ import annotations

import math

import torch

from tensorpar.functional.document_mask import PackedDocuments
from tensorpar.config.precision import Precision


@torch.no_grad()
def evaluate(model, windows: torch.Tensor, batch_size: int, device, precision: Precision, dp_group=None,
             eos_id: int | None = None) -> float:
    """Mean next-token loss over `windows` [N, L+1] (every rank gets the same value); with `eos_id`, attention
    within the packed documents that EOS ends (validation of a run trained with --document-mask); the forwards run
    under `precision`'s autocast.

    With `dp_group` (size d > 1) the batches are dealt round-robin to its ranks and the sums of the losses and
    target counts all-reduced over it. Every rank runs the same number of forwards (one with no batch of its
    own runs the first batch and drops it), as the all-to-alls of expert parallelism need every rank."""
    was_training = model.training
    model.eval()
    dp = dp_group.size if dp_group is not None else 1
    rank = dp_group.rank if dp_group is not None else 0
    num_batches = math.ceil(windows.shape[0] / batch_size)
    total, count = 0.0, 0
    for first in range(0, num_batches, dp):
        index = first + rank
        own = index < num_batches
        batch = windows[(index if own else 0) * batch_size:][:batch_size].to(device)
        with precision.autocast(device):
            documents = None if eos_id is None else PackedDocuments.from_tokens(batch[:, :-1], eos_id)
            loss = model(batch[:, :-1], batch[:, 1:], documents=documents)
        if own:
            total += loss.item() * batch[:, 1:].numel()
            count += batch[:, 1:].numel()
    if dp > 1:
        sums = dp_group.all_reduce(torch.tensor([total, float(count)], dtype=torch.float64, device=device))
        total, count = sums[0].item(), int(sums[1].item())
    model.train(was_training)
    return total / max(count, 1)
