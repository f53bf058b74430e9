"""A run's memory levers as one value: what the optimizer, the training loop and the planner read.

- ``optimizer_offload``: the optimizer's states and the fp32 master weights in host memory (pinned on CUDA); the
  gradients are reduced and clipped on the device, then copied to the host, where AdamW steps; the stepped masters
  go back into the parameters (`tensorpar.data_parallel.host_masters`). The same arithmetic: on a CPU run a copy
  in the same memory, bit for bit the run without it.
- ``activation_offload``: every tensor autograd saves for the backward (parameters aside) copied to host memory in
  the forward and back in the backward (`tensorpar.training.activation_offload`; on CUDA pinned, the copies out on
  a side stream beside the compute, the copies back on another, one layer ahead of the backward).
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

    def __post_init__(self):
        if self.optimizer_state_dtype not in OPTIMIZER_STATE_DTYPES:
            raise TensorparError(f"--optimizer-state-dtype must be one of {', '.join(OPTIMIZER_STATE_DTYPES)}, got "
                                 f"{self.optimizer_state_dtype!r}")

    @classmethod
    def of(cls, options) -> "MemoryLevers":
        """The levers a command's options ask for (absent fields: off)."""
        return cls(bool(getattr(options, "optimizer_offload", False)),
                   bool(getattr(options, "activation_offload", False)),
                   getattr(options, "optimizer_state_dtype", "fp32"))

    @property
    def state_dtype(self) -> torch.dtype:
        return STATE_DTYPES[self.optimizer_state_dtype]

    @property
    def state_bytes(self) -> int:
        """Bytes per element of one AdamW moment."""
        return self.state_dtype.itemsize

    def problems(self, optimizer: str = "adamw", recompute: str = "none") -> list[str]:
        """Why these levers cannot apply to a run of `optimizer` and `recompute` (one line each), or []."""
        found = []
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
