"""The mean next-token loss of a model over token windows (validation during training, `tensorpar eval`)."""

from __future__ import annotations

import math

import torch

from tensorpar.data.batch import as_batch
from tensorpar.functional.document_mask import PackedDocuments
from tensorpar.config.precision import Precision


@torch.no_grad()
def evaluate(model, windows, batch_size: int, device, precision: Precision, dp_group=None,
             eos_id: int | None = None) -> float:
    """Mean next-token loss over `windows` [N, L+1] (every rank gets the same value); with `eos_id`, attention
    within the packed documents that EOS ends (validation of a run trained with --document-mask). `windows` may be
    a `Batch` of instruction rows instead: the mean over their valid targets, attention within each example. The
    forwards run under `precision`'s autocast.

    With `dp_group` (size d > 1) the batches are dealt round-robin to its ranks and the sums of the losses and
    target counts all-reduced over it. Every rank runs the same number of forwards (one with no batch of its
    own runs the first batch and drops it), as the all-to-alls of expert parallelism need every rank."""
    was_training = model.training
    model.eval()
    dp = dp_group.size if dp_group is not None else 1
    rank = dp_group.rank if dp_group is not None else 0
    rows = as_batch(windows)
    num_batches = math.ceil(len(rows) / batch_size)
    total, count = 0.0, 0
    for first in range(0, num_batches, dp):
        index = first + rank
        own = index < num_batches
        start = (index if own else 0) * batch_size
        batch = rows[start:start + batch_size].to(device)
        with precision.autocast(device):
            loss = model(batch.inputs, batch.targets, documents=_documents(batch, eos_id))
        if own:
            total += loss.item() * batch.valid_targets()
            count += batch.valid_targets()
    if dp > 1:
        sums = dp_group.all_reduce(torch.tensor([total, float(count)], dtype=torch.float64, device=device))
        total, count = sums[0].item(), int(sums[1].item())
    model.train(was_training)
    return total / max(count, 1)


def _documents(batch, eos_id: int | None) -> PackedDocuments | None:
    if batch.example is not None:
        return PackedDocuments.from_index(batch.example)
    return None if eos_id is None else PackedDocuments.from_tokens(batch.inputs, eos_id)
