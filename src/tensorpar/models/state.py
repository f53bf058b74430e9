"""Dense (unsharded) state dicts of a TP model: gather them, or load one into any TP size.

A model's state is its parameters and its persistent buffers: state that is not trained but moves with the weights
(an MoE router's balancing bias), whole on every rank that holds its layer."""

from __future__ import annotations

import torch

from tensorpar.distributed.sharding import ShardSpec, full_tensor, local_shard, shard_spec
from tensorpar.errors import TensorparError


def dense_shape(param: torch.Tensor, spec: ShardSpec) -> tuple[int, ...]:
    """The parameter's shape in the dense model."""
    shape = list(param.shape)
    if spec.dim is not None:
        shape[spec.dim] = spec.full_size
    if spec.expert_tp_dim is not None:
        shape[spec.expert_tp_dim] = spec.expert_tp_full_size
    return tuple(shape)


def model_state(model) -> dict[str, torch.Tensor]:
    """This rank's parameters, then its persistent buffers (untrained state, replicated: `ShardSpec(dim=None)`), by
    name."""
    params = dict(model.named_parameters())
    buffers = {k: v for k, v in model.state_dict(keep_vars=True).items() if k not in params}
    return {**params, **buffers}


@torch.no_grad()
def full_state_dict(model) -> dict[str, torch.Tensor]:
    """Every parameter (and persistent buffer) as the dense tensor (a collective over the TP group, and the
    expert-parallel group for the routed experts: call on every rank of them)."""
    return {name: full_tensor(p.detach(), shard_spec(p), model).cpu() for name, p in model_state(model).items()}


@torch.no_grad()
def load_full_state_dict(model, state: dict[str, torch.Tensor], source: str = "state dict") -> None:
    """Copy this rank's shard of every dense tensor in `state` into `model` (its parameters and persistent buffers);
    names and shapes must match."""
    params = model_state(model)
    missing = sorted(set(params) - set(state))
    unexpected = sorted(set(state) - set(params))
    if missing or unexpected:
        raise TensorparError(
            f"{source} does not match the model: missing {missing[:5]}{'...' if len(missing) > 5 else ''}, "
            f"unexpected {unexpected[:5]}{'...' if len(unexpected) > 5 else ''}"
        )
    for name, param in params.items():
        spec = shard_spec(param)
        full = state[name]
        if tuple(full.shape) != dense_shape(param, spec):
            raise TensorparError(
                f"{source}: '{name}' has shape {tuple(full.shape)}, the model expects {dense_shape(param, spec)}"
            )
        if full.is_floating_point() and not full.is_meta and not torch.isfinite(full).all():
            raise TensorparError(f"{source}: '{name}' holds NaN or infinite values (a damaged file, or weights saved "
                                 f"after training diverged)")
        param.copy_(local_shard(full.to(param.dtype), spec, model))
