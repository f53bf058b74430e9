"""Muon's orthogonalisation of whole matrices when a rank holds only pieces of them: its TP shard (tensor
parallelism) and, under ZeRO-1/2/3, its 1/dp slice of the flat buffer the shard sits in.

Each Muon matrix has one owner among the TP x ZeRO-group ranks that share its buffer (greedily balanced by the
matrix's Newton-Schulz cost, the same on every rank): only the owner orthogonalises it, as Megatron's and
torchtitan's distributed Muon do. Per flat buffer (a ZeRO-1/2 bucket, a ZeRO-3 unit) holding Muon matrices:

==================================  =======================================================================
collective                          what it carries
==================================  =======================================================================
all-gather over the ZeRO group      every rank's slice of the Nesterov directions -> the TP shard's buffer
all-gather over TP                  the TP shards' buffers -> every rank can build any of the buffer's matrices
(the owner: Newton-Schulz)          the whole matrix, assembled in the dense model's order (`join_shards`)
reduce-scatter over TP              each TP rank's shard of the orthogonalised matrices (only the owner's
                                    contribution is not zero: the sum is exact)
reduce-scatter over the ZeRO group  each rank's slice of it, which its pieces step
==================================  =======================================================================

So each matrix is gathered to and scattered from its owner at the bytes of two all-gathers and two
reduce-scatters of the buffer (fp32), per optimizer step; a rank holds one TP group's copy of one buffer at a time
(tp x the buffer), and does 1 / (tp x ZeRO group) of the Newton-Schulz work instead of all of it. Without ZeRO
the ZeRO group is one rank: the DP replicas orthogonalise the same matrices (their gradients are the same).
Buffers without a Muon matrix (the embedding's, the head's) take no part.
"""

from __future__ import annotations

import dataclasses

import torch

from tensorpar.data_parallel.host_masters import HostMasterWeights, HostStep
from tensorpar.data_parallel.shard_pieces import Piece
from tensorpar.distributed.comm import Group
from tensorpar.distributed.sharding import join_shards, shard_spec, shard_tensor
from tensorpar.errors import TensorparError
from tensorpar.models.state import dense_shape
from tensorpar.optim.adamw import adamw
from tensorpar.optim.muon import Muon, newton_schulz, uses_muon


@dataclasses.dataclass
class FlatSlice:
    """A rank's [lo, hi) of a flat buffer sharded over `group`, and the optimizer pieces cut from it (what
    `MasterSlice` is; also built for parameters stepped in place, over a group of one)."""

    buffer: object
    group: object
    lo: int
    hi: int
    pieces: list[Piece]


def whole_parameters(buckets) -> list[FlatSlice]:
    """Parameters stepped in place (ZeRO-0, fp32): each bucket whole, each parameter its own piece."""
    return [FlatSlice(b, Group.single("dp"), 0, b.padded,
                      [Piece(p, off, off + p.numel(), p, off) for p, off in zip(b.params, b.offsets)])
            for b in buckets]


@dataclasses.dataclass
class _Matrix:
    offset: int
    shape: torch.Size  # this TP rank's shard
    spec: object
    dense: tuple[int, ...]
    owner: int = 0  # tp_rank + tp * zero_rank of the rank that orthogonalises it


class ShardedMatrices:
    """Muon's orthogonaliser over TP shards and ZeRO slices (see the module)."""

    def __init__(self, slices: list, tp_group, names: dict[int, str], dtype: torch.dtype = torch.bfloat16):
        self.tp, self.dtype = tp_group, dtype
        self.work: list[tuple[object, list[_Matrix]]] = []
        self.shape_of: dict[int, tuple[int, ...]] = {}
        for s in slices:
            matrices = {}
            for p, off, shape in zip(s.buffer.params, s.buffer.offsets, s.buffer.shapes):
                if uses_muon(names[id(p)], shape):
                    spec = shard_spec(p)
                    matrices[id(p)] = _Matrix(off, shape, spec, dense_shape(torch.empty(shape, device="meta"), spec))
            for piece in s.pieces:
                if id(piece.param) in matrices:
                    self.shape_of[id(piece.opt_param)] = matrices[id(piece.param)].dense
            if matrices:
                self.work.append((s, list(matrices.values())))
        self._assign_owners()

    def _assign_owners(self) -> None:
        """Greedy: the costliest matrices first, each to the least loaded rank (ties: the lowest)."""
        everything = [m for _, matrices in self.work for m in matrices]
        slots = self.tp.size * max((s.group.size for s, _ in self.work), default=1)
        load = [0] * slots
        for m in sorted(everything, key=lambda m: -m.dense[0] * m.dense[1] * min(m.dense)):
            m.owner = load.index(min(load))
            load[m.owner] += m.dense[0] * m.dense[1] * min(m.dense)

    def dense_shape(self, piece: torch.Tensor) -> tuple[int, ...]:
        return self.shape_of[id(piece)]

    def __call__(self, directions: dict[torch.Tensor, torch.Tensor]) -> dict[torch.Tensor, torch.Tensor]:
        """{piece: its part of the orthogonalised whole matrix} for every piece in `directions` (a collective over
        TP and the ZeRO group: every rank calls it)."""
        out = {}
        for s, matrices in self.work:
            mine = self._orthogonalize(s, matrices, directions)
            for piece in s.pieces:
                if piece.opt_param in directions:
                    out[piece.opt_param] = mine[piece.lo - s.lo : piece.hi - s.lo]
        return out

    def _orthogonalize(self, s, matrices: list[_Matrix], directions: dict) -> torch.Tensor:
        """This rank's slice [lo, hi) of the buffer of orthogonalised matrices (zeros elsewhere)."""
        local = torch.zeros(s.hi - s.lo, dtype=torch.float32, device=s.pieces[0].opt_param.device if s.pieces
                            else s.buffer.params[0].device)
        for piece in s.pieces:
            if piece.opt_param in directions:
                local[piece.lo - s.lo : piece.hi - s.lo] = directions[piece.opt_param].flatten()
        tp = self.tp.size
        parts = self.tp.all_gather(s.group.all_gather(local).unsqueeze(0))  # [tp, padded]
        result = torch.zeros_like(parts)
        me = self.tp.rank + tp * s.group.rank
        for m in matrices:
            if m.owner != me:
                continue
            n = m.shape.numel()
            whole = newton_schulz(join_shards([parts[t, m.offset : m.offset + n].view(m.shape) for t in range(tp)],
                                              m.spec), dtype=self.dtype)
            for t in range(tp):
                result[t, m.offset : m.offset + n] = shard_tensor(whole, m.spec, t, tp).flatten()
        return s.group.reduce_scatter(self.tp.reduce_scatter(result)[0])


def step_rule(model, mesh, weights, slices: list, optimizer: str, *, lr: float, betas, eps: float,
              momentum: float = 0.95, state_dtype: torch.dtype = torch.float32):
    """What steps the weights' pieces: AdamW over their groups (its moments in `state_dtype`; over host masters a
    `HostStep`), or Muon over the hidden matrices' pieces (through a `ShardedMatrices`; Newton-Schulz in fp32 for
    fp32 parameters, else bf16) and AdamW over the rest."""
    groups = weights.param_groups()
    if optimizer == "adamw":
        rule = adamw(groups, lr=lr, betas=betas, eps=eps, state_dtype=state_dtype)
        return HostStep(rule, weights) if isinstance(weights, HostMasterWeights) else rule
    if isinstance(weights, HostMasterWeights) or state_dtype != torch.float32:
        raise TensorparError("--optimizer-offload and --optimizer-state-dtype bf16 apply to AdamW only")
    names = {id(p): n for n, p in model.named_parameters()}
    fp32 = all(p.dtype == torch.float32 for p in model.parameters())
    ns_dtype = torch.float32 if fp32 else torch.bfloat16
    shapes = {id(p): shape for s in slices for p, shape in zip(s.buffer.params, s.buffer.shapes)}
    muon = {id(piece.opt_param) for s in slices for piece in s.pieces
            if uses_muon(names[id(piece.param)], shapes[id(piece.param)])}
    adam_groups = [{**g, "params": [p for p in g["params"] if id(p) not in muon]} for g in groups]
    muon_group = {"params": [p for g in groups for p in g["params"] if id(p) in muon], "muon": True,
                  "weight_decay": groups[0].get("weight_decay", 0.0)}
    return Muon(adam_groups + [muon_group], lr=lr, betas=betas, eps=eps, momentum=momentum,
                orthogonalize=ShardedMatrices(slices, mesh.tp_group, names, ns_dtype))
