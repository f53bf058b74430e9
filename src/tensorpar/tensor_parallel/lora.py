"""Low-rank adapters (LoRA, Hu et al. 2021) on the column- and row-parallel linears, sharded as their base layer.

    y = x W^T + b + s * dropout(x) A^T B^T,   s = alpha / r

W (and b) frozen, A [r, in] and B [out, r] trained: PEFT's layout and names (`q_proj.lora_A.weight`,
`q_proj.lora_B.weight`), A drawn as nn.Linear draws its weight and B zero, so training starts from the base model.

**Column-parallel base** (q, k, v, gate, up: W split by output features): A replicated, B split by output features as
W is (a KV projection's B replicated on the ranks that share its KV heads, as W is). The down-projection runs before
the region's entry, on the activation as it is there (replicated, or under SP this rank's sequence shard), so that
only its r-wide result enters the region, with one entry for all the adapters of layers that share an input:

    u_i = dropout(x) A_i^T             local; under SP A_i's gradient is summed over TP (each rank saw its shard)
    [u_i] = entry([u_i])               copy_to_tp (f), or under SP gather_from_sp: [T, n r]
    y_i += s * u_i B_i^T               local: B_i holds this rank's output features

**Row-parallel base** (o, down: W split by input features): A split by input features as W is, B replicated. This
rank's down-projection of its input features is a partial sum, summed over TP by the region's `reduce`:

    u = reduce(dropout(x_r) A_r^T)     all-reduce (g), or under SP reduce-scatter: [T, r]
    y += s * u B^T                     local; under SP B's gradient is summed over TP

The collectives per group of adapted layers and micro-batch (T tokens of the micro-batch, n adapters sharing an
input), besides the base layers' own:

============  =====================================  ===================================================
adapters on   forward                                backward
============  =====================================  ===================================================
column        none / SP: all-gather [T, n r]         all-reduce [T, n r] / SP: reduce-scatter [T, n r]
                                                     and all-reduce of each A's gradient [r, in]
row           all-reduce [T, r] / SP: reduce-        none / SP: all-gather [T, r] and all-reduce of B's
              scatter [T, r]                         gradient [out, r]
============  =====================================  ===================================================

r / hidden of the base layers' own traffic. The other layout, the down-projection run on the entered input, saves
the column adapters' entry but needs that input, which the overlapped entry (`tp_overlap`) never materialises, and
an all-reduce of every A's gradient (each rank's output features contribute part of it) with or without SP.
Both layouts keep the base layer's GEMMs, its overlap and its fp8 untouched: the adapters' products run in the
compute dtype (`TPRegion.without_fp8`), and under a split backward (zero-bubble schedules) their weight gradients go
to the queue like any other.

Dropout: a column adapter's mask is drawn on the activation before the entry (the same on every TP rank, or per
sequence shard under SP); a row adapter's inside the region, per TP rank; each adapter its own, from the
micro-batch's dropout seed, its layer and projection, as every dropout site in tensorpar.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import torch
from torch import nn

from tensorpar.config.choices import LORA_TARGETS
from tensorpar.config.lora_options import LoraShapeOptions
from tensorpar.distributed.sharding import ShardSpec, tag
from tensorpar.errors import TensorparError
from tensorpar.functional.dropout import mix_seed, seeded_dropout
from tensorpar.tensor_parallel.region import Projection, TPRegion

ADAPTER_FACTORS = ("lora_A", "lora_B")


@dataclasses.dataclass(frozen=True)
class LoraSpec:
    """A run's adapters: their rank r, alpha (the product is scaled by alpha / r), the linears they sit on (of
    `LORA_TARGETS`) and the dropout on their input."""

    rank: int
    alpha: float
    targets: tuple[str, ...] = LORA_TARGETS
    dropout: float = 0.0

    def __post_init__(self):
        if self.rank < 1:
            raise TensorparError(f"the LoRA rank must be at least 1, got {self.rank}")
        unknown = [t for t in self.targets if t not in LORA_TARGETS]
        if unknown or not self.targets:
            raise TensorparError(f"LoRA targets must be a non-empty list of {', '.join(LORA_TARGETS)}; got "
                                 f"{','.join(self.targets) or 'none'}")
        if not 0.0 <= self.dropout < 1.0:
            raise TensorparError(f"the LoRA dropout must be in [0, 1), got {self.dropout}")
        if not 0.0 < self.alpha < float("inf"):  # NaN too
            raise TensorparError(f"the LoRA alpha must be a positive number (the adapters' product is scaled by alpha "
                                 f"/ rank: at 0 they would change nothing), got {self.alpha}")

    @classmethod
    def parse(cls, rank: int, alpha: float | None, targets: str, dropout: float) -> "LoraSpec":
        """From the flags: --lora-alpha defaults to the rank, --lora-targets is comma-separated."""
        names = tuple(dict.fromkeys(t.strip() for t in targets.split(",") if t.strip()))
        return cls(rank, float(rank if alpha is None else alpha), names, dropout)

    @classmethod
    def of_options(cls, o: LoraShapeOptions) -> "LoraSpec | None":
        """The adapters --lora-rank, --lora-alpha, --lora-targets and --lora-dropout ask for (train and plan), None
        without --lora-rank; the shape flags without it are refused, naming them."""
        if o.lora_rank < 0:
            raise TensorparError(f"--lora-rank must be 0 (no adapters) or at least 1, got {o.lora_rank}")
        if o.lora_rank:
            return cls.parse(o.lora_rank, o.lora_alpha, o.lora_targets, o.lora_dropout)
        given = shape_flags_given(o)
        if given:
            raise TensorparError(f"{', '.join(given)} set the LoRA adapters of --lora-rank R: give it too")
        return None

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    def as_dict(self) -> dict:
        return {"rank": self.rank, "alpha": self.alpha, "targets": list(self.targets), "dropout": self.dropout}

    @classmethod
    def from_dict(cls, d: dict) -> "LoraSpec":
        return cls(int(d["rank"]), float(d["alpha"]), tuple(d["targets"]), float(d.get("dropout", 0.0)))


_DEFAULTS = LoraShapeOptions()


def shape_flags_given(o: LoraShapeOptions) -> list[str]:
    """The adapters' flags given with a value other than their default, besides --lora-rank."""
    flags = (("lora_alpha", "--lora-alpha"), ("lora_targets", "--lora-targets"), ("lora_dropout", "--lora-dropout"))
    return [flag for name, flag in flags if getattr(o, name) != getattr(_DEFAULTS, name)]


@dataclasses.dataclass(frozen=True)
class LoraSite:
    """One adapted linear's adapter: the spec's numbers and the adapter's place (its dropout masks' seed)."""

    rank: int
    scaling: float
    dropout: float
    site: int


def lora_site(spec: LoraSpec | None, layer_index: int, target: str) -> LoraSite | None:
    """The adapter of projection `target` of layer `layer_index`, or None where `spec` puts none."""
    if spec is None or target not in spec.targets:
        return None
    return LoraSite(spec.rank, spec.scaling, spec.dropout, layer_index * len(LORA_TARGETS) + LORA_TARGETS.index(target))


def is_adapter(name: str) -> bool:
    """Whether parameter `name` is one of an adapter's factors (`....lora_A.weight`, `....lora_B.weight`)."""
    parts = name.split(".")
    return len(parts) >= 2 and parts[-2] in ADAPTER_FACTORS


class LoraFactor(nn.Module):
    """One factor of an adapter (`lora_A` or `lora_B`): its `weight`, tagged with how it is split."""

    def __init__(self, rows: int, cols: int, spec: ShardSpec, device=None):
        super().__init__()
        self.weight = tag(nn.Parameter(torch.empty(rows, cols, device=device)), spec)


def column_factors(lora: LoraSite, in_features: int, local_out: int, out_spec: ShardSpec, sequence_parallel: bool,
                   device=None) -> tuple[LoraFactor, LoraFactor]:
    """(A, B) of an adapter on a column-parallel layer: A [r, in] replicated (its gradient summed over TP under
    SP), B [out / tp, r] split as the layer's weight (`out_spec`)."""
    a = LoraFactor(lora.rank, in_features, ShardSpec(dim=None, reduce_grad_across_tp=sequence_parallel), device)
    return a, LoraFactor(local_out, lora.rank, out_spec, device)


def row_factors(lora: LoraSite, local_in: int, in_features: int, out_features: int, sequence_parallel: bool,
                device=None) -> tuple[LoraFactor, LoraFactor]:
    """(A, B) of an adapter on a row-parallel layer: A [r, in / tp] split by input features as the layer's weight,
    B [out, r] replicated (its gradient summed over TP under SP)."""
    a = LoraFactor(lora.rank, local_in, ShardSpec(dim=1, full_size=in_features, padded_size=in_features), device)
    return a, LoraFactor(out_features, lora.rank, ShardSpec(dim=None, reduce_grad_across_tp=sequence_parallel),
                         device)


class Adapter(NamedTuple):
    """What a forward needs of one adapter: its factors, scale, dropout and site; `grad_reduce` is applied to B's
    gradient (a KV projection's, summed over the ranks that share its heads)."""

    a: torch.Tensor
    b: torch.Tensor
    lora: LoraSite
    training: bool
    grad_reduce: object = None

    def dropped(self, x: torch.Tensor, dropout_seed: int | None, shard: int) -> torch.Tensor:
        """`x` through the adapter's dropout (training only): a mask from (micro-batch seed, site, shard)."""
        if not self.training or self.lora.dropout == 0.0:
            return x
        if dropout_seed is None:
            raise TensorparError("LoRA dropout is on: pass dropout_seed to the forward pass (the trainer does)")
        return seeded_dropout(x, self.lora.dropout, mix_seed(dropout_seed, 3 << 20, self.lora.site, shard), True)


def _seed_and_cp_rank(ctx) -> tuple[int | None, int]:
    """(the micro-batch's dropout seed, this rank's CP rank) of a MicroBatchContext (or None)."""
    cp = getattr(ctx, "cp", None)
    return getattr(ctx, "dropout_seed", None), (cp.group.rank if cp is not None else 0)


def add_column_adapters(region: TPRegion, x: torch.Tensor, outputs: list[torch.Tensor],
                        adapters: list[Adapter | None], ctx=None) -> list[torch.Tensor]:
    """`outputs` (the column-parallel products of layers sharing the input `x`, taken before the region's entry)
    plus each layer's adapter (None: none), as the module docstring says: forward none (SP: one all-gather of the
    adapters' [T, n r]), backward one all-reduce of their gradient (SP: reduce-scatter, and A's gradients summed).
    `ctx`: the micro-batch's context (its dropout seed and CP split)."""
    present = [i for i, a in enumerate(adapters) if a is not None]
    if not present:
        return outputs
    seed, cp_rank = _seed_and_cp_rank(ctx)
    tp, sp = region.group.size, region.sequence_parallel
    shard = (region.group.rank if sp else 0) + cp_rank * tp
    downs = [region.linear(adapters[i].dropped(x, seed, shard), adapters[i].a, summed=sp) for i in present]
    entered = region.entry(torch.cat(downs, -1) if len(downs) > 1 else downs[0])
    ups = entered.split([adapters[i].lora.rank for i in present], -1)
    out = list(outputs)
    for i, u in zip(present, ups):
        a = adapters[i]
        (up,) = region.gemms.column(u, [Projection(a.b, None, a.grad_reduce)], region.group)
        out[i] = out[i] + a.lora.scaling * up
    return out


def add_row_adapter(region: TPRegion, x: torch.Tensor, y: torch.Tensor, adapter: Adapter | None,
                    ctx=None) -> torch.Tensor:
    """`y` (a row-parallel layer's output, out of the region) plus its adapter on the layer's input `x` (this rank's
    input features), as the module docstring says: forward one all-reduce of [T, r] (SP: reduce-scatter), backward
    none (SP: an all-gather, and B's gradient summed)."""
    if adapter is None:
        return y
    seed, cp_rank = _seed_and_cp_rank(ctx)
    shard = region.group.rank + cp_rank * region.group.size
    u = region.reduce(region.linear(adapter.dropped(x, seed, shard), adapter.a))
    return y + adapter.lora.scaling * region.linear(u, adapter.b, summed=region.sequence_parallel)


def adapter_region(region: TPRegion, adapted) -> TPRegion | None:
    """The region adapters run their products in: `region`, its GEMMs in the compute dtype (never fp8); None when
    nothing is `adapted`."""
    return region.without_fp8() if adapted else None
