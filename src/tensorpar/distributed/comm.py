"""The communication module: every collective in tensorpar passes through a `Group`.

A `Group` is a named torch.distributed process group (``tp``, ``pp``, ``dp``, ...) that
counts each call (and, when asked, times it) in a shared `CommStats`, and turns a failed or
timed-out collective into a `CollectiveError` naming the rank, the operation and the group.
A group of one rank communicates nothing: its collectives return at once and count nothing.

Byte accounting follows the NCCL-tests convention of the *logical buffer size*:

=================  =========================================================
all_reduce         the tensor reduced (input = output size)
all_gather         the gathered output (group size x input)
reduce_scatter     the input being reduced (group size x output)
broadcast / reduce the tensor broadcast or reduced
scatter / gather   the full (unscattered / gathered) tensor
all_to_all         the tensor this rank sends (the sum of its split sizes)
send / recv        the tensor sent or received
=================  =========================================================
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections import defaultdict
from datetime import timedelta

import torch
import torch.distributed as dist

from tensorpar.distributed.collective_calls import collective_calls
from tensorpar.distributed.flight_recorder import FlightRecorder
from tensorpar.errors import CollectiveError

_REDUCE_OPS = {
    "sum": dist.ReduceOp.SUM,
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
    "product": dist.ReduceOp.PRODUCT,
}


@dataclasses.dataclass
class OpCount:
    calls: int = 0
    elements: int = 0
    bytes: int = 0
    seconds: float = 0.0


class CommStats:
    """Counts collectives per (operation, group name): calls, elements, bytes and optionally time.

    ``timing=True`` synchronises the device around each call so that the seconds recorded are
    the collective's own; leave it off on the hot path. For an asynchronous collective the seconds
    are those the process was blocked by it (starting it, and waiting for it to complete): the
    part of its time that compute did not cover.
    """

    def __init__(self, timing: bool = False):
        self.timing = timing
        self._counts: dict[tuple[str, str], OpCount] = defaultdict(OpCount)
        self.flight = FlightRecorder()  # the last collectives, written down when one fails
        self.profiling = False  # under torch.profiler (--profile-steps): each collective a named range

    def record(self, op: str, group: str, elements: int, nbytes: int, seconds: float = 0.0) -> None:
        c = self._counts[(op, group)]
        c.calls += 1
        c.elements += elements
        c.bytes += nbytes
        c.seconds += seconds

    def add_seconds(self, op: str, group: str, seconds: float) -> None:
        """Time spent waiting for an asynchronous (op, group) collective counted earlier."""
        self._counts[(op, group)].seconds += seconds

    def reset(self) -> None:
        self._counts.clear()

    def _total(self, field: str, op: str | None, group: str | None):
        return sum(
            getattr(c, field)
            for (o, g), c in self._counts.items()
            if (op is None or o == op) and (group is None or g == group)
        )

    def calls(self, op: str | None = None, group: str | None = None) -> int:
        return self._total("calls", op, group)

    def elements(self, op: str | None = None, group: str | None = None) -> int:
        return self._total("elements", op, group)

    def bytes(self, op: str | None = None, group: str | None = None) -> int:
        return self._total("bytes", op, group)

    def seconds(self, op: str | None = None, group: str | None = None) -> float:
        return self._total("seconds", op, group)

    def snapshot(self) -> dict[tuple[str, str], OpCount]:
        """A copy of the counts, keyed by (operation, group name)."""
        return {k: dataclasses.replace(v) for k, v in self._counts.items()}

    def summary(self) -> str:
        """A small table, one line per (operation, group)."""
        if not self._counts:
            return "no collectives"
        lines = [f"{'op':<16}{'group':<8}{'calls':>7}{'elements':>12}{'bytes':>14}"]
        for (op, group), c in sorted(self._counts.items()):
            lines.append(f"{op:<16}{group:<8}{c.calls:>7}{c.elements:>12}{c.bytes:>14}")
        return "\n".join(lines)


def _cause(e: Exception) -> str:
    """The first line of a backend's (often very long) error message."""
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class Group:
    """A named process group whose collectives are counted, timed on request, and explained on failure.

    ``rank`` and ``size`` are this process's rank within the group and the group's size;
    ``ranks`` are the global ranks of the members in group order. ``src``/``dst`` arguments are
    group ranks. ``pg`` is the torch ProcessGroup (None for a group of one rank).
    """

    where, nodes = "", ""  # across several nodes (set by the mesh): 'rank 2 on node 1 (host)', ' on nodes [0, 1]'

    def __init__(
        self,
        name: str,
        ranks: list[int],
        pg: dist.ProcessGroup | None,
        stats: CommStats | None = None,
        global_rank: int | None = None,
        timeout: timedelta | None = None,
    ):
        self.name = name
        self.ranks = list(ranks)
        self.pg = pg
        self.stats = stats if stats is not None else CommStats()
        self.global_rank = global_rank if global_rank is not None else (dist.get_rank() if dist.is_initialized() else 0)
        if self.global_rank not in self.ranks:
            raise ValueError(f"rank {self.global_rank} is not a member of group {name} {self.ranks}")
        self.rank = self.ranks.index(self.global_rank)
        self.size = len(self.ranks)
        self.timeout = timeout
        if self.size > 1 and pg is None:
            raise ValueError(f"group {name} has {self.size} ranks but no process group")
        self.calls = collective_calls(pg)  # torch.distributed's own, or gloo's (CUDA tensors through host memory)

    @classmethod
    def single(cls, name: str = "tp", stats: CommStats | None = None) -> "Group":
        """A group holding only this process: every collective is a no-op."""
        rank = dist.get_rank() if dist.is_initialized() else 0
        return cls(name, [rank], None, stats, rank)

    @classmethod
    def from_process_group(cls, pg: dist.ProcessGroup, name: str = "tp", stats: CommStats | None = None) -> "Group":
        """Wrap a torch ProcessGroup someone else created."""
        ranks = dist.get_process_group_ranks(pg)
        return cls(name, ranks, pg if len(ranks) > 1 else None, stats)

    def __repr__(self) -> str:
        return f"Group({self.name!r}, ranks={self.ranks}, rank={self.rank})"

    # -- plumbing ---------------------------------------------------------------------------

    # Under torch.compile (--compile) _run, _launch and Pending.wait run eagerly, as graph breaks:
    # `keep_collectives_eager` marks them when a model is compiled.
    def _run(self, op: str, count_tensor: torch.Tensor, fn, elements: int | None = None):
        timing = self.stats.timing
        if timing and count_tensor.is_cuda:
            torch.cuda.synchronize(count_tensor.device)
        n = count_tensor.numel() if elements is None else elements
        entry = self.stats.flight.start(self.name, self.ranks, op, n, str(count_tensor.dtype))
        t0 = time.perf_counter()
        try:
            with self._range(op):
                result = fn()
        except Exception as e:  # gloo raises RuntimeError, NCCL DistBackendError; both mean the same here
            limit = f" (timeout {self.timeout.total_seconds():.0f}s)" if self.timeout else ""
            raise self._failed(entry, op, f"failed after {time.perf_counter() - t0:.1f}s{limit}: a peer never "
                                          f"arrived or broke off. Cause: {_cause(e)}") from e
        self.stats.flight.end(entry)
        seconds = 0.0
        if timing:
            if count_tensor.is_cuda:
                torch.cuda.synchronize(count_tensor.device)
            seconds = time.perf_counter() - t0
        self.stats.record(op, self.name, n, n * count_tensor.element_size(), seconds)
        return result

    def _launch(self, op: str, count_tensor: torch.Tensor, fn) -> "Pending":
        """Start an asynchronous collective; count it now, explain its failure at `wait()`. With timing on, the
        seconds recorded are those this process is blocked: starting it here, and in `Pending.wait()`."""
        entry = self.stats.flight.start(self.name, self.ranks, op, count_tensor.numel(), str(count_tensor.dtype))
        t0 = time.perf_counter()
        try:
            with self._range(op):
                work = fn()
        except Exception as e:
            raise self._failed(entry, op, f"could not start: {_cause(e)}") from e
        seconds = time.perf_counter() - t0 if self.stats.timing else 0.0
        self.stats.record(op, self.name, count_tensor.numel(), _nbytes(count_tensor), seconds)
        return Pending(work, self, op, count_tensor.device, entry)

    def _range(self, op: str):
        """A named range "op/group" for torch.profiler while the run is profiled (else nothing, at no cost)."""
        return torch.profiler.record_function(f"{op}/{self.name}") if self.stats.profiling else contextlib.nullcontext()

    def failure(self, op: str, what: str) -> CollectiveError:
        """The error for `op` on this group: which rank, which operation, which group and members, and `what`."""
        return CollectiveError(f"{self.where or f'rank {self.global_rank}'}: {op} on group '{self.name}' "
                               f"(ranks {self.ranks}{self.nodes}) {what}")

    def _failed(self, entry: dict, op: str, what: str) -> CollectiveError:
        """`failure`, after marking the flight record's `entry` failed and writing the record down."""
        error = self.failure(op, what)
        self.stats.flight.end(entry, ok=False)
        self.stats.flight.dump(str(error))
        return error

    def _global(self, group_rank: int) -> int:
        return self.ranks[group_rank]

    # -- collectives ------------------------------------------------------------------------

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """Reduce `tensor` across the group, in place; returns it."""
        if self.size == 1:
            return tensor
        self._run("all_reduce", tensor, lambda: self.calls.all_reduce(tensor, op=_REDUCE_OPS[op], group=self.pg))
        return tensor

    def all_reduce_async(self, tensor: torch.Tensor, op: str = "sum") -> "Pending":
        """Start an in-place all-reduce of `tensor`; returns a handle whose wait() completes it."""
        if self.size == 1:
            return Pending(None, self, "all_reduce")
        return self._launch("all_reduce", tensor,
                            lambda: self.calls.all_reduce(tensor, op=_REDUCE_OPS[op], group=self.pg, async_op=True))

    def reduce_scatter_async(self, output: torch.Tensor, tensor: torch.Tensor, op: str = "sum") -> "Pending":
        """Start reducing the flat `tensor` (size x output.numel() elements) into this rank's `output`."""
        if self.size == 1:
            output.copy_(tensor.view_as(output))
            return Pending(None, self, "reduce_scatter")
        return self._launch("reduce_scatter", tensor, lambda: self.calls.reduce_scatter_single(
            output, tensor, op=_REDUCE_OPS[op], group=self.pg, async_op=True))

    def all_gather_async(self, output: torch.Tensor, tensor: torch.Tensor) -> "Pending":
        """Start gathering every rank's flat `tensor` into `output` (size x tensor.numel() elements, rank order)."""
        if self.size == 1:
            output.copy_(tensor.view_as(output))
            return Pending(None, self, "all_gather")
        return self._launch("all_gather", output, lambda: self.calls.all_gather_single(output, tensor, group=self.pg,
                                                                                   async_op=True))

    def isend(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> "Pending":
        """Start sending `tensor` to group rank `dst`; keep `tensor` alive until wait().

        gloo matches messages by (peer, tag); NCCL ignores tags and matches in issue order."""
        return self._launch("send", tensor, lambda: self.calls.isend(tensor, self._global(dst), group=self.pg, tag=tag))

    def irecv(self, tensor: torch.Tensor, src: int, tag: int = 0) -> "Pending":
        """Start receiving into `tensor` from group rank `src`; the data is there after wait()."""
        return self._launch("recv", tensor, lambda: self.calls.irecv(tensor, self._global(src), group=self.pg, tag=tag))

    def all_gather(self, tensor: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """Concatenate every rank's `tensor` along `dim` (all equal shapes), in group-rank order."""
        if self.size == 1:
            return tensor
        dim = dim % tensor.dim()
        tensor = tensor.contiguous()
        out = torch.empty((self.size * tensor.shape[0],) + tuple(tensor.shape[1:]), dtype=tensor.dtype, device=tensor.device)
        self._run("all_gather", out, lambda: self.calls.all_gather_single(out, tensor, group=self.pg))
        if dim == 0:
            return out
        # [size*d0, ...] -> [size, d0, ..., d, ...] -> [d0, ..., size, d, ...] -> [d0, ..., size*d, ...]
        shape = list(tensor.shape)
        shape[dim] *= self.size
        return out.view((self.size,) + tuple(tensor.shape)).movedim(0, dim).reshape(shape)

    def reduce_scatter(self, tensor: torch.Tensor, dim: int = 0, op: str = "sum") -> torch.Tensor:
        """Reduce `tensor` across the group and keep this rank's slice of `dim` (which must divide)."""
        if self.size == 1:
            return tensor
        dim = dim % tensor.dim()
        if tensor.shape[dim] % self.size:
            raise ValueError(
                f"reduce_scatter on group '{self.name}': dimension {dim} of size {tensor.shape[dim]} "
                f"does not divide by the group size {self.size}"
            )
        out_shape = list(tensor.shape)
        out_shape[dim] //= self.size
        if dim != 0:
            # [..., size*d, ...] -> [size, ..., d, ...] so that each rank's slice is one contiguous block
            split = list(tensor.shape)
            split[dim : dim + 1] = [self.size, out_shape[dim]]
            tensor = tensor.reshape(split).movedim(dim, 0).reshape([self.size * out_shape[0]] + out_shape[1:])
        tensor = tensor.contiguous()
        out = torch.empty(out_shape, dtype=tensor.dtype, device=tensor.device)
        self._run("reduce_scatter", tensor,
                  lambda: self.calls.reduce_scatter_single(out, tensor, op=_REDUCE_OPS[op], group=self.pg))
        return out

    def all_to_all(self, tensor: torch.Tensor, send_sizes: list[int], recv_sizes: list[int]) -> torch.Tensor:
        """Send rows [sum(send_sizes[:r]), sum(send_sizes[:r+1])) of `tensor` to group rank r and receive
        recv_sizes[r] rows from it; returns the received rows, in group-rank order (split sizes may differ)."""
        if self.size == 1:
            return tensor
        tensor = tensor.contiguous()
        out = tensor.new_empty((sum(recv_sizes),) + tuple(tensor.shape[1:]))
        self._run("all_to_all", tensor, lambda: self.calls.all_to_all_single(
            out, tensor, output_split_sizes=list(recv_sizes), input_split_sizes=list(send_sizes), group=self.pg))
        return out

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Copy group rank `src`'s `tensor` into every rank's `tensor`, in place."""
        if self.size == 1:
            return tensor
        self._run("broadcast", tensor, lambda: self.calls.broadcast(tensor, self._global(src), group=self.pg))
        return tensor

    def reduce(self, tensor: torch.Tensor, dst: int = 0, op: str = "sum") -> torch.Tensor:
        """Reduce `tensor` onto group rank `dst` (in place there; other ranks' buffers are undefined after)."""
        if self.size == 1:
            return tensor
        self._run("reduce", tensor, lambda: self.calls.reduce(tensor, self._global(dst), op=_REDUCE_OPS[op], group=self.pg))
        return tensor

    def scatter(self, tensor: torch.Tensor | None, src: int = 0, dim: int = 0, shape=None, dtype=None, device=None):
        """Split `tensor` (given on `src`) along `dim` and give each rank its chunk.

        Ranks other than `src` pass ``tensor=None`` together with the chunk's `shape`, `dtype`, `device`.
        """
        if self.size == 1:
            return tensor
        if self.rank == src:
            chunks = [c.contiguous() for c in tensor.chunk(self.size, dim)]
            out = torch.empty_like(chunks[0])
            full = tensor
        else:
            chunks = None
            out = torch.empty(shape, dtype=dtype, device=device)
            full = out
        self._run(
            "scatter",
            full,
            lambda: self.calls.scatter(out, chunks, src=self._global(src), group=self.pg),
            elements=out.numel() * self.size,
        )
        return out

    def gather(self, tensor: torch.Tensor, dst: int = 0, dim: int = 0) -> torch.Tensor | None:
        """Concatenate every rank's `tensor` along `dim` on group rank `dst`; other ranks get None."""
        if self.size == 1:
            return tensor
        tensor = tensor.contiguous()
        bufs = [torch.empty_like(tensor) for _ in range(self.size)] if self.rank == dst else None
        self._run(
            "gather",
            tensor,
            lambda: self.calls.gather(tensor, bufs, dst=self._global(dst), group=self.pg),
            elements=tensor.numel() * self.size,
        )
        return torch.cat(bufs, dim) if bufs is not None else None

    def send(self, tensor: torch.Tensor, dst: int) -> None:
        """Send `tensor` to group rank `dst` (blocking)."""
        tensor = tensor.contiguous()
        self._run("send", tensor, lambda: self.calls.send(tensor, self._global(dst), group=self.pg))

    def recv(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        """Receive into `tensor` from group rank `src` (blocking); returns it."""
        self._run("recv", tensor, lambda: self.calls.recv(tensor, self._global(src), group=self.pg))
        return tensor

    def barrier(self) -> None:
        if self.size == 1:
            return
        marker = torch.zeros(1)
        self._run("barrier", marker, lambda: dist.barrier(group=self.pg), elements=0)

    def all_gather_object(self, obj) -> list:
        """Every rank's picklable `obj`, in group-rank order (for logs and small metadata, not tensors)."""
        if self.size == 1:
            return [obj]
        out = [None] * self.size
        marker = torch.zeros(0)
        self._run("all_gather_object", marker, lambda: dist.all_gather_object(out, obj, group=self.pg))
        return out


class Pending:
    """A started collective: `wait()` blocks until it completes, turning failures into CollectiveError (naming the
    rank, the operation and the group, as the blocking collectives do). With the stats' timing on, the seconds
    spent blocked in `wait()` are added to the operation's (its call was counted when it started)."""

    def __init__(self, work, group: Group, op: str, device=None, entry: dict | None = None):
        self.work, self.group, self.op, self.device, self.entry = work, group, op, device, entry

    def wait(self) -> None:
        if self.work is None:
            return
        stats = self.group.stats
        cuda = stats.timing and self.device is not None and self.device.type == "cuda"
        t0 = time.perf_counter()
        try:
            self.work.wait()
        except Exception as e:
            timeout = self.group.timeout
            limit = f" (timeout {timeout.total_seconds():.0f}s)" if timeout else ""
            what = (f"failed after waiting {time.perf_counter() - t0:.1f}s{limit}: a peer never arrived or broke off. "
                    f"Cause: {_cause(e)}")
            if self.entry is None:
                raise self.group.failure(self.op, what) from e
            raise self.group._failed(self.entry, self.op, what) from e
        if self.entry is not None:
            FlightRecorder.end(self.entry)
        if stats.timing:
            if cuda:
                torch.cuda.synchronize(self.device)
            stats.add_seconds(self.op, self.group.name, time.perf_counter() - t0)
        self.work = None


def keep_collectives_eager() -> None:
    """Make torch.compile leave every collective of this module to run eagerly, as a graph break, never traced
    into a compiled graph: wraps `Group._run`, `Group._launch` and `Pending.wait` in `torch.compiler.disable`.
    Called by `tensorpar.models.compile` before compiling (idempotent). Not done at import: the decorator
    imports torch._dynamo, which costs every process that never compiles 1.4 s of start-up here."""
    for cls, name in ((Group, "_run"), (Group, "_launch"), (Pending, "wait")):
        fn = cls.__dict__[name]
        if not getattr(fn, "_tensorpar_eager", False):
            eager = torch.compiler.disable(fn)
            eager._tensorpar_eager = True
            setattr(cls, name, eager)


def as_group(x, name: str = "tp") -> Group:
    """Accept a Mesh (its `<name>_group`), a Group, a torch ProcessGroup, or None (a one-rank group)."""
    if x is None:
        return Group.single(name)
    if isinstance(x, Group):
        return x
    mesh_group = getattr(x, f"{name}_group", None)
    if isinstance(mesh_group, Group):
        return mesh_group
    if isinstance(x, dist.ProcessGroup):
        return Group.from_process_group(x, name)
    raise TypeError(f"expected a Mesh, a tensorpar Group, a torch ProcessGroup or None, got {type(x).__name__}")
