"""The peak FLOP/s that MFU divides by: a GPU's datasheet figure, or a matmul measured on this device."""

from __future__ import annotations

import functools
import time

import torch

from tensorpar.config.hardware import GPUS
from tensorpar.config.precision import TORCH_DTYPES

# CUDA device-name markers -> the GPU catalog (tensorpar.config.hardware), the one table of datasheet peaks.
_CATALOG_BY_DEVICE_NAME = {"H200": "h200", "H100": "h100-80gb", "B200": "b200", "A100": "a100-80gb"}


def peak_flops(device: torch.device, dtype: str) -> tuple[float, str]:
    """(peak FLOP/s of one rank's device, where the figure comes from). On a GPU fp16 counts as bf16 (same
    datasheet peak), and so does fp8: its MFU is against the bf16 peak, as Megatron and torchtitan report it
    (attention and the head run in bf16); elsewhere a matmul in the parameters' dtype is measured."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for marker, key in _CATALOG_BY_DEVICE_NAME.items():
            if marker in name:
                key = "a100-40gb" if key == "a100-80gb" and "40GB" in name else key
                return GPUS[key].peak("bf16" if dtype in ("fp16", "fp8") else dtype), f"{key} datasheet"
    return _measured_once(str(device), dtype, torch.get_num_threads()), "measured matmul peak"


@functools.cache
def _measured_once(device: str, dtype: str, threads: int) -> float:
    """The matmul peak of this process on `device` with `threads` threads, measured on first use (0.3 s): a process
    that trains several times (a notebook, a test's worker pool) measures once."""
    return measure_matmul_flops(torch.device(device), TORCH_DTYPES[dtype])


def measure_matmul_flops(device: torch.device, dtype: torch.dtype, size: int = 512, seconds: float = 0.3) -> float:
    """FLOP/s of a square matmul on this device with this process's threads (best of several timings)."""
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    best = 0.0
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        for _ in range(4):
            a @ b
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = max(best, 4 * 2 * size**3 / (time.perf_counter() - t0))
    return best
