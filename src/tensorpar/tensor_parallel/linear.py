"""Megatron-style column- and row-parallel linear layers.

A dense ``y = x A^T + b`` with A of shape [out, in] (torch's layout) is split two ways:

- ColumnParallelLinear splits A's output rows (the columns of x @ A^T): rank r holds
  A[r*out/tp:(r+1)*out/tp, :] and produces its slice of y's last dimension.
- RowParallelLinear splits A's input columns: rank r holds A[:, r*in/tp:(r+1)*in/tp],
  consumes its slice of x's last dimension and produces a partial sum of y.

Chained Column -> Row (an MLP, or QKV -> output projection) needs one all-reduce forward
and one backward, as the course slides' f and g operators show.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from tensorpar.distributed.comm import Group
from tensorpar.distributed.sharding import (
    ShardSpec,
    default_linear_init,
    linear_bias_init,
    make_generator,
    shard_tensor,
    tag,
    take_shard,
)
from tensorpar.errors import TensorparError
from tensorpar.layout import divide
from tensorpar.tensor_parallel.lora import (Adapter, LoraSite, add_column_adapters, add_row_adapter, adapter_region,
                                           column_factors, row_factors)
from tensorpar.tensor_parallel.mappings import gather_from_tp, scatter_to_tp
from tensorpar.tensor_parallel.region import Projection, TPRegion, as_region

InitMethod = Callable[[torch.Tensor, torch.Generator], None]


def full_linear_params(in_features, out_features, bias, init_method, seed):
    """The unsharded weight and bias, initialised on CPU from one seeded generator (identical for any TP size)."""
    generator = make_generator(seed)
    weight = torch.empty(out_features, in_features)
    (init_method or default_linear_init)(weight, generator)
    full_bias = None
    if bias:
        full_bias = torch.empty(out_features)
        linear_bias_init(full_bias, in_features, generator)
    return weight, full_bias


class _ParallelLinear(nn.Module):
    split_dim: int  # 0 for column-parallel, 1 for row-parallel
    lora: LoraSite | None = None  # a LoRA adapter: its factors are the submodules `lora_A` and `lora_B`

    def __init__(self, in_features, out_features, region, device, dtype):
        super().__init__()
        self.region: TPRegion = as_region(region)
        self.tp_group: Group = self.region.group
        self.sequence_parallel = self.region.sequence_parallel
        self.in_features = in_features
        self.out_features = out_features
        self._factory = {"device": device, "dtype": dtype}

    def _load_full(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        """Set this rank's shard from the full (unsharded) weight and bias."""
        tp, rank = self.tp_group.size, self.tp_group.rank
        if tuple(weight.shape) != (self.out_features, self.in_features):
            raise ValueError(
                f"{type(self).__name__}: full weight has shape {tuple(weight.shape)}, "
                f"expected {(self.out_features, self.in_features)}"
            )
        with torch.no_grad():
            self.weight.copy_(take_shard(weight, self.split_dim, rank, tp))
            if self.bias is not None:
                if bias is None:
                    raise ValueError(f"{type(self).__name__} has a bias but the dense layer has none")
                self.bias.copy_(take_shard(bias, 0, rank, tp) if self.split_dim == 0 else bias)

    @classmethod
    def from_dense(cls, module: nn.Linear, region=None, **kwargs):
        """This rank's shard of an unsharded nn.Linear (its weights are copied, not shared)."""
        if not isinstance(module, nn.Linear):
            raise TensorparError(f"{cls.__name__}.from_dense takes a torch nn.Linear, got {type(module).__name__}")
        kwargs.setdefault("bias", module.bias is not None)
        kwargs.setdefault("device", module.weight.device)
        kwargs.setdefault("dtype", module.weight.dtype)
        layer = cls(module.in_features, module.out_features, region, init=False, **kwargs)
        layer._load_full(module.weight.detach(), None if module.bias is None else module.bias.detach())
        return layer

    def _init_adapter(self, seed: int | None) -> None:
        """PEFT's initial adapter: A drawn as nn.Linear draws its weight (from `seed`), B zero: the layer starts as
        its base."""
        full = torch.empty(self.lora.rank, self.in_features)
        default_linear_init(full, make_generator(seed))
        with torch.no_grad():
            a = self.lora_A.weight
            a.copy_(shard_tensor(full, a.shard_spec, self.tp_group.rank, self.tp_group.size))
            self.lora_B.weight.zero_()

    def adapter(self) -> Adapter | None:
        """This layer's LoRA adapter (its factors, scale, dropout), or None (`tensorpar.tensor_parallel.lora`)."""
        if self.lora is None:
            return None
        return Adapter(self.lora_A.weight, self.lora_B.weight, self.lora, self.training)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, tp={self.tp_group.size}, "
            f"local_weight={tuple(self.weight.shape)}, bias={self.bias is not None}, "
            f"sequence_parallel={self.sequence_parallel}"
        )


class ColumnParallelLinear(_ParallelLinear):
    """y = x A^T + b with A's output features split across the TP group.

    Forward: the input is replicated (or, with sequence parallelism, sequence-sharded) and enters the TP
    region through `region.enter` (`copy_to_tp`, f: identity / all-reduce in backward; or `gather_from_sp`:
    all-gather / reduce-scatter in backward, overlapped with the GEMMs when the region says so); each rank
    computes its slice of the output features. With ``gather_output=True`` the slices are all-gathered
    (backward: split) into the full output.

    `region`: a `TPRegion` (the model's: its group, sequence parallelism, overlap and split backward), or a
    mesh / group / None for plain collectives. Layers that share one input (q/k/v, gate/up) are entered
    together by their owner (`region.enter(x, [a.projection(), b.projection()])`), so that the backward
    all-reduce (or reduce-scatter) happens once for all of them.

    `lora`: a LoRA adapter on the layer (`tensorpar.tensor_parallel.lora`: A replicated, B split by output features;
    its down-projection's r-wide result enters the region beside x), added by `forward` or by the owner
    (`add_column_adapters`).
    """

    split_dim = 0

    def __init__(
        self,
        in_features: int,
        out_features: int,
        region=None,
        bias: bool = True,
        *,
        gather_output: bool = False,
        init_method: InitMethod | None = None,
        seed: int | None = None,
        device=None,
        dtype=None,
        init: bool = True,
        lora: LoraSite | None = None,
    ):
        super().__init__(in_features, out_features, region, device, dtype)
        if gather_output and self.sequence_parallel:
            raise ValueError("ColumnParallelLinear: gather_output=True cannot be combined with sequence_parallel=True")
        tp = self.tp_group.size
        self.gather_output = gather_output
        self.out_per_rank = divide(out_features, tp, "ColumnParallelLinear out_features")
        self.weight = tag(
            nn.Parameter(torch.empty(self.out_per_rank, in_features, **self._factory)),
            ShardSpec(dim=0, full_size=out_features, padded_size=out_features),
        )
        self.bias = None
        if bias:
            self.bias = tag(
                nn.Parameter(torch.empty(self.out_per_rank, **self._factory)),
                ShardSpec(dim=0, full_size=out_features, padded_size=out_features),
            )
        if lora is not None:
            self.lora, self.adapter_region = lora, adapter_region(self.region, lora)
            self.lora_A, self.lora_B = column_factors(lora, in_features, self.out_per_rank, self.weight.shard_spec,
                                                      self.sequence_parallel, device)
        if init:
            self._load_full(*full_linear_params(in_features, out_features, bias, init_method, seed))
            if lora is not None:
                self._init_adapter(seed)

    def projection(self) -> Projection:
        """This layer's product, for a caller that enters the region with several layers sharing one input."""
        return Projection(self.weight, self.bias)

    def forward(self, x: torch.Tensor, ctx=None) -> torch.Tensor:
        """`ctx`: the micro-batch's context (the adapter's dropout seed), when the layer has an adapter."""
        (y,) = self.region.enter(x, [self.projection()])
        if self.lora is not None:
            (y,) = add_column_adapters(self.adapter_region, x, [y], [self.adapter()], ctx)
        return gather_from_tp(y, self.tp_group) if self.gather_output else y


class RowParallelLinear(_ParallelLinear):
    """y = x A^T + b with A's input features split across the TP group.

    Forward: each rank multiplies its slice of the input features (``input_is_parallel=True``,
    the output of a ColumnParallelLinear; otherwise the full input is split first by
    `scatter_to_tp`), then the partial sums leave the TP region through `region.leave`:
    `reduce_from_tp` (g: all-reduce / identity in backward) or, with sequence parallelism,
    `reduce_scatter_to_sp` (reduce-scatter / all-gather in backward), in pieces overlapped with the
    GEMM when the region says so. The bias is added once, after the reduction.

    `lora`: a LoRA adapter on the layer (`tensorpar.tensor_parallel.lora`: A split by input features, B replicated;
    its down-projection summed over the group by `region.reduce`, then multiplied by B).
    """

    split_dim = 1

    def __init__(
        self,
        in_features: int,
        out_features: int,
        region=None,
        bias: bool = True,
        *,
        input_is_parallel: bool = True,
        init_method: InitMethod | None = None,
        seed: int | None = None,
        device=None,
        dtype=None,
        init: bool = True,
        lora: LoraSite | None = None,
    ):
        super().__init__(in_features, out_features, region, device, dtype)
        if self.sequence_parallel and not input_is_parallel:
            raise ValueError("RowParallelLinear: sequence_parallel=True needs input_is_parallel=True")
        tp = self.tp_group.size
        self.input_is_parallel = input_is_parallel
        self.in_per_rank = divide(in_features, tp, "RowParallelLinear in_features")
        self.weight = tag(
            nn.Parameter(torch.empty(out_features, self.in_per_rank, **self._factory)),
            ShardSpec(dim=1, full_size=in_features, padded_size=in_features),
        )
        self.bias = None
        if bias:
            # Replicated; under SP each rank sees only its sequence shard, so its gradient is summed across TP.
            self.bias = tag(
                nn.Parameter(torch.empty(out_features, **self._factory)),
                ShardSpec(dim=None, reduce_grad_across_tp=self.sequence_parallel),
            )
        if lora is not None:
            self.lora, self.adapter_region = lora, adapter_region(self.region, lora)
            self.lora_A, self.lora_B = row_factors(lora, self.in_per_rank, in_features, out_features,
                                                   self.sequence_parallel, device)
        if init:
            self._load_full(*full_linear_params(in_features, out_features, bias, init_method, seed))
            if lora is not None:
                self._init_adapter(seed)

    def forward(self, x: torch.Tensor, ctx=None) -> torch.Tensor:
        """`ctx`: the micro-batch's context (the adapter's dropout seed), when the layer has an adapter."""
        if not self.input_is_parallel:
            x = scatter_to_tp(x, self.tp_group)
        y = self.region.leave(x, self.weight, self.bias)
        return y if self.lora is None else add_row_adapter(self.adapter_region, x, y, self.adapter(), ctx)
