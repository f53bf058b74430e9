"""The seven NCCL collectives as ring and tree algorithms on tensors, over point-to-point messages.

`ring_all_reduce`, `ring_all_gather`, `ring_reduce_scatter`, `tree_reduce`, `tree_broadcast`,
`tree_gather`, `tree_scatter` (and `tree_all_reduce`) run the algorithms of
`tensorpar.distributed.collective_simulation` on tensors over a tensorpar `Group`, using nothing
but its blocking `send` / `recv`, with the semantics of the group's own collectives. Pass
``trace=[]`` to have this rank's sends and receives appended to that list as `Event`s.
"""

from __future__ import annotations

import dataclasses

import torch

from tensorpar.distributed.collective_simulation import (
    ring_all_gather_chunks,
    ring_reduce_scatter_chunks,
    subtree,
    tree_steps,
)
from tensorpar.distributed.comm import as_group


@dataclasses.dataclass(frozen=True)
class Event:
    """One point-to-point operation of a real implementation, from this rank's point of view.

    `kind` is "send" or "recv", `peer` the other group rank, `chunk` as in `Transfer`,
    `elements` the number of tensor elements moved, `step` and `phase` as in `Step`.
    """

    step: int
    phase: str
    kind: str
    peer: int
    chunk: int | tuple[int, ...] | None
    elements: int


def _group(group):
    return as_group(group)


def _combine_(dst: torch.Tensor, src: torch.Tensor, op: str) -> None:
    if op == "sum":
        dst.add_(src)
    elif op == "product":
        dst.mul_(src)
    elif op == "max":
        torch.maximum(dst, src, out=dst)
    elif op == "min":
        torch.minimum(dst, src, out=dst)
    else:
        raise ValueError(f"unknown reduction '{op}'; choose one of sum, max, min, product")


def _record(trace, step, phase, kind, peer, chunk, t) -> None:
    if trace is not None:
        trace.append(Event(step, phase, kind, peer, chunk, t.numel()))


def _ring_exchange(group, send_t, recv_t, step, phase, send_chunk, recv_chunk, trace) -> None:
    """Send `send_t` to rank+1 and receive `recv_t` from rank-1 with blocking calls.

    Even ranks send first and odd ranks receive first, so at least one link of the ring is always
    ready to complete (with an odd group size ranks N-1 and 0 both send first; rank 1 receives
    first and unblocks the chain). Empty chunks (a tensor smaller than the group) are skipped on
    both ends alike.
    """
    n, r = group.size, group.rank
    nxt, prv = (r + 1) % n, (r - 1) % n

    def send():
        if send_t.numel():
            group.send(send_t, nxt)
            _record(trace, step, phase, "send", nxt, send_chunk, send_t)

    def recv():
        if recv_t.numel():
            group.recv(recv_t, prv)
            _record(trace, step, phase, "recv", prv, recv_chunk, recv_t)

    if r % 2 == 0:
        send()
        recv()
    else:
        recv()
        send()


def _ring_reduce_scatter_(chunks, group, op, trace, step0=0) -> int:
    """Reduce-scatter phase in place over `chunks` (contiguous 1-D views); returns the last step index."""
    n, r = group.size, group.rank
    tmp = torch.empty_like(chunks[0])  # chunk 0 is the largest
    for s in range(n - 1):
        send_c, recv_c = ring_reduce_scatter_chunks(r, n, s)
        buf = tmp[: chunks[recv_c].numel()]
        _ring_exchange(group, chunks[send_c], buf, step0 + s + 1, "reduce-scatter", send_c, recv_c, trace)
        _combine_(chunks[recv_c], buf, op)
    return step0 + n - 1


def _ring_all_gather_(chunks, group, trace, step0=0) -> int:
    n, r = group.size, group.rank
    for s in range(n - 1):
        send_c, recv_c = ring_all_gather_chunks(r, n, s)
        _ring_exchange(group, chunks[send_c], chunks[recv_c], step0 + s + 1, "all-gather", send_c, recv_c, trace)
    return step0 + n - 1


def ring_all_reduce(tensor: torch.Tensor, group, op: str = "sum", trace: list | None = None) -> torch.Tensor:
    """Ring all-reduce of `tensor` in place (as `Group.all_reduce`); returns it.

    2(N-1) steps, each sending 1/N of the tensor (split as `torch.tensor_split` of the flattened
    tensor, so any size works) to the next rank.
    """
    group = _group(group)
    if group.size == 1:
        return tensor
    work = tensor if tensor.is_contiguous() else tensor.contiguous()
    chunks = work.view(-1).tensor_split(group.size)
    step = _ring_reduce_scatter_(chunks, group, op, trace)
    _ring_all_gather_(chunks, group, trace, step)
    if work is not tensor:
        tensor.copy_(work)
    return tensor


def ring_all_gather(tensor: torch.Tensor, group, trace: list | None = None) -> torch.Tensor:
    """Every rank's `tensor` (equal shapes) concatenated along dim 0 in group-rank order (as `Group.all_gather`)."""
    group = _group(group)
    n, r = group.size, group.rank
    if n == 1:
        return tensor
    out = torch.empty((n * tensor.shape[0],) + tuple(tensor.shape[1:]), dtype=tensor.dtype, device=tensor.device)
    blocks = out.view((n,) + tuple(tensor.shape))
    blocks[r].copy_(tensor)
    _ring_all_gather_([blocks[i] for i in range(n)], group, trace)
    return out


def ring_reduce_scatter(tensor: torch.Tensor, group, op: str = "sum", trace: list | None = None) -> torch.Tensor:
    """Reduce `tensor` across the group and return this rank's slice of dim 0 (as `Group.reduce_scatter`).

    Dim 0 must divide by the group size; `tensor` itself is left unchanged.
    """
    group = _group(group)
    n, r = group.size, group.rank
    if n == 1:
        return tensor
    if tensor.shape[0] % n:
        raise ValueError(
            f"ring_reduce_scatter on group '{group.name}': dimension 0 of size {tensor.shape[0]} "
            f"does not divide by the group size {n}"
        )
    work = tensor.clone(memory_format=torch.contiguous_format)
    blocks = work.view((n, tensor.shape[0] // n) + tuple(tensor.shape[1:]))
    _ring_reduce_scatter_([blocks[i].view(-1) for i in range(n)], group, op, trace)
    return blocks[r].clone()


def _tree_reduce_(work, group, root, op, trace, step0=0) -> int:
    n = group.size
    v = (group.rank - root) % n
    real = lambda u: (u + root) % n  # noqa: E731
    tmp = None
    for k in range(tree_steps(n)):
        mask = 1 << k
        if v % (2 * mask) == mask:
            group.send(work, real(v - mask))
            _record(trace, step0 + k + 1, "reduce", "send", real(v - mask), None, work)
            break  # a rank's part is done once it has sent to its parent
        if v + mask < n:
            tmp = torch.empty_like(work) if tmp is None else tmp
            group.recv(tmp, real(v + mask))
            _record(trace, step0 + k + 1, "reduce", "recv", real(v + mask), None, tmp)
            _combine_(work, tmp, op)
    return step0 + tree_steps(n)


def _tree_broadcast_(work, group, root, trace, step0=0) -> int:
    n = group.size
    v = (group.rank - root) % n
    real = lambda u: (u + root) % n  # noqa: E731
    steps = tree_steps(n)
    for i, k in enumerate(reversed(range(steps))):
        mask = 1 << k
        if v % (2 * mask) == 0 and v + mask < n:
            group.send(work, real(v + mask))
            _record(trace, step0 + i + 1, "broadcast", "send", real(v + mask), None, work)
        elif v % (2 * mask) == mask:
            group.recv(work, real(v - mask))
            _record(trace, step0 + i + 1, "broadcast", "recv", real(v - mask), None, work)
    return step0 + steps


def tree_reduce(tensor: torch.Tensor, group, root: int = 0, op: str = "sum", trace: list | None = None) -> torch.Tensor:
    """Binomial-tree reduce onto group rank `root`, in place there (as `Group.reduce`); returns `tensor`.

    Other ranks' tensors hold partial reductions afterwards (undefined, as for `Group.reduce`).
    """
    group = _group(group)
    if group.size == 1:
        return tensor
    work = tensor if tensor.is_contiguous() else tensor.contiguous()
    _tree_reduce_(work, group, root, op, trace)
    if work is not tensor:
        tensor.copy_(work)
    return tensor


def tree_broadcast(tensor: torch.Tensor, group, root: int = 0, trace: list | None = None) -> torch.Tensor:
    """Binomial-tree broadcast of group rank `root`'s `tensor` into every rank's `tensor`, in place; returns it."""
    group = _group(group)
    if group.size == 1:
        return tensor
    work = tensor if tensor.is_contiguous() else tensor.contiguous()
    _tree_broadcast_(work, group, root, trace)
    if work is not tensor:
        tensor.copy_(work)
    return tensor


def tree_all_reduce(
    tensor: torch.Tensor, group, root: int = 0, op: str = "sum", trace: list | None = None
) -> torch.Tensor:
    """All-reduce as a tree reduce onto `root` followed by a tree broadcast from it, in place; returns `tensor`."""
    group = _group(group)
    if group.size == 1:
        return tensor
    work = tensor if tensor.is_contiguous() else tensor.contiguous()
    step = _tree_reduce_(work, group, root, op, trace)
    _tree_broadcast_(work, group, root, trace, step)
    if work is not tensor:
        tensor.copy_(work)
    return tensor


def tree_gather(tensor: torch.Tensor, group, root: int = 0, dim: int = 0, trace: list | None = None):
    """Every rank's `tensor` concatenated along `dim` in group-rank order on `root`; None elsewhere (as `Group.gather`).

    Each rank sends its whole subtree's blocks to its parent in one message.
    """
    group = _group(group)
    n = group.size
    if n == 1:
        return tensor
    v = (group.rank - root) % n
    real = lambda u: (u + root) % n  # noqa: E731
    size = subtree(v, n)
    buf = torch.empty((size,) + tuple(tensor.shape), dtype=tensor.dtype, device=tensor.device)
    buf[0].copy_(tensor)  # buf[i] is virtual rank v + i's block
    for k in range(tree_steps(n)):
        mask = 1 << k
        step = k + 1
        if v % (2 * mask) == mask:
            ranks = tuple(real(u) for u in range(v, v + size))
            group.send(buf, real(v - mask))
            _record(trace, step, "gather", "send", real(v - mask), ranks, buf)
            return None
        if v + mask < n:
            count = subtree(v + mask, n)
            piece = buf[mask : mask + count]
            group.recv(piece, real(v + mask))
            ranks = tuple(real(u) for u in range(v + mask, v + mask + count))
            _record(trace, step, "gather", "recv", real(v + mask), ranks, piece)
    # root: reorder from virtual to real rank order and concatenate
    return torch.cat([buf[(q - root) % n] for q in range(n)], dim)


def tree_scatter(
    tensor: torch.Tensor | None,
    group,
    root: int = 0,
    dim: int = 0,
    shape=None,
    dtype=None,
    device=None,
    trace: list | None = None,
) -> torch.Tensor:
    """Split root's `tensor` along `dim` into group-size chunks and give rank r chunk r (as `Group.scatter`).

    Ranks other than `root` pass ``tensor=None`` with the chunk's `shape`, `dtype`, `device`
    (or any tensor of the full shape, whose values are ignored). Each rank receives its whole
    subtree's chunks from its parent in one message and passes the children's parts on.
    """
    group = _group(group)
    n = group.size
    if n == 1:
        return tensor
    v = (group.rank - root) % n
    real = lambda u: (u + root) % n  # noqa: E731
    dim = dim % (tensor.dim() if tensor is not None else len(shape))
    if tensor is not None:
        if tensor.shape[dim] % n:
            raise ValueError(
                f"tree_scatter on group '{group.name}': dimension {dim} of size {tensor.shape[dim]} "
                f"does not divide by the group size {n}"
            )
        chunk_shape = list(tensor.shape)
        chunk_shape[dim] //= n
        dtype, device = tensor.dtype, tensor.device
    else:
        if shape is None:
            raise ValueError("tree_scatter: ranks other than the root pass the chunk's shape")
        chunk_shape = list(shape)
    size = subtree(v, n)
    buf = torch.empty([size] + chunk_shape, dtype=dtype, device=device)  # buf[i]: virtual rank v + i's chunk
    if v == 0:
        chunks = tensor.chunk(n, dim)
        for u in range(n):
            buf[u].copy_(chunks[real(u)])
    for i, k in enumerate(reversed(range(tree_steps(n)))):
        mask = 1 << k
        step = i + 1
        if v % (2 * mask) == 0 and v + mask < n:
            count = subtree(v + mask, n)
            ranks = tuple(real(u) for u in range(v + mask, v + mask + count))
            group.send(buf[mask : mask + count], real(v + mask))
            _record(trace, step, "scatter", "send", real(v + mask), ranks, buf[mask : mask + count])
        elif v % (2 * mask) == mask:
            group.recv(buf, real(v - mask))
            _record(trace, step, "scatter", "recv", real(v - mask), tuple(real(u) for u in range(v, v + size)), buf)
    return buf[0].clone()


__all__ = [
    "Event", "ring_all_reduce", "ring_all_gather", "ring_reduce_scatter",
    "tree_reduce", "tree_broadcast", "tree_all_reduce", "tree_gather", "tree_scatter",
]
