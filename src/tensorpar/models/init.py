"""Seeded initialisation of the dense weights, sharded afterwards: any TP size starts identical.

Each parameter's full tensor is drawn from its own generator, seeded by (seed, parameter name),
so the result depends on neither the TP size nor the order in which parameters are created.
GPT-2's scheme: N(0, 0.02) for matrices and embeddings, N(0, 0.02 / sqrt(2 * layers)) for the
projections that write into the residual stream, zero biases, unit norm weights.
"""

from __future__ import annotations

import math
import zlib

import torch

from tensorpar.distributed.sharding import local_shard, shard_spec
from tensorpar.functional.dropout import mix_seed
from tensorpar.models.state import dense_shape

RESIDUAL_PROJECTIONS = ("attn.o_proj.weight", "mlp.down_proj.weight", "experts.down_proj",
                        "shared_experts.down_proj.weight")


def full_init(name: str, shape: tuple[int, ...], cfg, seed: int) -> torch.Tensor:
    """The dense initial value of parameter `name`."""
    if name.endswith("norm.weight"):
        return torch.full(shape, 1.0 - cfg.norm_offset)  # a scale of 1: (offset + weight) for Gemma's norms
    if name.endswith(".bias"):
        return torch.zeros(shape)
    std = cfg.init_std
    if name.endswith(RESIDUAL_PROJECTIONS):
        std = std / math.sqrt(2 * cfg.num_layers)
    generator = torch.Generator().manual_seed(mix_seed(seed, zlib.crc32(name.encode())))
    return torch.empty(shape).normal_(0.0, std, generator=generator)


@torch.no_grad()
def init_weights(model, seed: int) -> None:
    for name, param in model.named_parameters():
        spec = shard_spec(param)
        full = full_init(name, dense_shape(param, spec), model.cfg, seed)
        param.copy_(local_shard(full, spec, model))
