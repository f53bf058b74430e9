"""The mean next-token loss of a model over token windows (validation during training, `tensorpar eval`)."""

from __future__ import annotations

import math

import torch

from tensorpar.data.batch import IGNORE_INDEX, Batch
from tensorpar.functional.document_mask import PackedDocuments
from tensorpar.config.precision import Precision
from tensorpar.errors import TensorparError


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
    rows = _rows(windows, batch_size, model.cfg.vocab_size)
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


def _rows(windows, batch_size: int, vocab_size: int) -> Batch:
    """`windows` as a Batch, or a TensorparError naming what `evaluate` cannot take."""
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise TensorparError(f"batch_size must be a positive integer, got {batch_size!r}")
    if not isinstance(windows, Batch):
        if not isinstance(windows, torch.Tensor) or windows.dim() != 2 or windows.shape[1] < 2 \
                or windows.dtype.is_floating_point or windows.dtype == torch.bool:
            what = (f"a {windows.dim()}-d {windows.dtype} tensor of shape {list(windows.shape)}"
                    if isinstance(windows, torch.Tensor) else f"a {type(windows).__name__} (torch.as_tensor() it)")
            raise TensorparError(f"windows must be token ids as an integer tensor [N, L + 1] with L >= 1 (or a Batch), "
                                 f"got {what}")
        windows = Batch.from_windows(windows.long())
    if len(windows) == 0:
        raise TensorparError("no windows to evaluate: the mean loss over none would read as 0")
    ids = torch.cat([windows.inputs.flatten(), windows.targets[windows.targets != IGNORE_INDEX]])
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
        raise TensorparError(f"windows hold token ids outside the model's vocabulary [0, {vocab_size}): "
                             f"{int(ids.min())} to {int(ids.max())}")
    return windows


def _documents(batch, eos_id: int | None) -> PackedDocuments | None:
    if batch.example is not None:
        return PackedDocuments.from_index(batch.example)
    return None if eos_id is None else PackedDocuments.from_tokens(batch.inputs, eos_id)
