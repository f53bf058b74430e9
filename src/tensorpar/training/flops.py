"""Model FLOPs per token and the device's measured peak, for MFU.

FLOPs per trained token follow PaLM's accounting: 6 x (parameters that take part in a matmul)
+ 12 x layers x hidden x sequence (attention scores and their use, forward and backward).
Embedding lookups are not matmuls; a tied output head is counted once, as the matmul it is.
"""

from __future__ import annotations

import time

import torch

# CUDA device-name markers -> the planner's GPU catalog (planning/hardware.py), the one table of datasheet peaks.
_CATALOG_BY_DEVICE_NAME = {"H200": "h200", "H100": "h100-80gb", "B200": "b200", "A100": "a100-80gb"}


def matmul_params(cfg) -> int:
    n = cfg.num_parameters()
    if cfg.position == "learned":
        n -= cfg.max_seq_len * cfg.hidden_size
    if not cfg.tie_embeddings:
        n -= cfg.vocab_size * cfg.hidden_size  # the input embedding is a lookup; the head stays counted
    return n


def train_flops_per_token(cfg, seq_len: int) -> float:
    return 6.0 * matmul_params(cfg) + 12.0 * cfg.num_layers * cfg.hidden_size * seq_len


def peak_flops(device: torch.device, dtype: str) -> tuple[float, str]:
    """(peak FLOP/s of one rank's device, where the figure comes from)."""
    if device.type == "cuda":
        from tensorpar.planning.hardware import GPUS

        name = torch.cuda.get_device_name(device)
        for marker, key in _CATALOG_BY_DEVICE_NAME.items():
            if marker in name:
                key = "a100-40gb" if key == "a100-80gb" and "40GB" in name else key
                return GPUS[key].peak(dtype), f"{key} datasheet"
    return measure_matmul_flops(device, torch.bfloat16 if dtype == "bf16" else torch.float32), "measured matmul peak"


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
