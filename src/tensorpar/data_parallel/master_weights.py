"""What AdamW steps, and in which precision: the piece of data parallelism that every ZeRO stage uses.

- `MasterWeights`: fp32 master copies of flat-buffer slices (a rank's 1/dp of each bucket or unit under ZeRO; the
  whole bucket for bf16/fp16 parameters without ZeRO), each cut into one optimizer parameter per piece of an
  original parameter (`shard_pieces.cut_pieces`), with an fp32 gradient slice beside it. After a step the stage
  brings the masters back into the parameters: a copy (`MasterSlice.write_back`, ZeRO-0 and ZeRO-3) or an
  all-gather of the cast slices (ZeRO-1/2).
- `ModelWeights`: fp32 parameters without ZeRO: AdamW steps the parameters themselves, no copy.

Both give checkpoints the AdamW moments in the layout of the local (TP-sharded) parameters, whatever the stage.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from tensorpar.data_parallel.flat_buffer import FlatBuffer, nbytes
from tensorpar.data_parallel.shard_pieces import Piece, cut_pieces, gather_moments, load_moments
from tensorpar.optim.adamw import takes_weight_decay


def _decay_groups(weight_decay: float) -> list[dict]:
    return [{"params": [], "weight_decay": weight_decay}, {"params": [], "weight_decay": 0.0}]


def _param_groups(groups: list[dict]) -> list[dict]:
    """The groups that hold parameters (a rank whose slices hold none gets one empty parameter: AdamW wants one)."""
    return [g for g in groups if g["params"]] or [{"params": [nn.Parameter(torch.zeros(0))]}]


@dataclasses.dataclass
class MasterSlice:
    """A rank's slice [lo, hi) of a flat buffer sharded over `group` (a group of one: the whole buffer)."""

    buffer: FlatBuffer
    group: object
    lo: int
    hi: int
    values: torch.Tensor  # the parameters' values of the slice, in their dtype
    master: torch.Tensor  # fp32, what AdamW steps: `values` itself when those are fp32 and may be stepped in place
    grad_shard: torch.Tensor  # fp32, the master's gradient
    pieces: list[Piece]

    @property
    def separate(self) -> bool:
        """The master is a copy, not the values themselves."""
        return self.master is not self.values

    def write_back(self) -> None:
        """The stepped master into the values (cast to their dtype)."""
        if self.separate:
            self.values.copy_(self.master)

    def reload(self) -> None:
        """The values into the master (after the parameters were overwritten: a checkpoint load)."""
        if self.separate:
            self.master.copy_(self.values)


class MasterWeights:
    """fp32 master slices of flat buffers and the optimizer parameters cut from them."""

    def __init__(self, weight_decay: float):
        self.groups = _decay_groups(weight_decay)
        self.slices: list[MasterSlice] = []

    def add(self, buffer: FlatBuffer, values: torch.Tensor, group, grad_shard: torch.Tensor | None = None,
            in_place: bool = False) -> MasterSlice:
        """The master slice of `buffer` whose values (this rank's slice over `group`) are `values`: an fp32 copy,
        or with ``in_place`` and fp32 values the values themselves; its gradient `grad_shard`, or new zeros."""
        lo, hi = buffer.slice_bounds(group)
        master = values if in_place and values.dtype == torch.float32 else values.detach().clone().float()
        grad_shard = torch.zeros_like(master) if grad_shard is None else grad_shard
        pieces = cut_pieces(buffer.params, buffer.shapes, buffer.offsets, lo, hi, master, grad_shard, self.groups)
        self.slices.append(MasterSlice(buffer, group, lo, hi, values, master, grad_shard, pieces))
        return self.slices[-1]

    @property
    def params(self) -> list[nn.Parameter]:
        """What the optimizer steps (and the gradient norm is taken over)."""
        return [piece.opt_param for s in self.slices for piece in s.pieces]

    def param_groups(self) -> list[dict]:
        return _param_groups(self.groups)

    def nonfinite(self) -> list[nn.Parameter]:
        """The model parameters a piece of whose gradient (in this rank's slices) is NaN or Inf, in slice order."""
        found = {id(p.param): p.param for s in self.slices for p in s.pieces
                 if not bool(torch.isfinite(p.opt_param.grad).all())}
        return list(found.values())

    def reload(self) -> None:
        """The parameters' values into the masters (after a checkpoint load overwrote them)."""
        for s in self.slices:
            s.reload()

    def master_bytes(self) -> int:
        """Bytes of the fp32 masters that are copies."""
        return sum(nbytes(s.master) for s in self.slices if s.separate)

    def local_state(self, optimizer, names: dict[int, str], with_master: bool) -> dict:
        """AdamW moments (and with ``with_master`` the fp32 masters) of the local parameters, all-gathered over each
        slice's group: the dense buffers', then the experts' (a collective)."""
        out = {}
        for group in dict.fromkeys(s.group for s in self.slices):
            out.update(gather_moments([s for s in self.slices if s.group is group], optimizer, group, names,
                                      with_master=with_master))
        return out

    def load_local_state(self, optimizer, states: dict, step: int, names: dict[int, str]) -> None:
        load_moments(self.slices, optimizer, states, step, names)


class ModelWeights:
    """fp32 parameters stepped in place (no ZeRO, no master copy)."""

    def __init__(self, params: list[nn.Parameter], weight_decay: float):
        self.params = params
        self.groups = _decay_groups(weight_decay)
        for p in params:
            self.groups[0 if takes_weight_decay(p) else 1]["params"].append(p)

    def param_groups(self) -> list[dict]:
        return _param_groups(self.groups)

    def master_bytes(self) -> int:
        return 0

    def nonfinite(self) -> list[nn.Parameter]:
        """The parameters whose gradient is NaN or Inf."""
        return [p for p in self.params if p.grad is not None and not bool(torch.isfinite(p.grad).all())]

    def local_state(self, optimizer, names: dict[int, str], with_master: bool = False) -> dict:
        out = {}
        for p in self.params:
            st = optimizer.state.get(p, {})
            out[names[id(p)]] = {k: (st[k].clone() if k in st else torch.zeros_like(p))
                                 for k in optimizer.kinds_of(names[id(p)], p.shape)}
        return out

    def load_local_state(self, optimizer, states: dict, step: int, names: dict[int, str]) -> None:
        """The optimizer state of every parameter from `states` (a kind the checkpoint lacks starts at zeros)."""
        for p in self.params:
            st = states[names[id(p)]]
            optimizer.state[p] = {"step": optimizer.new_step(p, step),
                                  **{k: st[k].to(p).clone() if k in st else torch.zeros_like(p)
                                     for k in optimizer.kinds_of(names[id(p)], p.shape)}}

    def reload(self) -> None:
        pass
