"""How a parameter is split across tensor-parallel ranks, and the helpers that build shards.

Parameters carry a `ShardSpec` (nanotron-style tagging) so that checkpoints, gradient norms and
optimizers know how to merge and re-split them, and what the pipeline did with them, without
asking the layer.
"""

from __future__ import annotations

import dataclasses
import math

import torch
from torch import nn



@dataclasses.dataclass(frozen=True)
class ShardSpec:
    """How one parameter is laid out across the TP group.

    - `dim`: the split dimension, or None when every TP rank holds the whole tensor.
    - `full_size`: the real (unpadded) size of `dim` in the dense model.
    - `padded_size`: `full_size` rounded up so that it splits evenly (the vocabulary); padding is zero.
    - `replicas`: how many consecutive TP ranks hold the *same* shard. 1 for a plain split; for
      KV heads fewer than TP ranks, tp / num_kv_heads. The padded tensor is cut into
      tp / replicas chunks along `dim` and rank r holds chunk r // replicas.
    - `reduce_grad_across_tp`: a replicated parameter whose gradient is computed from a sequence
      shard and so is summed across TP ranks (the layer does this itself in autograd).
    - `group`: the mesh group the tensor is split over: "tp", or "ep" for the stacked weights of routed
      experts, split along dim 0 (the global expert index) over the expert-parallel group. Their
      gradients are summed over the expert-data-parallel group, not the DP group.
    - `expert_tp_dim`, `expert_tp_full_size`: for a routed expert's weight, the dimension (the expert's width F)
      it is further split along, evenly, over the expert-TP group (Megatron-style: gate/up column-parallel,
      down row-parallel), and its dense size; None when unsplit. `local_shard` / `full_tensor` apply both splits.

    - `pipeline_tied`: one of the two copies of an embedding tied to the LM head on different pipeline stages
      (first and last); their gradients are summed over the embed group before data parallelism reduces them.
    - `pipeline_duplicate`: the last stage's copy of such an embedding: left out of gradient norms and checkpoints
      (the first stage's copy is the parameter).
    - `backward_passes`: gradient arrivals per micro-batch: 2 for a tied embedding whose lookup and head run in two
      chunks of one rank (V-shaped schedules), else 1.

    A norm over the dense parameter is the sum over TP ranks of each local squared norm divided by
    `effective_replicas(tp)`.
    """

    dim: int | None
    full_size: int | None = None
    padded_size: int | None = None
    replicas: int = 1
    reduce_grad_across_tp: bool = False
    group: str = "tp"
    expert_tp_dim: int | None = None
    expert_tp_full_size: int | None = None
    pipeline_tied: bool = False
    pipeline_duplicate: bool = False
    backward_passes: int = 1

    @property
    def expert(self) -> bool:
        """A routed expert's weight (split over the expert-parallel group)."""
        return self.group == "ep"

    def effective_replicas(self, tp_size: int) -> int:
        """How many TP ranks hold an identical copy of this rank's tensor."""
        return tp_size if self.dim is None else self.replicas


def tag(param: nn.Parameter, spec: ShardSpec) -> nn.Parameter:
    param.shard_spec = spec
    return param


def shard_spec(param: torch.Tensor) -> ShardSpec:
    return getattr(param, "shard_spec", ShardSpec(dim=None))


def retag(param: nn.Parameter, **facts) -> nn.Parameter:
    """Tag `param` with its spec changed by `facts` (e.g. ``pipeline_tied=True``)."""
    return tag(param, dataclasses.replace(shard_spec(param), **facts))


def group_for(spec: ShardSpec, owner):
    """The group `spec` splits a tensor over, from `owner` (a model or mesh with `tp_group` and `ep_group`)."""
    return getattr(owner, f"{spec.group}_group")


def local_shard(full: torch.Tensor, spec: ShardSpec, owner) -> torch.Tensor:
    """This rank's part of the dense tensor `full`: split over `spec`'s group of `owner` (a model or mesh), and a
    routed expert's weight then along `expert_tp_dim` over the owner's `expert_tp_group`."""
    g = group_for(spec, owner)
    local = shard_tensor(full, spec, g.rank, g.size)
    if spec.expert and spec.expert_tp_dim is not None:
        etp = owner.expert_tp_group
        local = take_shard(local, spec.expert_tp_dim, etp.rank, etp.size)
    return local


def full_tensor(local: torch.Tensor, spec: ShardSpec, owner) -> torch.Tensor:
    """The dense tensor, reassembled from every rank's part (a collective over the groups `spec` splits over)."""
    if spec.expert and spec.expert_tp_dim is not None:
        local = owner.expert_tp_group.all_gather(local.detach(), dim=spec.expert_tp_dim)
    return unshard_tensor(local, spec, group_for(spec, owner))


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


def shard_tensor(full: torch.Tensor, spec: ShardSpec, tp_rank: int, tp_size: int) -> torch.Tensor:
    """This rank's part of the dense tensor `full`, as `spec` lays it out."""
    if spec.dim is None:
        return full.clone()
    chunks = tp_size // spec.replicas
    return take_shard(full, spec.dim, tp_rank // spec.replicas, chunks, pad_to=spec.padded_size)


def unshard_tensor(local: torch.Tensor, spec: ShardSpec, tp_group) -> torch.Tensor:
    """The dense tensor, reassembled from every rank's part (a collective over `tp_group`)."""
    if spec.dim is None or tp_group.size == 1:
        return join_shards([local], spec)
    gathered = tp_group.all_gather(local.detach(), dim=spec.dim)
    return join_shards(list(gathered.chunk(tp_group.size, spec.dim)), spec)


def join_shards(parts: list[torch.Tensor], spec: ShardSpec) -> torch.Tensor:
    """The dense tensor from the parts of every TP rank, in rank order (no communication): `shard_tensor`
    undone."""
    if spec.dim is None:
        return parts[0]
    full = torch.cat(parts[:: spec.replicas], spec.dim) if len(parts) > 1 else parts[0]
    return full.narrow(spec.dim, 0, spec.full_size) if spec.full_size is not None else full
