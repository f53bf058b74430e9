"""Precision of training, evaluation and generation.

Training (`--dtype`): ``fp32`` everything in fp32. ``bf16`` and ``fp16``: the parameters, activations and
gradients are bf16 (fp16); the optimizer keeps an fp32 master copy of the parameters (sharded under ZeRO)
and steps it, gradients are accumulated and reduced in fp32 (``--grad-reduce-dtype bf16``: in bf16, half the
traffic) and the loss, softmax and norms compute in fp32. fp16 adds dynamic loss scaling
(`tensorpar.optim.loss_scaler`). ``fp8`` is ``bf16`` whose column/row-parallel linears and experts run their GEMMs in
fp8 (`tensorpar.tensor_parallel.fp8_scaling`); the parameters, gradients and masters are bf16's.

Evaluation and generation load fp32 weights; their ``bf16`` runs the matmuls and attention in bf16 under
torch.autocast.
"""

from __future__ import annotations

import contextlib

import torch

PARAM_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.bfloat16}


def param_dtype(dtype: str) -> torch.dtype:
    """The torch dtype of the parameters under training precision `dtype`."""
    return PARAM_DTYPES[dtype]


def autocast(device: torch.device, dtype: str):
    """The context to run forward passes in for `dtype` ("fp32": a null context, "bf16" and "fp8": bf16 autocast)."""
    if dtype in ("bf16", "fp8"):
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()
