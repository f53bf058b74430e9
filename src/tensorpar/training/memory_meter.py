"""Measured memory per rank: parameters, gradients, optimizer state, gathered parameters and activations.

The first four come from the optimizer, which owns those buffers and counts them as it allocates and frees
them (`BucketedOptimizer.memory`, `FullyShardedOptimizer.memory`): exact on any device. Activations are
what autograd keeps for the backward pass: on every device, the storages of the tensors it saves (each
storage once, parameters excluded) from when they are saved until autograd lets them go; the most alive at
once during the step is the peak. Recomputed blocks keep their own saved tensors out of sight
(torch.utils.checkpoint installs its own hooks): there only the block's inputs and, during the backward,
one recomputed block count. On a GPU the allocator's peak for the step is reported too (`allocated`),
which also holds what no ledger sees: temporaries, communication buffers, the allocator's rounding.

Where the bytes are: ``optimizer`` is the optimizer's device memory; with --optimizer-offload its states and
masters are ``host_optimizer`` instead. With --activation-offload the decoder blocks' saved tensors are
``host_activations`` (each storage once, as on the device; with --activation-offload-layers the first blocks'), and
``activations`` counts what stays on the device: the embedding's, the head's and the loss's, and the later blocks'.
"""

from __future__ import annotations

import contextlib

import torch
from torch.nn import Parameter

from tensorpar.data_parallel.flat_buffer import BytesInUse
from tensorpar.training.activation_offload import HostActivations

MiB = 2**20


def _is_parameter(t: torch.Tensor | None) -> bool:
    # a plain tensor first: Parameter's isinstance goes through its metaclass, ten times the cost
    return t is not None and type(t) is not torch.Tensor and isinstance(t, Parameter)


class _Counted:
    """What autograd keeps in place of a saved tensor the meter counts: the tensor itself. Autograd drops it when it
    lets the tensor go (after the backward that used it, or with the graph), and the storage's count with it.
    `moved`: with the first layers offloaded, how many storages had moved to the host when it was saved."""

    __slots__ = ("tensor", "key", "meter", "moved")

    def __init__(self, tensor: torch.Tensor, key: int, meter: "ActivationMeter", moved: int = 0):
        self.tensor, self.key, self.meter, self.moved = tensor, key, meter, moved

    def __del__(self):
        self.meter._release(self.key)


class ActivationMeter:
    """Bytes of tensors saved for backward alive at once; use `measuring()` around the forward and backward. With
    `offload` (--activation-offload) they are moved to host memory, which it counts (`host_bytes`). `compiled`:
    the model's blocks are compiled (--compile), so the hooks are kept out of torch.compile's reach."""

    def __init__(self, offload: HostActivations | None = None, compiled: bool = False):
        self.offload = offload
        self.bytes = BytesInUse()
        self._live: dict[int, list[int]] = {}  # storage id -> [bytes, saved tensors referring to it]
        self._params: set[int] = set()
        self._hooks = (self._pack, self._unpack)
        if compiled:
            # Autograd calls the hooks from a compiled block's eager parts (a TP layer's collective), where dynamo
            # would trace them: a recompilation per storage address, and holders made without their fields.
            self._hooks = tuple(torch.compiler.disable(hook) for hook in self._hooks)

    # Autograd calls these for every tensor it saves, so they stay cheap: a weight is found by its storage (a view of
    # it too) before any type check; a ZeRO-3 weight gathered since `measuring` began, by its type or its view's base.
    def _pack(self, t: torch.Tensor):
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key in self._params or _is_parameter(t) or _is_parameter(t._base):
            return t
        nbytes = storage.nbytes()
        if nbytes == 0:
            return t
        if self.offload is not None and self.offload.taking:
            return self.offload.pack(t)
        entry = self._live.get(key)
        if entry is None:
            entry = self._live[key] = [nbytes, 0]
            self.bytes.add(nbytes)
        entry[1] += 1
        return _Counted(t, key, self, self.offload.saved_count() if self.offload is not None else 0)

    def _release(self, key: int) -> None:
        entry = self._live.get(key)
        if entry is not None:
            entry[1] -= 1
            if entry[1] == 0:
                self.bytes.sub(entry[0])
                del self._live[key]

    @contextlib.contextmanager
    def measuring(self, model):
        """Count what autograd saves inside; the peak restarts at entry."""
        self._params = {p.untyped_storage().data_ptr() for p in model.parameters() if p.numel()}
        self.bytes.reset_peak()
        if self.offload is not None:
            self.offload.bytes.reset_peak()
        with torch.autograd.graph.saved_tensors_hooks(*self._hooks):
            yield

    def _unpack(self, saved):
        if type(saved) is _Counted:
            if self.offload is not None:  # kept on the device: the layers moved before it come back meanwhile
                self.offload.begin_backward(saved.moved)
            return saved.tensor
        return saved if isinstance(saved, torch.Tensor) else self.offload.unpack(saved)


def step_memory(optimizer, activations: ActivationMeter, device: torch.device, model=None) -> dict[str, float]:
    """This rank's peak memory of the step just taken, in MiB, by kind; with `model`, its frozen parameters (LoRA's
    base weights, which the optimizer does not hold) as "frozen"."""
    out = {k: v / MiB for k, v in optimizer.memory().items()}
    frozen = sum(p.numel() * p.element_size() for p in model.parameters() if not p.requires_grad) if model else 0
    if frozen and "frozen" not in out:  # ZeRO-3 holds and reports its shards of them itself
        out["frozen"] = frozen / MiB
    out["activations"] = activations.bytes.peak / MiB
    if activations.offload is not None:
        out["host_activations"] = activations.offload.bytes.peak / MiB
    if device.type == "cuda":
        out["allocated"] = torch.cuda.max_memory_allocated(device) / MiB
        torch.cuda.reset_peak_memory_stats(device)
    return out
