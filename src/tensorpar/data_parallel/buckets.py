"""Gradient buckets (ZeRO 0, 1 and 2): parameters grouped into flat buffers of about `bucket_bytes`, filled in
reverse order so that the last layers' bucket, whose gradients are ready first, is sent first.

Each bucket's parameters are views of its flat parameter buffer for the whole run; its gradients are gathered into
a flat gradient buffer of the same layout and reduced with one collective. The routed experts' weights (ShardSpec
group "ep") go into buckets of their own, reduced over the expert-data-parallel group instead of DP x CP.
"""

from __future__ import annotations

import torch
from torch import nn

from tensorpar.data_parallel.flat_buffer import FlatBuffer
from tensorpar.distributed.sharding import shard_spec
from tensorpar.errors import TensorparError

DEFAULT_BUCKET_BYTES = 25 * 2**20


class Bucket(FlatBuffer):
    """Parameters whose gradients are reduced together over `group`; `arrivals` gradient arrivals per micro-batch."""

    def __init__(self, params: list[nn.Parameter], pad_to: int, group):
        super().__init__(params, pad_to)
        self.group = group
        self.param_buffer = self.pack()
        self.bind(self.param_buffer)
        self.grads_are_views = False  # the parameters' .grad are views of grad_buffer (fp32, persistent buffers)
        self.slice = None  # the MasterSlice AdamW steps, if any
        self.pending = None
        self.ready = 0
        self.arrivals = len(params)
        self.deferred = False  # started only in finish_backward (a tied embedding's, summed over pipeline stages)

    def attach_grads(self) -> None:
        """Give every parameter a zeroed `.grad` that is a view of this bucket's gradient buffer."""
        self.grad_buffer = torch.zeros_like(self.param_buffer)
        for p, offset in zip(self.params, self.offsets):
            p.grad = self.grad_buffer[offset : offset + p.numel()].view_as(p)
        self.grads_are_views = True

    def collect(self, param: nn.Parameter) -> None:
        """`param`'s new gradient into the gradient buffer (nothing to move when its .grad is a view of it)."""
        if not self.grads_are_views:
            self.add_grad(self.grad_buffer, param)


def make_buckets(params: list[nn.Parameter], bucket_bytes: float, dp_group, expert_dp_group,
                 sharded: bool) -> list[Bucket]:
    """`params` (in model order) in buckets of about `bucket_bytes`, last parameters first; the routed experts'
    in buckets of their own over `expert_dp_group`. ``sharded`` (ZeRO-1/2): padded to a multiple of the group."""
    groups_of = {False: dp_group, True: expert_dp_group}  # by "is a routed expert's weight"
    buckets: list[Bucket] = []
    current, size = {False: [], True: []}, {False: 0, True: 0}

    def close(kind: bool) -> None:
        group = groups_of[kind]
        buckets.append(Bucket(current[kind], group.size if sharded else 1, group))
        current[kind], size[kind] = [], 0

    for p in reversed(params):
        kind = shard_spec(p).expert
        if kind and expert_dp_group is None:
            raise TensorparError("the model has routed experts but the mesh no expert groups: "
                                 "build it with init_mesh(..., ep=N)")
        current[kind].append(p)
        size[kind] += p.numel() * p.element_size()
        if size[kind] >= bucket_bytes:
            close(kind)
    for kind in (False, True):
        if current[kind]:
            close(kind)
    return buckets
