"""The cost of collectives: alpha-beta times, and the `Collective` record the volume models list.

Time of one collective over ``n`` ranks on a link of latency alpha and bandwidth beta
(per GPU, per direction), for a message of ``B`` bytes counted as tensorpar's `CommStats`
counts it (the NCCL-tests "logical buffer size": all-gather = the gathered output,
reduce-scatter = the input being reduced, scatter / gather = the full tensor):

================  ==================================  =========================================
op                ring                                tree (binomial; recursive doubling)
================  ==================================  =========================================
all_reduce        2(n-1) (alpha + B/(n beta))         2 ceil(log2 n) (alpha + B/beta)
all_gather        (n-1) (alpha + B/(n beta))          ceil(log2 n) alpha + (n-1)/n B/beta
reduce_scatter    (n-1) (alpha + B/(n beta))          ceil(log2 n) alpha + (n-1)/n B/beta
broadcast         (n-1) alpha + B/beta  (pipelined)   ceil(log2 n) (alpha + B/beta)
reduce            (n-1) alpha + B/beta  (pipelined)   ceil(log2 n) (alpha + B/beta)
gather, scatter   (n-1) (alpha + B/(n beta))          ceil(log2 n) alpha + (n-1)/n B/beta
send              alpha + B/beta                      alpha + B/beta
all_to_all        (n-1) (alpha + B/(n beta))          (pairwise exchange; the same)
================  ==================================  =========================================

The all-to-all is the pairwise exchange NCCL runs: n - 1 steps, each sending B/n (a balanced
split of the B bytes a rank sends, its own share staying home) to one other rank.

The ring all-reduce is a reduce-scatter followed by an all-gather; the binomial tree reduce
and broadcast move the whole message at each of their ceil(log2 n) steps (the algorithms that
`tensorpar.distributed.collective_algorithms` traces). `collective_time(..., algorithm="best")` takes the
faster of the two, as NCCL's tuner does.

Which link a group uses: `tensorpar.planning.candidates.group_link`.
"""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict

from tensorpar.config.hardware import Link
from tensorpar.errors import TensorparError
from tensorpar.planning.candidates import Candidate, group_link

OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce", "gather", "scatter", "send", "all_to_all")

ALGORITHMS = ("ring", "tree", "best")


def collective_time(op: str, nbytes: float, n: int, link: Link, algorithm: str = "best") -> float:
    """Seconds for one `op` of `nbytes` (tensorpar's byte convention) over `n` ranks on `link`."""
    if op == "recv":
        op = "send"
    if op not in OPS:
        raise TensorparError(f"unknown collective {op!r}; known: {', '.join(OPS)}")
    if algorithm not in ALGORITHMS:
        raise TensorparError(f"unknown algorithm {algorithm!r}; known: {', '.join(ALGORITHMS)}")
    if op == "send":
        return link.latency + nbytes / link.bandwidth
    if n <= 1:
        return 0.0
    if algorithm == "best":
        return min(collective_time(op, nbytes, n, link, "ring"), collective_time(op, nbytes, n, link, "tree"))
    a, beta = link.latency, link.bandwidth
    steps = math.ceil(math.log2(n))
    if op == "all_to_all":
        return (n - 1) * (a + nbytes / (n * beta))
    if algorithm == "ring":
        if op == "all_reduce":
            return 2 * (n - 1) * (a + nbytes / (n * beta))
        if op in ("broadcast", "reduce"):
            return (n - 1) * a + nbytes / beta
        return (n - 1) * (a + nbytes / (n * beta))  # all_gather, reduce_scatter, gather, scatter
    if op == "all_reduce":
        return 2 * steps * (a + nbytes / beta)
    if op in ("broadcast", "reduce"):
        return steps * (a + nbytes / beta)
    return steps * a + (n - 1) / n * nbytes / beta  # all_gather, reduce_scatter, gather, scatter


@dataclasses.dataclass(frozen=True)
class Collective:
    """`calls` collectives of `nbytes` each (tensorpar's byte convention) on group `group`."""

    op: str
    group: str
    nbytes: int
    calls: int = 1
    phase: str = "forward"  # forward | backward | step
    what: str = ""
    pieces: int = 1  # tensorpar's TP overlap sends each call as this many collectives of nbytes / pieces (time only)

    @property
    def total_bytes(self) -> int:
        return self.nbytes * self.calls


def add_collective(out: list[Collective], op: str, nbytes, calls, phase: str, what: str, group: str = "tp",
                   pieces: int = 1) -> None:
    """Append `calls` collectives of `nbytes` to `out`; nothing when `calls` is 0."""
    if calls:
        out.append(Collective(op, group, int(nbytes), int(calls), phase, what, pieces))


def sum_bytes(collectives: list[Collective]) -> dict[tuple[str, str], int]:
    """Total bytes per (op, group), in `CommStats`' keys."""
    out: dict[tuple[str, str], int] = defaultdict(int)
    for c in collectives:
        out[(c.op, c.group)] += c.total_bytes
    return dict(out)


def collectives_time(collectives: list[Collective], cluster, layout: Candidate, algorithm: str = "best") -> float:
    """Seconds the listed collectives take back to back (one after another, nothing overlapped). A reduce-scatter
    is priced by the ring formula on every library: on gloo tensorpar runs it as an all-to-all of the blocks and a
    local sum (`tensorpar.distributed.collective_calls.reduce_scatter_by_all_to_all`), which moves what a ring moves, not
    through ProcessGroupGloo's own (a whole all-reduce of a clone)."""
    total = 0.0
    for c in collectives:
        n = layout.group_size(c.group)
        link = group_link(cluster, layout, c.group)
        total += c.calls * c.pieces * collective_time(c.op, c.nbytes / c.pieces, n, link, algorithm)
    return total
