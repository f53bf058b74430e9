"""`--activation-offload`: what autograd saves for the backward kept in host memory between the forward and the
backward (the training loop installs it with the activation meter, `memory_meter.ActivationMeter`).

Each saved tensor's whole storage is copied once (several views of one storage share the copy, as they share the
device memory: the host holds what the device would have held) and each view is rebuilt over the copy brought back.
Parameters and their views stay where they are (ZeRO-3 re-gathers them for the backward). On CUDA the host copies
are pinned and made on a side stream after the compute stream's work so far, so the forward goes on beside them;
the device storage is returned to the allocator once its copy is done (`record_stream`); the copies back run on the
compute stream, in order, when the backward first unpacks the storage (no prefetch). On a CPU run host and device
are one memory: the copies are made all the same, through the same code.

A saved storage modified in place before the backward would be an autograd error without offload; with it the copy
made first would silently win, so a storage whose version changed since its copy is copied again.
"""

from __future__ import annotations

import dataclasses
import weakref

import torch

from tensorpar.data_parallel.flat_buffer import BytesInUse


@dataclasses.dataclass
class _HostStorage:
    """One device storage's host copy, and its device copy while the backward uses it."""

    host: torch.Tensor  # uint8 [nbytes]
    device: torch.device
    version: int
    copied: object = None  # the CUDA event after which `host` holds the data
    back: object = None  # a weak reference to the uint8 device copy brought back, while alive

    def on_device(self) -> torch.Tensor:
        back = self.back() if self.back is not None else None
        if back is None:
            if self.copied is not None:
                torch.cuda.current_stream(self.device).wait_event(self.copied)
            back = self.host.to(self.device, non_blocking=True)
            self.back = weakref.ref(back)
        return back


@dataclasses.dataclass
class _Saved:
    storage: _HostStorage
    dtype: torch.dtype
    shape: tuple
    stride: tuple
    offset: int


class HostActivations:
    """Saved-tensor hooks that move each saved storage to host memory and back; `bytes`: the host bytes alive, and
    their peak since `reset_peak`."""

    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)
        self.bytes = BytesInUse()
        # device data_ptr -> its copy, while both the device storage and a saved tensor of the copy live
        self._copies: dict[int, weakref.ref] = {}
        self._stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None

    def pack(self, t: torch.Tensor) -> _Saved:
        storage = t.untyped_storage()
        key = storage.data_ptr()
        known = self._copies.get(key)
        copy = known() if known is not None else None
        if copy is None or copy.version != t._version:
            copy = self._copy(storage, t._version)
            self._copies[key] = known = weakref.ref(copy)
            weakref.finalize(storage, self._forget, key, known)
        return _Saved(copy, t.dtype, tuple(t.shape), tuple(t.stride()), t.storage_offset())

    def unpack(self, saved: _Saved) -> torch.Tensor:
        raw = saved.storage.on_device()
        out = torch.empty(0, dtype=saved.dtype, device=raw.device)
        return out.set_(raw.untyped_storage(), saved.offset, saved.shape, saved.stride)

    def _copy(self, storage, version: int) -> _HostStorage:
        raw = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
        cuda = raw.is_cuda
        host = torch.empty(raw.numel(), dtype=torch.uint8, pin_memory=cuda)
        copy = _HostStorage(host, raw.device, version)
        if cuda:
            self._stream.wait_stream(torch.cuda.current_stream(raw.device))
            with torch.cuda.stream(self._stream):
                host.copy_(raw, non_blocking=True)
                copy.copied = torch.cuda.Event()
                copy.copied.record(self._stream)
            raw.record_stream(self._stream)  # the allocator keeps the storage until the copy is done
        else:
            host.copy_(raw)
        self.bytes.add(host.numel())
        weakref.finalize(copy, self.bytes.sub, host.numel())
        return copy

    def _forget(self, key: int, known: weakref.ref) -> None:
        """The device storage is freed: its address may be reused by another."""
        if self._copies.get(key) is known:
            del self._copies[key]
