"""ZeRO-1 and ZeRO-2: each rank steps only its 1/dp slice of every bucket (optimizer states: 1/dp of the memory).

ZeRO-1 reduce-scatters each bucket's gradients once per step into the rank's fp32 gradient slice, steps the fp32
master slice, and all-gathers the updated parameters into the buckets.

ZeRO-2 does not keep gradients in full buckets: a bucket's buffer is allocated when its first gradient of a
micro-batch arrives, reduce-scattered into the rank's fp32 slice as soon as the micro-batch has filled it, and
released when that completes (at most 3 buckets' buffers exist at once). So the gradient memory is 1/dp of
ZeRO-1's plus a few buckets; the price: with gradient accumulation every micro-batch's gradients are
reduce-scattered (as DeepSpeed's ZeRO-2 does), not one reduction per step.
"""

from __future__ import annotations

import torch

from tensorpar.data_parallel.bucketed import BucketedOptimizer
from tensorpar.data_parallel.buckets import Bucket
from tensorpar.data_parallel.flat_buffer import nbytes
from tensorpar.data_parallel.host_masters import HostMasterWeights
from tensorpar.data_parallel.master_weights import MasterWeights
from tensorpar.data_parallel.reduce_scatter_queue import ReduceScatterQueue, sum_over_replicas


class Zero1Optimizer(BucketedOptimizer):
    """ZeRO-1. Backward: each bucket's gradients reduce-scattered (asynchronously, once the step's last
    micro-batch filled it). After the step: the updated slices all-gathered into the buckets."""

    zero = 1
    sharded = True

    def _build_weights(self, params, weight_decay):
        weights = HostMasterWeights(weight_decay) if self.offload else MasterWeights(weight_decay)
        for b in self.buckets:
            lo, hi = b.slice_bounds(b.group)
            b.slice = weights.add(b, b.param_buffer[lo:hi], b.group)
            self.grad_bytes.add(nbytes(b.slice.grad_shard))
        return weights

    def _launch(self, b: Bucket) -> None:
        b.rs_out = b.slice.grad_shard
        if b.grad_buffer.dtype != b.rs_out.dtype:  # reduced in bf16: into a bf16 slice, then widened
            b.rs_out = torch.empty(b.rs_out.numel(), dtype=b.grad_buffer.dtype, device=b.grad_buffer.device)
        b.pending = b.group.reduce_scatter_async(b.rs_out, b.grad_buffer)

    def _reduced(self, b: Bucket) -> None:
        if b.rs_out is not b.slice.grad_shard:
            b.slice.grad_shard.copy_(b.rs_out)
        self._average(b)

    def _average(self, b: Bucket) -> None:
        """The bucket's reduce-scattered slice, summed across the HSDP replicas, divided into the average over DP."""
        if b.group is self.shards:  # the experts' buckets are sharded over expert-DP: no replicas
            sum_over_replicas(b.slice.grad_shard, self.replicas)
        b.slice.grad_shard.div_(self.dp.size)

    def _publish(self) -> None:
        pending = []
        for b in self.buckets:
            shard = b.slice.master.to(b.param_buffer.device, b.param_buffer.dtype)  # from the host if offloaded
            pending.append((b.group.all_gather_async(b.param_buffer, shard), shard))
        for work, _ in pending:
            work.wait()


class Zero2Optimizer(Zero1Optimizer):
    """ZeRO-2. Backward: every micro-batch's gradients of a bucket reduce-scattered as soon as that micro-batch
    filled it, into the rank's fp32 slice, through a queue that keeps few full buffers alive. After the step:
    the updated slices all-gathered into the buckets."""

    zero = 2

    def _allocate_grads(self) -> None:
        self.queue = ReduceScatterQueue(self.shards, self.grad_bytes)  # buffers allocated per micro-batch

    def _grad_ready(self, param: torch.Tensor) -> None:
        """Move the gradient into its bucket (allocated now if needed); hand a full bucket to the queue."""
        b = self._bucket_of[id(param)]
        b.ready += 1
        b.add_grad(b.gradient_buffer(self.reduce_dtype, self.grad_bytes), param)
        if b.ready % b.arrivals == 0 and not b.deferred:
            self.queue.push(b.slice, b.grad_buffer, b.group)
            b.grad_buffer = None

    def finish_backward(self) -> None:
        """The tied embedding's buckets (summed over its stages first), then wait for every reduce-scatter; average."""
        deferred = [b for b in self.buckets if b.deferred]
        for b in deferred:
            b.gradient_buffer(self.reduce_dtype, self.grad_bytes)
        self._sum_tied_across_stages()
        for b in deferred:
            self.queue.push(b.slice, b.grad_buffer, b.group)
            b.grad_buffer = None
        self.queue.drain()
        for b in self.buckets:
            self._average(b)

    def _zero_grads(self) -> None:
        super()._zero_grads()
        for b in self.buckets:
            b.slice.grad_shard.zero_()  # each micro-batch's reduce-scatter is added into it
