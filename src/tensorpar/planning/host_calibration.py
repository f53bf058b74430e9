"""The host side of `tensorpar calibrate`: what the offloading levers cost on this machine (`offload_time`).

- ``host_link``: copies between the device and host memory, each direction timed on its own (CUDA: pinned host
  memory, as the levers allocate it; the slower direction is the link's bandwidth). On a CPU device the levers'
  copies stay in one memory: a ``copy_`` between two host buffers, bytes copied per second.
- ``host_optimizer_bandwidth``: tensorpar's own AdamW stepping fp32 tensors in host memory (pinned where a GPU is
  visible: the fused CPU kernel the offloaded masters step with; else the per-tensor form a CPU run steps with),
  counted at the planner's OPTIMIZER_BYTES_PER_ELEMENT of traffic an element.
"""

from __future__ import annotations

import time

import torch

from tensorpar.optim.adamw import AdamW
from tensorpar.planning.devices import OPTIMIZER_BYTES_PER_ELEMENT

HOST_LINK_LATENCY_S = 10e-6  # not measured: one copy's set-up, negligible beside the megabytes a layer moves


def _seconds(fn, sync, reps: int = 3) -> float:
    """The median of `reps` timed calls of `fn` after a warm-up call."""
    fn()
    sync()
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync()
        samples.append(time.perf_counter() - t0)
    return sorted(samples)[len(samples) // 2]


def measure_host_link(device: torch.device, nbytes: int) -> dict:
    """{"bandwidth", "latency", "device_to_host", "host_to_device"}: bytes/s of `nbytes` copies each way."""
    if device.type != "cuda":
        src = torch.ones(nbytes // 4)
        dst = torch.empty_like(src)
        rate = nbytes / _seconds(lambda: dst.copy_(src), lambda: None)
        return {"bandwidth": rate, "latency": HOST_LINK_LATENCY_S, "device_to_host": rate, "host_to_device": rate}
    on_device = torch.ones(nbytes // 4, device=device)
    on_host = torch.empty(nbytes // 4, pin_memory=True)
    sync = lambda: torch.cuda.synchronize(device)  # noqa: E731
    out = nbytes / _seconds(lambda: on_host.copy_(on_device, non_blocking=True), sync)
    back = nbytes / _seconds(lambda: on_device.copy_(on_host, non_blocking=True), sync)
    return {"bandwidth": min(out, back), "latency": HOST_LINK_LATENCY_S, "device_to_host": out,
            "host_to_device": back}


def measure_host_optimizer(elements: int, tensors: int = 4) -> float:
    """Bytes/s (OPTIMIZER_BYTES_PER_ELEMENT an element) of an AdamW step over `elements` fp32 host elements in
    `tensors` tensors."""
    pinned = torch.cuda.is_available()
    params = [torch.zeros(elements // tensors, pin_memory=pinned) for _ in range(tensors)]
    for p in params:
        p.grad = torch.full_like(p, 1e-3)
    optimizer = AdamW([{"params": params}], lr=1e-4, weight_decay=0.1)
    return OPTIMIZER_BYTES_PER_ELEMENT * elements / _seconds(optimizer.step, lambda: None)


def measure_host(device: torch.device) -> dict:
    """The profile's host entries for `device` (sizes: a layer's saved tensors, a few million parameters)."""
    cuda = device.type == "cuda"
    return {"host_link": measure_host_link(device, (256 << 20) if cuda else (64 << 20)),
            "host_optimizer_bandwidth": measure_host_optimizer((64 << 20) if cuda else (4 << 20))}
