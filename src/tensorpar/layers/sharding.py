"""How a parameter is split across tensor-parallel ranks, and the helpers that build shards.

Sharded parameters carry a `ShardSpec` (nanotron-style tagging) so that checkpoints, gradient
norms and optimizers know how to merge and re-split them without asking the layer.
"""

from __future__ import annotations

import dataclasses
import math

import torch
from torch import nn

from tensorpar.errors import LayoutError


@dataclasses.dataclass(frozen=True)
class ShardSpec:
    """`dim` is the split dimension (None: replicated on every TP rank); `full_size` the unpadded size of that
    dimension; `padded_size` the size after padding to a multiple of the TP size.

    `reduce_grad_across_tp` marks a replicated parameter whose gradient is computed from a sequence
    shard and so must be summed across TP ranks (the layer does this itself in autograd).
    """

    dim: int | None
    full_size: int | None = None
    padded_size: int | None = None
    reduce_grad_across_tp: bool = False


def tag(param: nn.Parameter, spec: ShardSpec) -> nn.Parameter:
    param.shard_spec = spec
    return param


def shard_spec(param: torch.Tensor) -> ShardSpec:
    return getattr(param, "shard_spec", ShardSpec(dim=None))


def divide(numerator: int, denominator: int, what: str) -> int:
    """numerator / denominator, or a LayoutError that names `what` and the valid sizes."""
    if numerator % denominator:
        valid = [d for d in range(1, numerator + 1) if numerator % d == 0 and d <= 64]
        raise LayoutError(
            f"{what} = {numerator} is not divisible by the tensor-parallel size {denominator}; "
            f"TP sizes that divide it: {valid}"
        )
    return numerator // denominator


def padded(size: int, tp_size: int) -> int:
    """`size` rounded up to a multiple of `tp_size`."""
    return int(math.ceil(size / tp_size)) * tp_size


def default_linear_init(weight: torch.Tensor, generator: torch.Generator) -> None:
    """nn.Linear's own initialisation (kaiming-uniform with a=sqrt(5))."""
    nn.init.kaiming_uniform_(weight, a=math.sqrt(5), generator=generator)


def linear_bias_init(bias: torch.Tensor, fan_in: int, generator: torch.Generator) -> None:
    """nn.Linear's bias initialisation: uniform in +-1/sqrt(fan_in)."""
    bound = 1 / math.sqrt(fan_in) if fan_in > 0 else 0
    nn.init.uniform_(bias, -bound, bound, generator=generator)


def make_generator(seed: int | None) -> torch.Generator:
    """A CPU generator seeded from `seed`, or from torch's global RNG when None.

    Drawing the seed from the global RNG keeps TP-sharded layers as reproducible as plain
    nn.Linear under torch.manual_seed, and identical across TP sizes: every rank draws one number.
    """
    if seed is None:
        seed = int(torch.randint(0, 2**62, (), generator=None).item())
    return torch.Generator(device="cpu").manual_seed(seed)


def take_shard(full: torch.Tensor, dim: int, rank: int, tp_size: int, pad_to: int | None = None) -> torch.Tensor:
    """This rank's contiguous slice of `full` along `dim`, after zero-padding that dim to `pad_to`."""
    if pad_to is not None and pad_to > full.shape[dim]:
        pad_shape = list(full.shape)
        pad_shape[dim] = pad_to - full.shape[dim]
        full = torch.cat([full, full.new_zeros(pad_shape)], dim)
    return full.chunk(tp_size, dim)[rank].clone().contiguous()
