"""Gradient reduce-scatters in flight (ZeRO-2 and ZeRO-3): a few full-size gradient buffers at a time."""

from __future__ import annotations

import torch

from tensorpar.data_parallel.flat_buffer import BytesInUse, nbytes


class ReduceScatterQueue:
    """Gradient reduce-scatters in flight, each summed into its buffer's `grad_shard` when it completes.

    A flat gradient buffer is handed over the moment a micro-batch's backward has filled it; the queue starts
    its reduce-scatter asynchronously and keeps at most `depth` in flight (waiting for the oldest first),
    so that only a few full-size gradient buffers ever exist at once: the ZeRO-2/3 gradient memory. With depth 1
    (the default) one buffer is being reduce-scattered while the next is filled by the backward."""

    def __init__(self, dp_group, grad_bytes: BytesInUse, depth: int = 1):
        self.dp, self.depth, self.grad_bytes = dp_group, depth, grad_bytes
        self._inflight: list = []

    def push(self, buffer, full_grad: torch.Tensor, group=None) -> None:
        """Reduce-scatter `full_grad` (counted in `grad_bytes` by the caller) into `buffer.grad_shard` over `group`
        (default: the queue's DP group); the queue releases it."""
        group = group or self.dp
        while len(self._inflight) >= self.depth:
            self._complete(self._inflight.pop(0))
        out = torch.empty(full_grad.numel() // group.size, dtype=full_grad.dtype, device=full_grad.device)
        self.grad_bytes.add(nbytes(out))
        self._inflight.append((buffer, out, group.reduce_scatter_async(out, full_grad), full_grad))

    def drain(self) -> None:
        while self._inflight:
            self._complete(self._inflight.pop(0))

    def _complete(self, item) -> None:
        buffer, out, work, full_grad = item  # the full gradient is referenced until here: the collective reads it
        work.wait()
        buffer.grad_shard.add_(out.to(buffer.grad_shard.dtype))
        self.grad_bytes.sub(nbytes(out) + nbytes(full_grad))


def sum_over_replicas(grad_shard: torch.Tensor, replicas) -> None:
    """HSDP: sum a reduce-scattered gradient slice over the replicas holding the same slice (all-reduce across);
    nothing without replicas (`replicas` None or a group of one rank)."""
    if replicas is not None and replicas.size > 1:
        replicas.all_reduce(grad_shard)
