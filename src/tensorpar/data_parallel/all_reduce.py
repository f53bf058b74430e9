"""ZeRO-0: every rank holds the whole optimizer state; each bucket's gradients are all-reduced and averaged."""

from __future__ import annotations

import torch

from tensorpar.data_parallel.bucketed import BucketedOptimizer
from tensorpar.data_parallel.buckets import Bucket
from tensorpar.data_parallel.flat_buffer import nbytes
from tensorpar.data_parallel.host_masters import HostMasterWeights
from tensorpar.data_parallel.master_weights import MasterWeights, ModelWeights
from tensorpar.distributed.comm import Group


class AllReduceOptimizer(BucketedOptimizer):
    """Data parallelism without sharding (PyTorch DDP): forward: nothing; backward: each bucket's gradients
    all-reduced (asynchronously, as soon as the step's last micro-batch filled it); AdamW on every rank. fp32
    parameters are stepped in place; bf16/fp16 ones (and offloaded fp32 ones) through fp32 masters of whole
    buckets."""

    zero = 0

    def _build_weights(self, params, weight_decay):
        if not self.mixed and not self.offload:
            return ModelWeights([p for b in self.buckets for p in b.params], weight_decay)
        weights = HostMasterWeights(weight_decay) if self.offload else MasterWeights(weight_decay)
        whole = Group.single("dp")  # a master of the whole bucket
        for b in self.buckets:
            # Reduced in fp32: the all-reduced buffer is the master's gradient.
            shared_grad = b.grad_buffer if b.grad_buffer.dtype == torch.float32 else None
            b.slice = weights.add(b, b.param_buffer, whole, grad_shard=shared_grad)
            if shared_grad is None:
                self.grad_bytes.add(nbytes(b.slice.grad_shard))
        return weights

    def _launch(self, b: Bucket) -> None:
        b.pending = b.group.all_reduce_async(b.grad_buffer)

    def _reduced(self, b: Bucket) -> None:
        if b.slice is not None and b.slice.grad_shard is not b.grad_buffer:
            b.slice.grad_shard.copy_(b.grad_buffer).div_(self.dp.size)
        else:
            b.grad_buffer.div_(self.dp.size)

    def _publish(self) -> None:
        for b in self.buckets:
            if b.slice is not None:
                b.slice.write_back()

    def load_local_state(self, states, step: int, names) -> None:
        super().load_local_state(states, step, names)
        self._publish()  # bf16/fp16: the loaded fp32 masters are the parameters
