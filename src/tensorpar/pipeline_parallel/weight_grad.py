"""Split backward: a layer's input gradient now (B), its weight gradients later (W).

Zero-bubble pipeline schedules (ZB-H1, ZB-V) run the backward of a micro-batch in two halves: B, the
gradient of the stage's input, which the previous stage waits for, and W, the gradients of the weights,
which nobody waits for and so can fill idle time. A model built with a `WeightGradQueue` (its `TPRegion`'s GEMMs
are then `SplitBackwardGemms`, tensorpar.tensor_parallel.region_gemms, which run every layer's products through the
ops below) computes only B in its backward and leaves W in the queue;
`queue.close(key)` names the W work of the backward pass that just ran and `queue.run(key)` computes it
and accumulates it into ``param.grad`` through autograd, one call per parameter once its last piece of the pass is
computed, so that gradient hooks (data parallelism's buckets) fire once per parameter per pass, in the order a plain
backward fires them (the order the work was queued: the last layer first), and only the gradients of parameters still
being summed are alive beside the accumulated ones. Without a queue (the
default) every op below is the plain PyTorch op: results and gradients are those of an unsplit backward.

=================  ===============  ==================  =====================================
op                 forward          B (in backward)     W (queued)
=================  ===============  ==================  =====================================
`linear`           x A^T + b        g A                 g^T x, sum of g
`embedding`        A[ids]           (none)              index_add of g (accumulated in fp32)
`affine`           x * w + b        g * w               sum of g * x, sum of g
=================  ===============  ==================  =====================================

No communication here, except a weight gradient's own reduction (``reduce``: the all-reduce over TP of
a weight replicated on the TP ranks that each see part of the tokens), which W runs where the plain
path runs it in backward. The queue is created with the model and emptied by whoever runs the backward
passes (the pipeline runner): nothing is global.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Hashable

import torch
import torch.nn.functional as F

from tensorpar.errors import TensorparError

Reduce = Callable[[torch.Tensor], torch.Tensor]


@dataclass
class _Work:
    param: torch.Tensor
    compute: Callable[[], torch.Tensor]  # the gradient of `param` (of `param[index]` when index is set)
    index: int | None = None
    reduce: Reduce | None = None


class WeightGradQueue:
    """The weight-gradient work (W) that split backward passes left for later, grouped per backward pass.

    ``anchor`` is a scalar that requires grad, fed to every deferred op so that its output requires grad
    even when nothing else does (token ids into the embedding); its gradient is never computed.
    """

    def __init__(self, device=None):
        self.anchor = torch.zeros((), device=device, requires_grad=True)
        self._open: list[_Work] = []
        self._closed: dict[Hashable, list[_Work]] = {}

    def defer(self, param: torch.Tensor, compute: Callable[[], torch.Tensor], *, index: int | None = None,
              reduce: Reduce | None = None) -> None:
        """Queue the gradient of `param` (computed later by `compute()`; of `param[index]` with `index`),
        reduced by `reduce` before it is accumulated."""
        self._open.append(_Work(param, compute, index, reduce))

    def close(self, key: Hashable) -> None:
        """The work queued since the last close belongs to the backward pass `key` (e.g. (micro-batch, chunk))."""
        if key in self._closed:
            raise TensorparError(f"weight-gradient work for {key!r} is already queued and not yet run")
        self._closed[key] = self._open
        self._open = []

    def run(self, key: Hashable) -> None:
        """Compute and accumulate the weight gradients of backward pass `key`."""
        if key not in self._closed:
            raise TensorparError(f"no weight-gradient work queued for {key!r}; queued: {list(self._closed)}")
        self._accumulate(self._closed.pop(key))

    def run_all(self) -> None:
        """Run every closed pass (in the order they closed), then the work not yet closed."""
        for key in list(self._closed):
            self.run(key)
        work, self._open = self._open, []
        self._accumulate(work)

    @property
    def pending(self) -> list[Hashable]:
        """Keys of the closed passes whose W has not run yet."""
        return list(self._closed)

    def __len__(self) -> int:
        return len(self._closed) + (1 if self._open else 0)

    @staticmethod
    def _accumulate(work: list[_Work]) -> None:
        left: dict[int, int] = {}  # pieces of each parameter's gradient not computed yet
        for w in work:
            left[id(w.param)] = left.get(id(w.param), 0) + 1
        sums: dict[int, torch.Tensor] = {}
        for w in work:
            with torch.no_grad():
                grad = w.compute()
                if w.index is not None:
                    full = torch.zeros_like(w.param)
                    full[w.index] = grad
                    grad = full
                if w.reduce is not None:
                    grad = w.reduce(grad)
                grad = grad.to(w.param.dtype)
                key = id(w.param)
                grad = sums.pop(key).add_(grad) if key in sums else grad
            left[key] -= 1
            if left[key]:
                sums[key] = grad
            else:  # the parameter's last piece: accumulate now (its hook fires), free it
                torch.autograd.backward([w.param], [grad])


def _deferring(queue, *tensors) -> bool:
    return queue is not None and torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1])


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, anchor, weight, bias, queue, params, index, reduce):
        ctx.save_for_backward(x, weight)
        (ctx.param, ctx.bias_param), ctx.queue, ctx.index, ctx.reduce = params, queue, index, reduce
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        grad_x = grad.matmul(weight) if ctx.needs_input_grad[0] else None
        if ctx.param.requires_grad:
            ctx.queue.defer(ctx.param, lambda: _rows(grad).t().mm(_rows(x)), index=ctx.index, reduce=ctx.reduce)
        if ctx.bias_param is not None and ctx.bias_param.requires_grad:
            ctx.queue.defer(ctx.bias_param, lambda: _rows(grad).sum(0), index=ctx.index, reduce=ctx.reduce)
        return grad_x, None, None, None, None, None, None, None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           queue: WeightGradQueue | None = None, *, index: int | None = None,
           reduce: Reduce | None = None) -> torch.Tensor:
    """``F.linear(x, weight[index] if index is not None else weight, bias)``; with a queue the weight's (and
    bias's) gradient is deferred to W. ``weight`` and ``bias`` must be the parameters themselves (leaves):
    whatever the plain path does to their gradient (an all-reduce) goes in ``reduce``."""
    if not _deferring(queue, weight, bias):
        return F.linear(x, weight if index is None else weight[index], bias)
    w = weight.detach() if index is None else weight.detach()[index]
    b = None if bias is None else (bias.detach() if index is None else bias.detach()[index])
    # the parameters travel in a tuple, not as inputs: autograd must not reach them (their hooks would fire in B)
    return _Linear.apply(x, queue.anchor, w, b, queue, (weight, bias), index, reduce)


class _Embedding(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ids, anchor, weight, queue, params):
        ctx.save_for_backward(ids)
        ctx.queue, (ctx.param,) = queue, params
        return F.embedding(ids, weight)

    @staticmethod
    def backward(ctx, grad):
        (ids,) = ctx.saved_tensors
        param = ctx.param

        def weight_grad():  # summed in fp32, like tensorpar.tensor_parallel.embedding's bf16 lookup
            wide = torch.zeros(param.shape, dtype=torch.float32, device=grad.device)
            return wide.index_add_(0, ids.reshape(-1), _rows(grad).float())

        ctx.queue.defer(param, weight_grad)
        return None, None, None, None, None


def embedding(ids: torch.Tensor, weight: torch.Tensor, queue: WeightGradQueue) -> torch.Tensor:
    """``F.embedding(ids, weight)`` whose weight gradient is deferred to W (callers keep their own plain
    path for ``queue=None``)."""
    if not _deferring(queue, weight):
        return F.embedding(ids, weight)
    return _Embedding.apply(ids, queue.anchor, weight.detach(), queue, (weight,))


class _Affine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, anchor, weight, bias, queue, params, reduce):
        ctx.save_for_backward(x, weight)
        ctx.queue, (ctx.param, ctx.bias_param), ctx.reduce = queue, params, reduce
        out = x if weight is None else x * weight
        return out if bias is None else out + bias

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_x = grad if weight is None else grad * weight
        if ctx.param is not None and ctx.param.requires_grad:
            ctx.queue.defer(ctx.param, lambda: _rows(grad * x).sum(0), reduce=ctx.reduce)
        if ctx.bias_param is not None and ctx.bias_param.requires_grad:
            ctx.queue.defer(ctx.bias_param, lambda: _rows(grad).sum(0), reduce=ctx.reduce)
        return grad_x, None, None, None, None, None, None


def affine(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
           queue: WeightGradQueue | None, *, reduce: Reduce | None = None) -> torch.Tensor:
    """``x * weight + bias`` over the last dimension (either may be None: a norm's scale and shift, a bias
    added after a reduction); with a queue their gradients are deferred to W."""
    if not _deferring(queue, weight, bias):
        out = x if weight is None else x * weight
        return out if bias is None else out + bias
    detached = [None if t is None else t.detach() for t in (weight, bias)]
    return _Affine.apply(x, queue.anchor, *detached, queue, (weight, bias), reduce)


def summed_over(group) -> Reduce:
    """The ``reduce`` of a weight that the plain path passes through `copy_to_tp`: its gradient all-reduced
    over `group` (a `tensorpar.distributed.comm.Group`)."""
    return lambda grad: group.all_reduce(grad.contiguous())
