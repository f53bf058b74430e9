"""`--optimizer-offload`: the fp32 master weights and AdamW's states in host memory, the step taken there.

Every ZeRO stage keeps its gradient slices on the device, where the collectives reduce them and where the gradient
norm is taken and the clipping applied (`HostMasterWeights.params` are those device gradients, tagged like their
parameters). Then, per step:

    device gradient slice  --copy-->  host gradient slice     (HostStep.step, before AdamW)
    AdamW on the host masters (pinned on CUDA)                 (the states are created beside them, on the host;
                                                                pinned masters step by the fused CPU kernel)
    host master  --copy-->  the parameters                     (MasterSlice.write_back; ZeRO-1/2: the all-gather
                                                                of the cast master slices, from the device)

The masters are always copies (even of fp32 parameters that ZeRO-0 and ZeRO-3 otherwise step in place), so the
arithmetic is the run's without offload: on a CPU run host and device are the same memory and the results are bit
for bit the same. Per step and rank the traffic is one copy of the gradient slice to the host and one of the
master slice back (fp32, 4 bytes per element each way; the ZeRO-1/2 all-gather then moves the parameters' dtype).
"""

from __future__ import annotations

import torch

from tensorpar.data_parallel.flat_buffer import FlatBuffer, nbytes
from tensorpar.data_parallel.master_weights import MasterSlice, MasterWeights
from tensorpar.data_parallel.shard_pieces import cut_pieces, state_bytes
from tensorpar.distributed.launch import threads_per_process
from tensorpar.distributed.sharding import shard_spec


class DeviceGradient:
    """A piece's gradient on the device, tagged like its parameter (`shard_spec`): what the gradient norm is taken
    over and clipping scales before the gradients move to the host."""

    def __init__(self, grad: torch.Tensor, spec):
        self.grad, self.shard_spec = grad, spec

    @property
    def device(self) -> torch.device:
        return self.grad.device


def host_empty(like: torch.Tensor) -> torch.Tensor:
    """An fp32 host tensor of `like`'s shape: pinned when `like` is on CUDA; on meta for a meta `like` (dry run)."""
    if like.is_meta:
        return torch.empty(like.shape, dtype=torch.float32, device="meta")
    return torch.empty(like.shape, dtype=torch.float32, device="cpu", pin_memory=like.is_cuda)


class HostMasterWeights(MasterWeights):
    """fp32 master slices in host memory (see the module)."""

    def __init__(self, weight_decay: float):
        super().__init__(weight_decay)
        self.host_grads: list[torch.Tensor] = []  # one per slice: the host copy of its device gradient slice
        self.device_grads: list[DeviceGradient] = []

    def add(self, buffer: FlatBuffer, values: torch.Tensor, group, grad_shard: torch.Tensor | None = None,
            in_place: bool = False) -> MasterSlice:
        """As `MasterWeights.add`, the master a host copy (``in_place`` cannot apply: the values are on the device)."""
        lo, hi = buffer.slice_bounds(group)
        master = host_empty(values)
        if not values.is_meta:
            master.copy_(values.detach())
        if grad_shard is None:
            grad_shard = torch.zeros(values.shape, dtype=torch.float32, device=values.device)
        host_grad = host_empty(values)
        if not values.is_meta:
            host_grad.zero_()
        pieces = cut_pieces(buffer.params, buffer.shapes, buffer.offsets, lo, hi, master, host_grad, self.groups)
        self.slices.append(MasterSlice(buffer, group, lo, hi, values, master, grad_shard, pieces))
        self.host_grads.append(host_grad)
        self.device_grads += [DeviceGradient(grad_shard[p.lo - lo : p.hi - lo], shard_spec(p.param)) for p in pieces]
        return self.slices[-1]

    @property
    def params(self) -> list[DeviceGradient]:
        """What the gradient norm is taken over: the pieces' gradients on the device."""
        return self.device_grads

    def nonfinite(self) -> list:
        pieces = [p for s in self.slices for p in s.pieces]
        found = {id(p.param): p.param for p, d in zip(pieces, self.device_grads) if not bool(torch.isfinite(d.grad).all())}
        return list(found.values())

    def gradients_to_host(self) -> None:
        """Every device gradient slice into its host copy (on CUDA asynchronously, then one synchronisation)."""
        cuda = False
        for s, host_grad in zip(self.slices, self.host_grads):
            host_grad.copy_(s.grad_shard, non_blocking=True)
            cuda = cuda or s.grad_shard.is_cuda
        if cuda:
            torch.cuda.synchronize()

    def host_bytes(self, optimizer) -> int:
        """Host bytes: the optimizer's states, the masters and the gradients' host copies."""
        return state_bytes(optimizer) + self.master_bytes() + sum(nbytes(g) for g in self.host_grads)


class HostStep:
    """The step rule (AdamW) over host masters: each step copies the device gradients to the host first. Reads as
    the rule it wraps (`param_groups`, `state`, `kinds_of`, `new_step`)."""

    def __init__(self, rule, weights: HostMasterWeights):
        self.rule, self.weights = rule, weights

    @property
    def param_groups(self) -> list[dict]:
        return self.rule.param_groups

    @property
    def state(self) -> dict:
        return self.rule.state

    def kinds_of(self, name: str, shape) -> tuple[str, ...]:
        return self.rule.kinds_of(name, shape)

    def new_step(self, p: torch.Tensor, value: float = 0.0) -> torch.Tensor:
        return self.rule.new_step(p, value)

    def step(self) -> None:
        self.weights.gradients_to_host()
        self.rule.step()


def offloaded_memory(weights, optimizer, memory: dict[str, int]) -> dict[str, int]:
    """A stage's `memory()` with the optimizer's bytes moved to ``host_optimizer`` when its masters are on the host
    (else as given)."""
    if not isinstance(weights, HostMasterWeights):
        return memory
    return {**memory, "optimizer": 0, "host_optimizer": weights.host_bytes(optimizer)}


def host_step_threads_warning(device_type: str, threads: int, cpus: int, local_ranks: int) -> str | None:
    """A warning when GPU ranks would step their offloaded optimizer on one host thread each while the node has
    cores to spare: torchrun sets OMP_NUM_THREADS=1 unless told otherwise, and the fused CPU AdamW's speed scales
    with its threads (tensorpar's own launcher gives each rank cores / ranks)."""
    spare = threads_per_process(max(local_ranks, 1), cpus)
    if device_type != "cuda" or threads > 1 or spare == 1:
        return None
    return (f"--optimizer-offload steps AdamW on the host with {threads} thread per rank (OMP_NUM_THREADS={threads}, "
            f"torchrun's default) while this node has {cpus} cores for {local_ranks} ranks: set OMP_NUM_THREADS={spare} "
            f"for a faster optimizer step")
