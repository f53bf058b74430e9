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

from tensorpar.distributed.sharding import shard_spec, tag
from tensorpar.optim.adamw import takes_weight_decay



@dataclasses.dataclass
class Piece:
    """The part [lo, hi) (flat-buffer offsets) of `param` (which starts at `offset`) that this rank steps."""

    opt_param: nn.Parameter  # a view of the flat master slice; its .grad a view of the gradient slice
    lo: int
    hi: int
    param: nn.Parameter
    offset: int


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
        tag(piece, shard_spec(p))  # the TP layout and the pipeline's facts follow the original parameter
        groups[0 if takes_weight_decay(shape) else 1]["params"].append(piece)
        pieces.append(Piece(piece, lo, hi, p, offset))
    return pieces


def _kinds(optimizer, names: dict[int, str], buffer) -> dict[int, tuple[str, ...]]:
    """What each parameter of `buffer` keeps (`optimizer.kinds_of`), by parameter id."""
    return {id(p): optimizer.kinds_of(names[id(p)], shape) for p, shape in zip(buffer.params, buffer.shapes)}


def gather_moments(slices, optimizer, dp_group, names: dict[int, str], with_master: bool = False) -> dict:
    """{parameter name: its optimizer state (AdamW's "exp_avg", "exp_avg_sq"; Muon's "momentum_buffer")} of every
    parameter of the master `slices` (each a `MasterSlice` of a flat buffer sharded over `dp_group`), all-gathered
    over `dp_group` (a collective). ``with_master``: also "master", the fp32 master weights (which bf16/fp16
    training saves as the parameters)."""
    out = {}
    for s in slices:
        b, lo_b = s.buffer, s.lo
        kinds = _kinds(optimizer, names, b)
        full = {}
        for key in dict.fromkeys(k for ks in kinds.values() for k in ks + (("master",) if with_master else ())):
            local = torch.zeros_like(s.grad_shard)  # fp32, on the device (an offloaded master is on the host)
            for piece in s.pieces:
                state = optimizer.state.get(piece.opt_param, {})
                if key == "master":
                    local[piece.lo - lo_b : piece.hi - lo_b].copy_(piece.opt_param.detach())
                elif key in state:
                    local[piece.lo - lo_b : piece.hi - lo_b].copy_(state[key])
            full[key] = torch.empty(b.padded, dtype=local.dtype, device=local.device)
            dp_group.all_gather_async(full[key], local).wait()
        for p, offset, shape in zip(b.params, b.offsets, b.shapes):
            keep = kinds[id(p)] + (("master",) if with_master else ())
            out[names[id(p)]] = {k: full[k][offset : offset + shape.numel()].view(shape).clone() for k in keep}
    return out


def load_moments(slices, optimizer, states: dict, step: int, names: dict[int, str]) -> None:
    """Set the optimizer state of every piece from `states` (the layout `gather_moments` returns; a kind the
    checkpoint lacks starts at zeros: it was saved by another optimizer) and the step, and the fp32 master weights
    from "master" where given (the checkpoint's fp32 parameters)."""
    for s in slices:
        kinds = _kinds(optimizer, names, s.buffer)
        for piece in s.pieces:
            st = states[names[id(piece.param)]]
            part = slice(piece.lo - piece.offset, piece.hi - piece.offset)
            if "master" in st:
                with torch.no_grad():
                    piece.opt_param.copy_(st["master"].flatten()[part])
            optimizer.state[piece.opt_param] = {
                "step": optimizer.new_step(piece.opt_param, step),
                **{k: (st[k].flatten()[part].to(piece.opt_param).clone() if k in st
                       else torch.zeros_like(piece.opt_param)) for k in kinds[id(piece.param)]},
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
