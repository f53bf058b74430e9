"""The seven NCCL collectives as ring and tree algorithms over point-to-point messages.

Two forms of each algorithm, built on the same schedule so that they move the same chunks
between the same ranks in the same steps:

* `simulate(collective, inputs)`: a pure simulation over per-rank lists of numbers (no
  processes) that returns every rank's result and a trace of `Step`s: who sends which chunk to
  whom, the values sent and the receiver's buffer afterwards. `tensorpar explain` prints it.
* `ring_all_reduce`, `ring_all_gather`, `ring_reduce_scatter`, `tree_reduce`, `tree_broadcast`,
  `tree_gather`, `tree_scatter` (and `tree_all_reduce`): the same algorithms on tensors over a
  tensorpar `Group`, using nothing but its blocking `send` / `recv`, with the semantics of the
  group's own collectives. Pass ``trace=[]`` to have this rank's sends and receives appended
  to that list as `Event`s.

Ring algorithms (N ranks, ring r -> r+1 -> ... -> r, each buffer cut into N chunks):

* reduce-scatter, N-1 steps: in step s (from 0) rank r sends chunk (r-s-1) mod N to rank r+1,
  which adds it into its own copy of that chunk. Chunk c starts at rank c+1 and travels round
  the ring collecting one contribution per step, so after the last step rank r holds chunk r
  summed over all ranks (the blog post's example: [28], [32], [36], [40]).
* all-gather, N-1 steps: rank r starts with block r; in step s it sends block (r-s) mod N to
  rank r+1, which stores it. After N-1 steps every rank has every block.
* all-reduce = reduce-scatter then all-gather: 2(N-1) steps, each rank sending 1/N of the data
  per step, 2(N-1)/N of it in all -- independent of N, which is why NCCL uses it for bandwidth.

Tree algorithms use a binomial tree rooted at `root` over the virtual ranks v = (r - root) mod N,
ceil(log2 N) steps. Going up (reduce, gather), in step k (mask = 2^k) every v whose lowest set
bit is `mask` sends to v - mask, i.e. the tree halves the number of active ranks per step.
Going down (broadcast, scatter) the steps run in the opposite order and v sends to v + mask.
Rank v's subtree is the virtual ranks [v, v + lowbit(v)), so gather and scatter move whole
subtrees' blocks at once. Tree all-reduce is a tree reduce onto `root` then a tree broadcast.
"""

from __future__ import annotations

import dataclasses
import operator

import torch

from tensorpar.errors import TensorparError

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "reduce", "broadcast", "gather", "scatter")

# The algorithms each collective has here; the first is the default (the one the blog post names).
ALGORITHMS = {
    "all-reduce": ("ring", "tree"),
    "all-gather": ("ring",),
    "reduce-scatter": ("ring",),
    "reduce": ("tree",),
    "broadcast": ("tree",),
    "gather": ("tree",),
    "scatter": ("tree",),
}

_SIM_OPS = {"sum": operator.add, "max": max, "min": min, "product": operator.mul}


@dataclasses.dataclass(frozen=True)
class Transfer:
    """One message of a simulated step.

    `chunk` is the chunk index for ring algorithms; for gather / scatter the tuple of ranks whose
    blocks the message carries (in the order carried); None when the whole buffer is sent.
    `values` are the numbers sent, `result` the receiver's whole buffer after the step.
    """

    src: int
    dst: int
    chunk: int | tuple[int, ...] | None
    values: tuple
    result: tuple

    @property
    def what(self) -> str:
        if self.chunk is None:
            return "its buffer"
        if isinstance(self.chunk, tuple):
            noun = "block" if len(self.chunk) == 1 else "blocks"
            return f"{noun} of rank{'s' if len(self.chunk) > 1 else ''} {', '.join(map(str, self.chunk))}"
        return f"chunk {self.chunk}"


@dataclasses.dataclass(frozen=True)
class Step:
    """One step of a simulated algorithm: its messages (all in flight at once) and every buffer after it.

    `index` counts from 1 over the whole algorithm; `phase` is the part of the algorithm the step
    belongs to ("reduce-scatter" and "all-gather" for ring all-reduce, "reduce" and "broadcast"
    for tree all-reduce, else the collective's own name).
    """

    index: int
    phase: str
    transfers: tuple[Transfer, ...]
    buffers: tuple[tuple, ...]


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


def normalize(collective: str) -> str:
    """'all_reduce' / 'ALL-REDUCE' / 'allreduce' -> 'all-reduce'; unknown names raise TensorparError."""
    key = collective.strip().lower().replace("_", "-")
    squashed = {c.replace("-", ""): c for c in COLLECTIVES}
    if key in COLLECTIVES:
        return key
    if key.replace("-", "") in squashed:
        return squashed[key.replace("-", "")]
    raise TensorparError(f"unknown collective '{collective}'; choose one of {', '.join(COLLECTIVES)}")


def resolve_algorithm(collective: str, algorithm: str | None = None) -> str:
    """The algorithm to use for `collective` (its default when None); one it lacks raises TensorparError."""
    collective = normalize(collective)
    choices = ALGORITHMS[collective]
    if algorithm is None:
        return choices[0]
    algorithm = algorithm.strip().lower()
    if algorithm not in choices:
        raise TensorparError(
            f"{collective} has no '{algorithm}' algorithm here; use {' or '.join(choices)}"
        )
    return algorithm


def tree_steps(n: int) -> int:
    """ceil(log2 n): the number of steps of a binomial tree over n ranks."""
    return (n - 1).bit_length()


def chunk_bounds(length: int, n: int) -> list[tuple[int, int]]:
    """[start, end) of each of n chunks of a buffer of `length`, split as torch.tensor_split does."""
    q, extra = divmod(length, n)
    bounds, start = [], 0
    for i in range(n):
        end = start + q + (1 if i < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


# -- schedules shared by the simulation and the real implementations ---------------------------


def _ring_reduce_scatter_chunks(rank: int, n: int, s: int) -> tuple[int, int]:
    """(chunk rank sends to rank+1, chunk it receives from rank-1) in reduce-scatter step s (from 0)."""
    return (rank - s - 1) % n, (rank - s - 2) % n


def _ring_all_gather_chunks(rank: int, n: int, s: int) -> tuple[int, int]:
    """(chunk rank sends to rank+1, chunk it receives from rank-1) in all-gather step s (from 0)."""
    return (rank - s) % n, (rank - s - 1) % n


def _lowbit(v: int) -> int:
    return v & -v


def _subtree(v: int, n: int) -> int:
    """Number of virtual ranks in v's binomial subtree: [v, v + lowbit(v)) cut at n (the root's is n)."""
    return n if v == 0 else min(_lowbit(v), n - v)


def _tree_up(n: int) -> list[list[tuple[int, int, int]]]:
    """Steps going up the tree: lists of (virtual src, virtual dst, subtree size of src)."""
    steps = []
    for k in range(tree_steps(n)):
        mask = 1 << k
        steps.append([(v, v - mask, _subtree(v, n)) for v in range(n) if v % (2 * mask) == mask])
    return steps


def _tree_down(n: int) -> list[list[tuple[int, int, int]]]:
    """Steps going down the tree: lists of (virtual src, virtual dst, subtree size of dst)."""
    steps = []
    for k in reversed(range(tree_steps(n))):
        mask = 1 << k
        steps.append([(v, v + mask, _subtree(v + mask, n)) for v in range(0, n, 2 * mask) if v + mask < n])
    return steps


# -- the simulation -------------------------------------------------------------------------------


def _check_inputs(inputs, need_equal: bool, name: str) -> list[list]:
    if not isinstance(inputs, (list, tuple)) or len(inputs) < 2:
        count = len(inputs) if isinstance(inputs, (list, tuple)) else "no"
        raise TensorparError(f"{name} needs at least 2 ranks, got {count}")
    out = []
    for r, values in enumerate(inputs):
        values = list(values)
        for x in values:
            if isinstance(x, bool) or not isinstance(x, (int, float)):
                raise TensorparError(f"rank {r}'s input holds {x!r}, which is not a number")
        out.append(values)
    if need_equal and len({len(v) for v in out}) > 1:
        raise TensorparError(f"{name} needs inputs of one length on every rank, got lengths {[len(v) for v in out]}")
    return out


def simulate(
    collective: str,
    inputs: list[list[float]],
    algorithm: str | None = None,
    root: int = 0,
    op: str = "sum",
) -> tuple[list, list[Step]]:
    """Run `collective` on the per-rank `inputs` step by step; return (outputs per rank, trace).

    Outputs: all-reduce, every rank the elementwise reduction; all-gather, every rank all inputs
    concatenated in rank order; reduce-scatter, rank r chunk r of the reduction (the length must
    divide by the number of ranks); reduce and gather, the result on `root` and None elsewhere;
    broadcast, `root`'s input everywhere; scatter, rank r block r of `root`'s input (whose length
    must divide; the other ranks' inputs are ignored, as they are for broadcast).
    Buffers in the trace hold None where a rank has no value yet.
    """
    collective = normalize(collective)
    algorithm = resolve_algorithm(collective, algorithm)
    if op not in _SIM_OPS:
        raise TensorparError(f"unknown reduction '{op}'; choose one of {', '.join(_SIM_OPS)}")
    combine = _SIM_OPS[op]
    rooted = collective in ("broadcast", "scatter")
    inputs = _check_inputs(inputs, need_equal=not rooted, name=collective)
    n = len(inputs)
    if not isinstance(root, int) or not 0 <= root < n:
        raise TensorparError(f"root {root!r} is not a rank of the {n} ranks")
    sim = _Sim(n, combine)

    if collective == "all-reduce" and algorithm == "ring":
        sim.buffers = [list(v) for v in inputs]
        sim.ring_reduce_scatter()
        sim.ring_all_gather()
        outputs = [list(b) for b in sim.buffers]
    elif collective == "reduce-scatter":
        if len(inputs[0]) % n:
            raise TensorparError(f"reduce-scatter over {n} ranks needs a length divisible by {n}, got {len(inputs[0])}")
        sim.buffers = [list(v) for v in inputs]
        sim.ring_reduce_scatter()
        bounds = chunk_bounds(len(inputs[0]), n)
        outputs = [sim.buffers[r][slice(*bounds[r])] for r in range(n)]
    elif collective == "all-gather":
        m = len(inputs[0])
        sim.buffers = [[None] * (n * m) for _ in range(n)]
        for r in range(n):
            sim.buffers[r][r * m : (r + 1) * m] = inputs[r]
        sim.ring_all_gather()
        outputs = [list(b) for b in sim.buffers]
    elif collective in ("reduce", "all-reduce"):
        sim.buffers = [list(v) for v in inputs]
        sim.tree_reduce(root)
        if collective == "reduce":
            outputs = [list(sim.buffers[root]) if r == root else None for r in range(n)]
        else:
            sim.tree_broadcast(root)
            outputs = [list(b) for b in sim.buffers]
    elif collective == "broadcast":
        sim.buffers = [list(inputs[root]) if r == root else [None] * len(inputs[root]) for r in range(n)]
        sim.tree_broadcast(root)
        outputs = [list(b) for b in sim.buffers]
    elif collective == "gather":
        m = len(inputs[0])
        sim.buffers = [[None] * (n * m) for _ in range(n)]
        for r in range(n):
            sim.buffers[r][r * m : (r + 1) * m] = inputs[r]
        sim.tree_blocks(root, m, up=True)
        outputs = [list(sim.buffers[root]) if r == root else None for r in range(n)]
    elif collective == "scatter":
        length = len(inputs[root])
        if length % n:
            raise TensorparError(f"scatter over {n} ranks needs a length divisible by {n} on the root, got {length}")
        m = length // n
        sim.buffers = [list(inputs[root]) if r == root else [None] * length for r in range(n)]
        sim.tree_blocks(root, m, up=False)
        outputs = [sim.buffers[r][r * m : (r + 1) * m] for r in range(n)]
    else:  # pragma: no cover - resolve_algorithm rules this out
        raise TensorparError(f"{collective} has no {algorithm} algorithm")
    return outputs, sim.trace


class _Sim:
    """Buffers of every rank plus the trace; each method runs one phase of an algorithm."""

    def __init__(self, n: int, combine):
        self.n = n
        self.combine = combine
        self.buffers: list[list] = []
        self.trace: list[Step] = []

    def _step(self, phase: str, messages) -> None:
        """messages: (src, dst, chunk, src_slice, dst_slice, reduce?) -- all sent first, then received."""
        sent = [tuple(self.buffers[src][a:b]) for src, _, _, (a, b), _, _ in messages]
        for (src, dst, chunk, _, (a, b), reduce), values in zip(messages, sent):
            buf = self.buffers[dst]
            if reduce:
                buf[a:b] = [self.combine(x, y) for x, y in zip(buf[a:b], values)]
            else:
                buf[a:b] = values
        transfers = tuple(
            Transfer(src, dst, chunk, values, tuple(self.buffers[dst]))
            for (src, dst, chunk, _, _, _), values in zip(messages, sent)
        )
        self.trace.append(Step(len(self.trace) + 1, phase, transfers, tuple(tuple(b) for b in self.buffers)))

    def _ring(self, phase: str, chunks_of, reduce: bool) -> None:
        n = self.n
        bounds = chunk_bounds(len(self.buffers[0]), n)
        for s in range(n - 1):
            messages = []
            for r in range(n):
                c = chunks_of(r, n, s)[0]
                messages.append((r, (r + 1) % n, c, bounds[c], bounds[c], reduce))
            self._step(phase, messages)

    def ring_reduce_scatter(self) -> None:
        self._ring("reduce-scatter", _ring_reduce_scatter_chunks, reduce=True)

    def ring_all_gather(self) -> None:
        self._ring("all-gather", _ring_all_gather_chunks, reduce=False)

    def tree_reduce(self, root: int) -> None:
        whole = (0, len(self.buffers[0]))
        real = lambda v: (v + root) % self.n  # noqa: E731
        for pairs in _tree_up(self.n):
            self._step("reduce", [(real(v), real(d), None, whole, whole, True) for v, d, _ in pairs])

    def tree_broadcast(self, root: int) -> None:
        whole = (0, len(self.buffers[0]))
        real = lambda v: (v + root) % self.n  # noqa: E731
        for pairs in _tree_down(self.n):
            self._step("broadcast", [(real(v), real(d), None, whole, whole, False) for v, d, _ in pairs])

    def tree_blocks(self, root: int, m: int, up: bool) -> None:
        """Gather (up) or scatter (down): a message carries the blocks of the virtual subtree [first, first+size)."""
        n = self.n
        real = lambda v: (v + root) % n  # noqa: E731
        for pairs in _tree_up(n) if up else _tree_down(n):
            # Blocks of consecutive virtual ranks are contiguous in real-rank order unless the subtree
            # wraps past rank n-1; then the message is split at the wrap into two (src, dst) pieces.
            messages = []
            for v, d, size in pairs:
                first = v if up else d
                ranks = tuple(real(u) for u in range(first, first + size))
                pieces, start = [], 0
                for i in range(1, size + 1):
                    if i == size or ranks[i] != ranks[i - 1] + 1:
                        lo, hi = ranks[start] * m, (ranks[i - 1] + 1) * m
                        pieces.append((lo, hi))
                        start = i
                messages.append((real(v), real(d), ranks, pieces))
            self._blocks_step("gather" if up else "scatter", messages)

    def _blocks_step(self, phase: str, messages) -> None:
        sent = [
            tuple(x for lo, hi in pieces for x in self.buffers[src][lo:hi]) for src, _, _, pieces in messages
        ]
        for (src, dst, _, pieces), _values in zip(messages, sent):
            for lo, hi in pieces:
                self.buffers[dst][lo:hi] = self.buffers[src][lo:hi]
        transfers = tuple(
            Transfer(src, dst, ranks, values, tuple(self.buffers[dst]))
            for (src, dst, ranks, _), values in zip(messages, sent)
        )
        self.trace.append(Step(len(self.trace) + 1, phase, transfers, tuple(tuple(b) for b in self.buffers)))


# -- real implementations over a tensorpar Group ---------------------------------------------------


def _group(group):
    from tensorpar.distributed.comm import as_group

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
        send_c, recv_c = _ring_reduce_scatter_chunks(r, n, s)
        buf = tmp[: chunks[recv_c].numel()]
        _ring_exchange(group, chunks[send_c], buf, step0 + s + 1, "reduce-scatter", send_c, recv_c, trace)
        _combine_(chunks[recv_c], buf, op)
    return step0 + n - 1


def _ring_all_gather_(chunks, group, trace, step0=0) -> int:
    n, r = group.size, group.rank
    for s in range(n - 1):
        send_c, recv_c = _ring_all_gather_chunks(r, n, s)
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
    size = _subtree(v, n)
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
            count = _subtree(v + mask, n)
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
    size = _subtree(v, n)
    buf = torch.empty([size] + chunk_shape, dtype=dtype, device=device)  # buf[i]: virtual rank v + i's chunk
    if v == 0:
        chunks = tensor.chunk(n, dim)
        for u in range(n):
            buf[u].copy_(chunks[real(u)])
    for i, k in enumerate(reversed(range(tree_steps(n)))):
        mask = 1 << k
        step = i + 1
        if v % (2 * mask) == 0 and v + mask < n:
            count = _subtree(v + mask, n)
            ranks = tuple(real(u) for u in range(v + mask, v + mask + count))
            group.send(buf[mask : mask + count], real(v + mask))
            _record(trace, step, "scatter", "send", real(v + mask), ranks, buf[mask : mask + count])
        elif v % (2 * mask) == mask:
            group.recv(buf, real(v - mask))
            _record(trace, step, "scatter", "recv", real(v - mask), tuple(real(u) for u in range(v, v + size)), buf)
    return buf[0].clone()


__all__ = [
    "COLLECTIVES", "ALGORITHMS", "Step", "Transfer", "Event", "simulate", "normalize", "resolve_algorithm",
    "chunk_bounds", "tree_steps",
    "ring_all_reduce", "ring_all_gather", "ring_reduce_scatter",
    "tree_reduce", "tree_broadcast", "tree_all_reduce", "tree_gather", "tree_scatter",
]
