"""A run's numeric precision as one value: the parameters' dtype, the autocast context, the fp8 recipe, the dtype
gradients are reduced in, loss scaling and the planner's precision name all come from it.

Training (`--dtype`): ``fp32`` everything in fp32. ``bf16`` and ``fp16``: the parameters, activations and
gradients are bf16 (fp16); the optimizer keeps an fp32 master copy of the parameters (sharded under ZeRO)
and steps it, gradients are accumulated and reduced in fp32 (``--grad-reduce-dtype bf16``: in bf16, half the
traffic) and the loss, softmax and norms compute in fp32. fp16 adds dynamic loss scaling
(`tensorpar.optim.loss_scaler`). ``fp8`` is ``bf16`` whose column/row-parallel linears and experts run their
GEMMs in fp8 (`--fp8-recipe`, `tensorpar.tensor_parallel.fp8_scaling`).

Evaluation and generation (``training=False``) load fp32 weights; their ``bf16`` (and ``fp8``) runs the matmuls
and attention in bf16 under torch.autocast.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch

from tensorpar.config.choices import FP8_RECIPES, GRAD_REDUCE_DTYPES, TRAIN_DTYPES

TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.bfloat16}


@dataclasses.dataclass(frozen=True)
class Precision:
    """`dtype` as --dtype names it (fp8: bf16 with fp8 GEMMs of `fp8_recipe`); `training`: bf16/fp16 parameters with
    fp32 masters (else fp32 weights under autocast)."""

    dtype: str = "fp32"
    fp8_recipe: str = "tensorwise"
    grad_reduce_dtype: str = "fp32"
    training: bool = True

    def __post_init__(self):
        for name, value, valid in (("dtype", self.dtype, TRAIN_DTYPES), ("fp8_recipe", self.fp8_recipe, FP8_RECIPES),
                                   ("grad_reduce_dtype", self.grad_reduce_dtype, GRAD_REDUCE_DTYPES)):
            if value not in valid:
                raise ValueError(f"{name} must be one of {valid}, got {value!r}")

    @classmethod
    def of(cls, options, training: bool = True) -> "Precision":
        """The precision a command's options ask for (`--dtype`, `--fp8-recipe`, `--grad-reduce-dtype`)."""
        return cls(options.dtype, getattr(options, "fp8_recipe", "tensorwise"),
                   getattr(options, "grad_reduce_dtype", "fp32"), training)

    @property
    def fp8(self) -> bool:
        """Whether the parallel linears' and experts' GEMMs run in fp8."""
        return self.dtype == "fp8"

    @property
    def param_dtype(self) -> torch.dtype:
        """The parameters' dtype: bf16/fp16 in training (fp8: bf16), fp32 weights for eval and generation."""
        return TORCH_DTYPES[self.dtype] if self.training else torch.float32

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype activations flow in (between pipeline stages) and GEMMs run in: fp8 runs the rest in bf16."""
        return TORCH_DTYPES[self.dtype]

    @property
    def reduce_dtype(self) -> torch.dtype:
        """The dtype gradients are accumulated and reduced in."""
        return TORCH_DTYPES[self.grad_reduce_dtype]

    @property
    def loss_scaling(self) -> bool:
        """fp16 scales the loss dynamically (its narrow range underflows small gradients otherwise)."""
        return self.dtype == "fp16"

    @property
    def peak_dtype(self) -> str:
        """The dtype whose peak FLOP/s MFU divides by: fp16 and fp8 count against bf16's, as Megatron reports them."""
        return "bf16" if self.dtype in ("fp16", "fp8") else self.dtype

    def autocast(self, device: torch.device):
        """The context forward passes run in: bf16 autocast for bf16 and fp8, else none."""
        if self.dtype in ("bf16", "fp8"):
            return torch.autocast(device_type=torch.device(device).type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    @property
    def planner_name(self) -> str:
        """The `tensorpar plan --precision` recipe of this precision (`tensorpar.planning.precision_recipes`)."""
        if not self.training:
            return "tensorpar-bf16-autocast" if self.dtype in ("bf16", "fp8") else "tensorpar-fp32"
        return f"tensorpar-{self.dtype}" + ("-rowwise" if self.fp8 and self.fp8_recipe == "rowwise" else "")
