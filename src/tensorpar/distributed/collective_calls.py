"""How a `Group` calls each collective on its backend: torch.distributed's functions as they are (NCCL, or gloo
with host tensors), or through host memory for CUDA tensors on gloo.

gloo implements few collectives for CUDA tensors (no reduce-scatter, no send / recv), and none of them matters for
speed: gloo on a GPU is how several ranks share one GPU (NCCL refuses two ranks on one device), so that every
parallel code path runs on CUDA tensors when only one GPU is lent. There each call copies its CUDA tensors to host
memory, runs the CPU collective, and copies the results back (at `wait()` for an asynchronous call).

Every function keeps torch.distributed's signature, so `Group` calls `calls.all_reduce(...)` as it would call
`dist.all_reduce(...)`.
"""

from __future__ import annotations

import types

import torch
import torch.distributed as dist

# torch >= 2.12 names the tensor-to-tensor collectives *_single; older releases *_into_tensor / *_tensor.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class _ThenFinish:
    """The handle of an asynchronous call that needs work after the collective: waits for it, then `finish()`.
    `keep`: what must stay alive until then (the host copies a staged call sends or receives)."""

    def __init__(self, work, finish, keep=None):
        self.work, self.finish, self.keep = work, finish, keep

    def wait(self, *args, **kwargs) -> bool:
        self.work.wait(*args, **kwargs)
        self.finish()
        return True


def reduce_scatter_by_all_to_all(output, tensor, op=None, group=None, async_op=False):
    """Sum-reduce-scatter as an all-to-all of the ranks' blocks and a local sum over what arrived, for gloo.
    ProcessGroupGloo's own reduce-scatter all-reduces a clone of the whole tensor and copies one block out;
    this way moves (size-1)/size of the tensor per rank, as a ring reduce-scatter does, and takes 0.43-0.65x
    torch's time for 4.2 MB at 2 and 3 ranks on this project's 2-core machine (bench/reduce_scatter_gloo.py).
    The blocks are summed in group-rank order. Same signature as torch's reduce_scatter_tensor."""
    size = dist.get_world_size(group)
    received = tensor.new_empty(tensor.numel())
    work = dist.all_to_all_single(received, tensor.reshape(-1), group=group, async_op=async_op)

    def finish():
        torch.sum(received.view(size, -1), dim=0, out=output.view(-1))

    if not async_op:
        finish()
        return None
    return _ThenFinish(work, finish)


def _gloo_reduce_scatter(output, tensor, op=None, group=None, async_op=False):
    """gloo's reduce-scatter: a sum by `reduce_scatter_by_all_to_all`, other reductions by torch's."""
    chosen = reduce_scatter_by_all_to_all if op in (None, dist.ReduceOp.SUM) else reduce_scatter_single
    return chosen(output, tensor, op=op, group=group, async_op=async_op)


def _through_host(fn, writes: tuple[int, ...]):
    """`fn` (a torch.distributed call) run on host copies of its CUDA tensor arguments; the positional arguments
    at `writes` (tensors, or lists of tensors) receive the results, copied back to the device when the call
    completes. Host tensors pass straight through."""

    def staged(*args, **kwargs):
        copies = []

        def to_host(x, written):
            if isinstance(x, list):
                return [to_host(v, written) for v in x]
            if isinstance(x, torch.Tensor) and x.is_cuda:
                host = x.detach().to("cpu")
                if written:
                    copies.append((x, host))
                return host
            return x

        host_args = [to_host(a, i in writes) for i, a in enumerate(args)]
        host_kwargs = {k: to_host(v, False) for k, v in kwargs.items()}
        work = fn(*host_args, **host_kwargs)

        def finish():
            for device_tensor, host in copies:
                device_tensor.copy_(host)

        if work is None or not hasattr(work, "wait"):
            finish()
            return work
        return _ThenFinish(work, finish, keep=(host_args, host_kwargs))

    return staged


def _names(reduce_scatter):
    return dict(all_reduce=dist.all_reduce, all_gather_single=all_gather_single, reduce_scatter_single=reduce_scatter,
                all_to_all_single=dist.all_to_all_single, broadcast=dist.broadcast, reduce=dist.reduce,
                scatter=dist.scatter, gather=dist.gather, send=dist.send, recv=dist.recv, isend=dist.isend,
                irecv=dist.irecv)


# The argument each call writes its result into (gather: the list of buffers on the destination).
_WRITES = dict(all_reduce=(0,), all_gather_single=(0,), reduce_scatter_single=(0,), all_to_all_single=(0,),
               broadcast=(0,), reduce=(0,), scatter=(0,), gather=(1,), send=(), recv=(0,), isend=(), irecv=(0,))

DIRECT = types.SimpleNamespace(**_names(reduce_scatter_single))
GLOO = types.SimpleNamespace(**{name: _through_host(fn, _WRITES[name])
                                for name, fn in _names(_gloo_reduce_scatter).items()})


def collective_calls(pg: dist.ProcessGroup | None):
    """The calls a group on process group `pg` makes: `GLOO` (host staging for CUDA tensors, the all-to-all
    reduce-scatter) for a gloo group, `DIRECT` (torch.distributed's own) for any other."""
    return GLOO if pg is not None and "gloo" in str(dist.get_backend(pg)) else DIRECT
