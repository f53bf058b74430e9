"""The host side of `tensorpar calibrate`: what the offloading levers cost on this machine (`offload_time`).

- ``host_link``: copies between the device and host memory, each direction timed on its own (CUDA: pinned host
  memory, as the levers allocate it; the slower direction is the link's bandwidth). On a CPU device the levers'
  copies stay in one memory: the device's own copy bandwidth, bytes copied per second (half the bytes read and
  written that `calibration.measure_bandwidth` counts).
- ``host_optimizer_bandwidth``: tensorpar's own AdamW stepping fp32 tensors in host memory (pinned where a GPU is
  visible: the fused CPU kernel the offloaded masters step with; else the per-tensor form a CPU run steps with),
  counted at the planner's OPTIMIZER_BYTES_PER_ELEMENT of traffic an element.

Both are timed by the caller's timer (`calibration._time`: a median of batches, the device synchronised, and on a
CPU every rank in step).
"""

from __future__ import annotations

from typing import Callable

import torch

from tensorpar.optim.adamw import AdamW
from tensorpar.planning.devices import OPTIMIZER_BYTES_PER_ELEMENT

HOST_LINK_LATENCY_S = 10e-6  # not measured: one copy's set-up, negligible beside the megabytes a layer moves

Timer = Callable[[Callable[[], object]], float]  # seconds per call of a function


def measure_host_link(device: torch.device, nbytes: int, timed: Timer, copy_bandwidth: float) -> dict:
    """{"bandwidth", "latency", "device_to_host", "host_to_device"}: bytes/s of `nbytes` copies each way (a CPU:
    its `copy_bandwidth`, bytes read and written per second, halved)."""
    if device.type != "cuda":
        rate = copy_bandwidth / 2
        return {"bandwidth": rate, "latency": HOST_LINK_LATENCY_S, "device_to_host": rate, "host_to_device": rate}
    on_device = torch.ones(nbytes // 4, device=device)
    on_host = torch.empty(nbytes // 4, pin_memory=True)
    out = nbytes / timed(lambda: on_host.copy_(on_device, non_blocking=True))
    back = nbytes / timed(lambda: on_device.copy_(on_host, non_blocking=True))
    return {"bandwidth": min(out, back), "latency": HOST_LINK_LATENCY_S, "device_to_host": out,
            "host_to_device": back}


def measure_host_optimizer(elements: int, timed: Timer, tensors: int = 4) -> float:
    """Bytes/s (OPTIMIZER_BYTES_PER_ELEMENT an element) of an AdamW step over `elements` fp32 host elements in
    `tensors` tensors."""
    pinned = torch.cuda.is_available()
    params = [torch.zeros(elements // tensors, pin_memory=pinned) for _ in range(tensors)]
    for p in params:
        p.grad = torch.full_like(p, 1e-3)
    optimizer = AdamW([{"params": params}], lr=1e-4, weight_decay=0.1)
    return OPTIMIZER_BYTES_PER_ELEMENT * elements / timed(optimizer.step)


def measure_host(device: torch.device, timed: Timer, copy_bandwidth: float) -> dict:
    """The profile's host entries for `device` (sizes: a layer's saved tensors, a few million parameters)."""
    cuda = device.type == "cuda"
    return {"host_link": measure_host_link(device, 256 << 20, timed, copy_bandwidth),
            "host_optimizer_bandwidth": measure_host_optimizer((64 << 20) if cuda else (4 << 20), timed)}
