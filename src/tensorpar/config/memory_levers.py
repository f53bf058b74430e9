"""A run's memory levers as one value: what the optimizer, the training loop and the planner read.

- ``optimizer_offload``: the optimizer's states and the fp32 master weights in host memory (pinned on CUDA); the
  gradients are reduced and clipped on the device, then copied to the host, where AdamW steps; the stepped masters
  go back into the parameters (`tensorpar.data_parallel.host_masters`). The same arithmetic: on a CPU run a copy
  in the same memory, bit for bit the run without it.
- ``activation_offload``: what the decoder layers save for the backward (parameters aside) copied to host memory
  in the forward and back in the backward (`tensorpar.training.activation_offload`; on CUDA pinned, the copies out
  on a side stream beside the compute, the copies back on another, one layer ahead of the backward). The
  embedding's, the head's and the loss's stay: the backward needs them first, so moving them would lower no peak.
  ``activation_offload_layers`` N moves only what the first N layers of each forward on a rank save (None: every
  layer's): the later layers' backward runs while the first ones' come back, so the copies can hide behind the
  compute where moving every layer's would wait for PCIe.
- ``optimizer_state_dtype``: AdamW's two moments in fp32 or bf16 (the master weights stay fp32; the update is
  computed in fp32 from the widened moments, which are then rounded to nearest: `tensorpar.optim.adamw_bf16`).
"""

from __future__ import annotations

import dataclasses

import torch

from tensorpar.config.choices import OPTIMIZER_STATE_DTYPES
from tensorpar.errors import TensorparError

STATE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclasses.dataclass(frozen=True)
class MemoryLevers:
    optimizer_offload: bool = False
    activation_offload: bool = False
    optimizer_state_dtype: str = "fp32"
    activation_offload_layers: int | None = None

    def __post_init__(self):
        if self.activation_offload_layers is not None and self.activation_offload_layers < 1:
            raise TensorparError(f"--activation-offload-layers must be at least 1 layer, got "
                                 f"{self.activation_offload_layers}")
        if self.optimizer_state_dtype not in OPTIMIZER_STATE_DTYPES:
            raise TensorparError(f"--optimizer-state-dtype must be one of {', '.join(OPTIMIZER_STATE_DTYPES)}, got "
                                 f"{self.optimizer_state_dtype!r}")

    @classmethod
    def of(cls, options) -> "MemoryLevers":
        """The levers a command's options ask for (absent fields: off)."""
        return cls(bool(getattr(options, "optimizer_offload", False)),
                   bool(getattr(options, "activation_offload", False)),
                   getattr(options, "optimizer_state_dtype", "fp32"),
                   getattr(options, "activation_offload_layers", None))

    def offloaded_layers(self, layers: int) -> int:
        """Of a rank's `layers` layers, how many have their saved tensors moved (0 without activation offload)."""
        if not self.activation_offload:
            return 0
        return layers if self.activation_offload_layers is None else min(layers, self.activation_offload_layers)

    @property
    def state_dtype(self) -> torch.dtype:
        return STATE_DTYPES[self.optimizer_state_dtype]

    @property
    def state_bytes(self) -> int:
        """Bytes per element of one AdamW moment."""
        return self.state_dtype.itemsize

    def problems(self, optimizer: str = "adamw", recompute: str = "none", num_layers: int | None = None) -> list[str]:
        """Why these levers cannot apply to a run of `optimizer` and `recompute` on a model of `num_layers` layers
        (one line each), or []."""
        found = []
        if num_layers is not None and (self.activation_offload_layers or 0) > num_layers:
            found.append(f"--activation-offload-layers {self.activation_offload_layers}: the model has {num_layers} "
                         f"layers (leave it out to move every saved tensor)")
        if optimizer != "adamw" and self.optimizer_offload:
            found.append(f"--optimizer-offload steps AdamW on the host; --optimizer {optimizer}'s orthogonalisation "
                         f"runs collectives on the device: use --optimizer adamw")
        if optimizer != "adamw" and self.optimizer_state_dtype != "fp32":
            found.append(f"--optimizer-state-dtype {self.optimizer_state_dtype} stores AdamW's moments; --optimizer "
                         f"{optimizer} keeps a momentum of its own: use --optimizer adamw")
        if self.activation_offload and recompute == "full":
            found.append("--activation-offload with --recompute full: full recomputation keeps only each block's "
                         "input, which autograd does not save (nothing would move to the host): use --recompute "
                         "none or selective")
        return found
