"""The seven NCCL collectives as ring and tree algorithms, simulated step by step on small numbers.

`simulate(collective, inputs)` is a pure simulation over per-rank lists of numbers (no
processes) that returns every rank's result and a trace of `Step`s: who sends which chunk to
whom, the values sent and the receiver's buffer afterwards. `tensorpar explain` prints it.
The chunk schedules here (`ring_reduce_scatter_chunks`, `ring_all_gather_chunks`, `tree_up`,
`tree_down`) are the ones `tensorpar.distributed.collective_algorithms` runs with real
point-to-point messages, so both move the same chunks between the same ranks in the same steps.
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


def ring_reduce_scatter_chunks(rank: int, n: int, s: int) -> tuple[int, int]:
    """(chunk rank sends to rank+1, chunk it receives from rank-1) in reduce-scatter step s (from 0)."""
    return (rank - s - 1) % n, (rank - s - 2) % n


def ring_all_gather_chunks(rank: int, n: int, s: int) -> tuple[int, int]:
    """(chunk rank sends to rank+1, chunk it receives from rank-1) in all-gather step s (from 0)."""
    return (rank - s) % n, (rank - s - 1) % n


def _lowbit(v: int) -> int:
    return v & -v


def subtree(v: int, n: int) -> int:
    """Number of virtual ranks in v's binomial subtree: [v, v + lowbit(v)) cut at n (the root's is n)."""
    return n if v == 0 else min(_lowbit(v), n - v)


def tree_up(n: int) -> list[list[tuple[int, int, int]]]:
    """Steps going up the tree: lists of (virtual src, virtual dst, subtree size of src)."""
    steps = []
    for k in range(tree_steps(n)):
        mask = 1 << k
        steps.append([(v, v - mask, subtree(v, n)) for v in range(n) if v % (2 * mask) == mask])
    return steps


def tree_down(n: int) -> list[list[tuple[int, int, int]]]:
    """Steps going down the tree: lists of (virtual src, virtual dst, subtree size of dst)."""
    steps = []
    for k in reversed(range(tree_steps(n))):
        mask = 1 << k
        steps.append([(v, v + mask, subtree(v + mask, n)) for v in range(0, n, 2 * mask) if v + mask < n])
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
    rooted = collective in ("broadcast", "scatter")
    inputs = _check_inputs(inputs, need_equal=not rooted, name=collective)
    n = len(inputs)
    if not isinstance(root, int) or not 0 <= root < n:
        raise TensorparError(f"root {root!r} is not a rank of the {n} ranks")
    sim = _Sim(n, _SIM_OPS[op])
    if algorithm == "ring":
        outputs = _run_ring(sim, collective, inputs)
    else:
        outputs = _run_tree(sim, collective, inputs, root)
    return outputs, sim.trace


def _own_blocks(inputs: list[list], n: int) -> list[list]:
    """Buffers of n blocks per rank, each rank's input in its own block and None in the others."""
    m = len(inputs[0])
    buffers = [[None] * (n * m) for _ in range(n)]
    for r in range(n):
        buffers[r][r * m : (r + 1) * m] = inputs[r]
    return buffers


def _run_ring(sim: _Sim, collective: str, inputs: list[list]) -> list:
    """Every rank's output of ring all-reduce, reduce-scatter or all-gather, run on `sim` (which keeps the trace)."""
    n = sim.n
    if collective == "all-gather":
        sim.buffers = _own_blocks(inputs, n)
        sim.ring_all_gather()
        return [list(b) for b in sim.buffers]
    if collective == "reduce-scatter" and len(inputs[0]) % n:
        raise TensorparError(f"reduce-scatter over {n} ranks needs a length divisible by {n}, got {len(inputs[0])}")
    sim.buffers = [list(v) for v in inputs]
    sim.ring_reduce_scatter()
    if collective == "reduce-scatter":
        bounds = chunk_bounds(len(inputs[0]), n)
        return [sim.buffers[r][slice(*bounds[r])] for r in range(n)]
    sim.ring_all_gather()
    return [list(b) for b in sim.buffers]


def _run_tree(sim: _Sim, collective: str, inputs: list[list], root: int) -> list:
    """Every rank's output (None where it gets none) of a binomial-tree reduce, all-reduce, broadcast, gather or
    scatter rooted at `root`, run on `sim` (which keeps the trace)."""
    n = sim.n
    if collective in ("reduce", "all-reduce"):
        sim.buffers = [list(v) for v in inputs]
        sim.tree_reduce(root)
        if collective == "reduce":
            return [list(sim.buffers[root]) if r == root else None for r in range(n)]
        sim.tree_broadcast(root)
        return [list(b) for b in sim.buffers]
    if collective == "broadcast":
        sim.buffers = [list(inputs[root]) if r == root else [None] * len(inputs[root]) for r in range(n)]
        sim.tree_broadcast(root)
        return [list(b) for b in sim.buffers]
    if collective == "gather":
        sim.buffers = _own_blocks(inputs, n)
        sim.tree_blocks(root, len(inputs[0]), up=True)
        return [list(sim.buffers[root]) if r == root else None for r in range(n)]
    if collective == "scatter":
        length = len(inputs[root])
        if length % n:
            raise TensorparError(f"scatter over {n} ranks needs a length divisible by {n} on the root, got {length}")
        m = length // n
        sim.buffers = [list(inputs[root]) if r == root else [None] * length for r in range(n)]
        sim.tree_blocks(root, m, up=False)
        return [sim.buffers[r][r * m : (r + 1) * m] for r in range(n)]
    raise TensorparError(f"{collective} has no tree algorithm")  # pragma: no cover - resolve_algorithm rules this out


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
        self._ring("reduce-scatter", ring_reduce_scatter_chunks, reduce=True)

    def ring_all_gather(self) -> None:
        self._ring("all-gather", ring_all_gather_chunks, reduce=False)

    def tree_reduce(self, root: int) -> None:
        whole = (0, len(self.buffers[0]))
        real = lambda v: (v + root) % self.n  # noqa: E731
        for pairs in tree_up(self.n):
            self._step("reduce", [(real(v), real(d), None, whole, whole, True) for v, d, _ in pairs])

    def tree_broadcast(self, root: int) -> None:
        whole = (0, len(self.buffers[0]))
        real = lambda v: (v + root) % self.n  # noqa: E731
        for pairs in tree_down(self.n):
            self._step("broadcast", [(real(v), real(d), None, whole, whole, False) for v, d, _ in pairs])

    def tree_blocks(self, root: int, m: int, up: bool) -> None:
        """Gather (up) or scatter (down): a message carries the blocks of the virtual subtree [first, first+size)."""
        n = self.n
        real = lambda v: (v + root) % n  # noqa: E731
        for pairs in tree_up(n) if up else tree_down(n):
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
