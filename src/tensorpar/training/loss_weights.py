"""Exact loss normalisation: a step's loss is the sum of the losses of every valid target of the global batch
divided by their number, whatever the layout.

The model returns the mean loss of a micro-batch over its own valid targets (every CP rank's, `mean_from_cp`).
Micro-batch i of a DP rank, with n_i valid targets of the global batch's N, is weighted by

    w_i = n_i * dp / N

before its backward (and in the step's reported loss): data parallelism averages the gradients over its dp ranks,
so every valid target of the step weighs 1 / N in the gradient, as it does in one process training the whole
global batch at once. N and each n_i are counted from the global batch, which every rank holds: no collective.

When every target is valid (pretraining), n_i = N / (dp * M) for M micro-batches per rank and w_i = 1 / M (the
same float): the per-micro-batch mean of before. With masked prompts it is not: micro-batches with few valid targets
would weigh as much as those with many (torchtitan #1842).
"""

from __future__ import annotations

from tensorpar.data.batch import Batch
from tensorpar.errors import TensorparError


def micro_batch_weights(micro_batches: list[Batch], global_valid: int, dp_size: int) -> list[float]:
    """w_i = n_i * dp / N of each of this DP rank's micro-batches (see the module)."""
    if global_valid < 1:
        raise TensorparError("a step's global batch has no target to learn (every target is the ignore index): "
                             "the data holds rows with nothing to learn")
    return [b.valid_targets() * dp_size / global_valid for b in micro_batches]
