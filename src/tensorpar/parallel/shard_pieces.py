"""What ZeRO-1/2/3 share: a rank's 1/dp slice of a flat parameter buffer, cut into optimizer parameters.

A flat buffer (a ZeRO-1/2 gradient bucket, a ZeRO-3 unit) holds several parameters end to end, padded to a
multiple of dp; rank r owns elements [r * padded/dp, (r+1) * padded/dp). The optimizer steps one fp32
parameter per *piece* of an original parameter that falls in the slice, so that weight decay, the gradient
norm's TP weighting and the pipeline's duplicate flag follow the original parameter. Checkpoints store AdamW
moments in the layout of the whole local (TP-sharded) parameters, whatever the ZeRO stage: `gather_moments`
and `load_moments` convert.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from tensorpar.layers.sharding import shard_spec, tag
from tensorpar.optim.adamw import takes_weight_decay

MOMENTS = ("exp_avg", "exp_avg_sq")


@dataclasses.dataclass
class Piece:
    """The part [lo, hi) (flat-buffer offsets) of `param` (which starts at `offset`) that this rank steps."""

    opt_param: nn.Parameter  # a view of the flat master slice; its .grad a view of the gradient slice
    lo: int
    hi: int
    param: nn.Parameter
    offset: int


def slice_bounds(padded: int, rank: int, size: int) -> tuple[int, int]:
    per_rank = padded // size
    return rank * per_rank, (rank + 1) * per_rank


def cut_pieces(params, shapes, offsets, lo_b: int, hi_b: int, master: torch.Tensor, grad_shard: torch.Tensor,
               groups: list[dict]) -> list[Piece]:
    """The pieces of `params` (of `shapes`, at `offsets` in a flat buffer) inside this rank's slice [lo_b, hi_b),
    whose master is `master` and gradient `grad_shard`; each is appended to `groups` (0: weight decay, 1: none)."""
    pieces = []
    for p, shape, offset in zip(params, shapes, offsets):
        lo, hi = max(offset, lo_b), min(offset + shape.numel(), hi_b)
        if lo >= hi:
            continue
        piece = nn.Parameter(master[lo - lo_b : hi - lo_b])
        piece.grad = grad_shard[lo - lo_b : hi - lo_b]
        tag(piece, shard_spec(p))
        if getattr(p, "pipeline_duplicate", False):
            piece.pipeline_duplicate = True
        groups[0 if takes_weight_decay(shape) else 1]["params"].append(piece)
        pieces.append(Piece(piece, lo, hi, p, offset))
    return pieces


def gather_moments(buffers, optimizer, dp_group, names: dict[int, str], shapes: dict | None = None,
                   with_master: bool = False) -> dict:
    """{parameter name: {"exp_avg", "exp_avg_sq"}} of every parameter of `buffers` (each with .pieces, .padded,
    .offsets, .params, .master), all-gathered over `dp_group` (a collective). ``with_master``: also "master",
    the fp32 master weights (which bf16/fp16 training saves as the parameters)."""
    shapes = shapes or {}
    out = {}
    for b in buffers:
        lo_b, _ = slice_bounds(b.padded, dp_group.rank, dp_group.size)
        full = {}
        for key in MOMENTS + (("master",) if with_master else ()):
            local = torch.zeros_like(b.master)
            for piece in b.pieces:
                state = optimizer.state.get(piece.opt_param, {})
                if key == "master":
                    local[piece.lo - lo_b : piece.hi - lo_b].copy_(piece.opt_param.detach())
                elif key in state:
                    local[piece.lo - lo_b : piece.hi - lo_b].copy_(state[key])
            full[key] = torch.empty(b.padded, dtype=b.master.dtype, device=b.master.device)
            dp_group.all_gather_async(full[key], local).wait()
        for p, offset in zip(b.params, b.offsets):
            shape = shapes.get(id(p), p.shape)
            out[names[id(p)]] = {k: v[offset : offset + shape.numel()].view(shape).clone() for k, v in full.items()}
    return out


def load_moments(buffers, optimizer, states: dict, step: int, names: dict[int, str]) -> None:
    """Set the AdamW moments of every piece from `states` (the layout `gather_moments` returns) and the step, and
    the fp32 master weights from "master" where given (the checkpoint's fp32 parameters)."""
    step_tensor = torch.tensor(float(step))
    for b in buffers:
        for piece in b.pieces:
            st = states[names[id(piece.param)]]
            if "master" in st:
                with torch.no_grad():
                    piece.opt_param.copy_(st["master"].flatten()[piece.lo - piece.offset : piece.hi - piece.offset])
            optimizer.state[piece.opt_param] = {
                "step": step_tensor.clone(),
                **{k: st[k].flatten()[piece.lo - piece.offset : piece.hi - piece.offset].to(piece.opt_param).clone()
                   for k in MOMENTS},
            }


def adamw_step_count(optimizer) -> int:
    step = 0
    for st in optimizer.state.values():
        step = int(st["step"]) if "step" in st else step
    return step


def state_bytes(optimizer) -> int:
    """Bytes of optimizer state (AdamW moments) held by this rank."""
    return sum(t.numel() * t.element_size() for s in optimizer.state.values()
               for t in s.values() if torch.is_tensor(t) and t.dim() > 0)


class ReduceScatterQueue:
    """Gradient reduce-scatters in flight, each summed into its buffer's `grad_shard` when it completes.

    A flat gradient buffer is handed over the moment a micro-batch's backward has filled it; the queue starts
    its reduce-scatter asynchronously and keeps at most `depth` in flight (waiting for the oldest first),
    so that only a few full-size gradient buffers ever exist at once: the ZeRO-2/3 gradient memory. With depth 1
    (the default) one buffer is being reduce-scattered while the next is filled by the backward."""

    def __init__(self, dp_group, grad_bytes: "BytesInUse", depth: int = 1):
        self.dp, self.depth, self.grad_bytes = dp_group, depth, grad_bytes
        self._inflight: list = []

    def push(self, buffer, full_grad: torch.Tensor, group=None) -> None:
        """Reduce-scatter `full_grad` (counted in `grad_bytes` by the caller) into `buffer.grad_shard` over `group`
        (default: the queue's DP group); the queue releases it."""
        group = group or self.dp
        while len(self._inflight) >= self.depth:
            self._complete(self._inflight.pop(0))
        out = torch.empty(full_grad.numel() // group.size, dtype=full_grad.dtype, device=full_grad.device)
        self.grad_bytes.add(nbytes(out))
        self._inflight.append((buffer, out, group.reduce_scatter_async(out, full_grad), full_grad))

    def drain(self) -> None:
        while self._inflight:
            self._complete(self._inflight.pop(0))

    def _complete(self, item) -> None:
        buffer, out, work, full_grad = item  # the full gradient is referenced until here: the collective reads it
        work.wait()
        buffer.grad_shard.add_(out.to(buffer.grad_shard.dtype))
        self.grad_bytes.sub(nbytes(out) + nbytes(full_grad))


def add_to_flat(flat: torch.Tensor, param: torch.Tensor, offset: int) -> None:
    """Add `param`'s gradient into its place in a flat gradient buffer and drop the parameter's own."""
    flat[offset : offset + param.grad.numel()].add_(param.grad.detach().flatten())
    param.grad = None


class BytesInUse:
    """Bytes of some kind of buffer alive now, and the most alive at once since `reset_peak()`."""

    def __init__(self, now: int = 0):
        self.now = self.peak = now

    def add(self, nbytes: int) -> None:
        self.now += nbytes
        self.peak = max(self.peak, self.now)

    def sub(self, nbytes: int) -> None:
        self.now -= nbytes

    def reset_peak(self) -> None:
        self.peak = self.now


def nbytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()
