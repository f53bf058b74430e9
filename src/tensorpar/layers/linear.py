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

from tensorpar.distributed.comm import Group, as_group
from tensorpar.distributed.ops import (
    copy_to_tp,
    gather_from_sp,
    gather_from_tp,
    reduce_from_tp,
    reduce_scatter_to_sp,
    scatter_to_tp,
)
from tensorpar.layers.sharding import (
    ShardSpec,
    default_linear_init,
    divide,
    linear_bias_init,
    make_generator,
    tag,
    take_shard,
)
from tensorpar.layers import weight_grad
from tensorpar.layers.tp_overlap import column_parallel_in, row_parallel_out

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
    weight_grad_queue = None  # a WeightGradQueue: the backward leaves the weight gradients in it (layers/weight_grad.py)

    def __init__(self, in_features, out_features, tp_group, bias, sequence_parallel, device, dtype, tp_overlap=False):
        super().__init__()
        self.tp_group: Group = as_group(tp_group)
        self.tp_overlap = tp_overlap
        self.in_features = in_features
        self.out_features = out_features
        self.sequence_parallel = sequence_parallel
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
    def from_dense(cls, module: nn.Linear, tp_group=None, **kwargs):
        """This rank's shard of an unsharded nn.Linear (its weights are copied, not shared)."""
        kwargs.setdefault("bias", module.bias is not None)
        kwargs.setdefault("device", module.weight.device)
        kwargs.setdefault("dtype", module.weight.dtype)
        layer = cls(module.in_features, module.out_features, tp_group, init=False, **kwargs)
        layer._load_full(module.weight.detach(), None if module.bias is None else module.bias.detach())
        return layer

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, tp={self.tp_group.size}, "
            f"local_weight={tuple(self.weight.shape)}, bias={self.bias is not None}, "
            f"sequence_parallel={self.sequence_parallel}"
        )


class ColumnParallelLinear(_ParallelLinear):
    """y = x A^T + b with A's output features split across the TP group.

    Forward: the input is replicated (or, with sequence parallelism, sequence-sharded) and
    enters through `copy_to_tp` (f: identity / all-reduce in backward), or `gather_from_sp`
    (all-gather / reduce-scatter in backward); each rank computes its slice of the output features.
    With ``gather_output=True`` the slices are all-gathered (backward: split) into the full output.

    ``skip_input_comm=True`` leaves out the entering op: for layers that share one input (q/k/v,
    gate/up), the caller applies `copy_to_tp` / `gather_from_sp` once, so that the backward
    all-reduce (or reduce-scatter) happens once for all of them instead of once per layer.

    ``tp_overlap=True`` hides that communication behind compute (`tensorpar.layers.tp_overlap`): the
    backward all-reduce (reduce-scatter) runs while the weight gradient is computed, and under SP the
    forward all-gather arrives in chunks, each multiplied as soon as it is there.
    """

    split_dim = 0

    def __init__(
        self,
        in_features: int,
        out_features: int,
        tp_group=None,
        bias: bool = True,
        *,
        gather_output: bool = False,
        sequence_parallel: bool = False,
        skip_input_comm: bool = False,
        init_method: InitMethod | None = None,
        seed: int | None = None,
        device=None,
        dtype=None,
        init: bool = True,
        tp_overlap: bool = False,
    ):
        super().__init__(in_features, out_features, tp_group, bias, sequence_parallel, device, dtype, tp_overlap)
        if gather_output and sequence_parallel:
            raise ValueError("ColumnParallelLinear: gather_output=True cannot be combined with sequence_parallel=True")
        tp = self.tp_group.size
        self.gather_output = gather_output
        self.skip_input_comm = skip_input_comm
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
        if init:
            self._load_full(*full_linear_params(in_features, out_features, bias, init_method, seed))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_overlap and not self.skip_input_comm:
            (y,) = column_parallel_in(x, [(self.weight, self.bias)], self.tp_group, self.sequence_parallel)
            return gather_from_tp(y, self.tp_group) if self.gather_output else y
        if self.skip_input_comm:
            pass
        elif self.sequence_parallel:
            x = gather_from_sp(x, self.tp_group)
        else:
            x = copy_to_tp(x, self.tp_group)
        y = weight_grad.linear(x, self.weight, self.bias, self.weight_grad_queue)
        return gather_from_tp(y, self.tp_group) if self.gather_output else y


class RowParallelLinear(_ParallelLinear):
    """y = x A^T + b with A's input features split across the TP group.

    Forward: each rank multiplies its slice of the input features (``input_is_parallel=True``,
    the output of a ColumnParallelLinear; otherwise the full input is split first by
    `scatter_to_tp`), then the partial sums are combined by `reduce_from_tp` (g: all-reduce /
    identity in backward) or, with sequence parallelism, by `reduce_scatter_to_sp`
    (reduce-scatter / all-gather in backward). The bias is added once, after the reduction.

    ``tp_overlap=True`` sends the reduction in chunks, each as soon as its part of the product is
    computed (`tensorpar.layers.tp_overlap`); under SP the backward all-gather likewise.
    """

    split_dim = 1

    def __init__(
        self,
        in_features: int,
        out_features: int,
        tp_group=None,
        bias: bool = True,
        *,
        input_is_parallel: bool = True,
        sequence_parallel: bool = False,
        init_method: InitMethod | None = None,
        seed: int | None = None,
        device=None,
        dtype=None,
        init: bool = True,
        tp_overlap: bool = False,
    ):
        super().__init__(in_features, out_features, tp_group, bias, sequence_parallel, device, dtype, tp_overlap)
        if sequence_parallel and not input_is_parallel:
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
                ShardSpec(dim=None, reduce_grad_across_tp=sequence_parallel),
            )
        if init:
            self._load_full(*full_linear_params(in_features, out_features, bias, init_method, seed))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = scatter_to_tp(x, self.tp_group)
        if self.tp_overlap:
            return row_parallel_out(x, self.weight, self.bias, self.tp_group, self.sequence_parallel)
        y = weight_grad.linear(x, self.weight, None, self.weight_grad_queue)
        if self.sequence_parallel:
            y = reduce_scatter_to_sp(y, self.tp_group)
        else:
            y = reduce_from_tp(y, self.tp_group)
        if self.bias is None:
            return y
        if self.weight_grad_queue is not None:  # split backward: the bias gradient (summed across TP under SP) in W
            reduce = weight_grad.summed_over(self.tp_group) if self.sequence_parallel else None
            return weight_grad.affine(y, None, self.bias, self.weight_grad_queue, reduce=reduce)
        # Under SP the bias gradient on each rank covers only its sequence shard: copy_to_tp sums it across TP.
        bias = copy_to_tp(self.bias, self.tp_group) if self.sequence_parallel else self.bias
        return y + bias
