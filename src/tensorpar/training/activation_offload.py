"""`--activation-offload`: what autograd saves for the backward kept in host memory between the forward and the
backward (the training loop installs it with the activation meter, `memory_meter.ActivationMeter`).

Each saved tensor's whole storage is copied once (several views of one storage share the copy, as they share the
device memory: the host holds what the device would have held) and each view is rebuilt over the copy brought back.
Parameters and their views stay where they are (ZeRO-3 re-gathers them for the backward).

On CUDA the host copies are pinned. The copies out run on a side stream after the compute stream's work so far,
so the forward goes on beside them; the device storage is returned to the allocator once its copy is done
(`record_stream`). The copies back run on a second side stream, ahead of the backward: when the backward first
unpacks a storage, the storages saved before it (which the backward needs next, as it runs the forward in reverse)
are fetched, up to one layer's bytes ahead of what it uses (the host bytes alive when the backward begins, over
the `layers` the rank runs); the compute stream waits only for the copy of the storage it needs. On a CPU run host
and device are one memory: the copies out are made all the same, through the same code, and nothing is fetched.

What moves is what the rank's decoder blocks save, in each forward: forward hooks on the blocks say when a block
begins and ends (run eagerly under --compile, where autograd saves a compiled block's tensors as it leaves it). The
rest stays on the device, counted there by the activation meter: the embedding's, the head's and the loss's (and
the multi-token prediction modules'), which the backward needs first, so that moving them out and straight back
would cost the copies and lower no peak (on the lent H200, moving the loss's 1 GB of saved head gradients too left
the peak where it was). With `first_layers` N (--activation-offload-layers) only the first N blocks' tensors move
and the later blocks' stay as well. The backward's first unpack, of a tensor that stayed, starts fetching the last
layer moved before it was saved, so the copies back run beside the later layers' backward.

A saved storage modified in place before the backward would be an autograd error without offload; with it the copy
made first would silently win, so a storage whose version changed since its copy is copied again.
"""

from __future__ import annotations

import dataclasses
import functools
import weakref

import torch

from tensorpar.data_parallel.flat_buffer import BytesInUse


@dataclasses.dataclass(eq=False)
class _HostStorage:
    """One device storage's host copy, and its device copy while the backward uses it."""

    host: torch.Tensor  # uint8 [nbytes]
    device: torch.device
    version: int
    index: int  # the order it was saved in
    copied: object = None  # the CUDA event after which `host` holds the data
    fetched: torch.Tensor | None = None  # the device copy fetched ahead of the backward, until it is used
    arrived: object = None  # the CUDA event after which `fetched` holds the data
    back: object = None  # a weak reference to the uint8 device copy in use, while alive

    def fetch(self, stream) -> int:
        """Start the copy back on `stream`; the bytes it brings, 0 if it is already there or on its way, or is not a
        CUDA storage (a CPU tensor autograd saved stays where it is)."""
        if self.copied is None or self.fetched is not None or self._in_use() is not None:
            return 0
        # Allocated by the compute stream, as everything the backward frees: memory the caching allocator gave to
        # the side stream would be pooled apart from the compute stream's. The side stream waits for the compute
        # stream's work so far, which may still use the block the allocator handed out.
        self.fetched = torch.empty_like(self.host, device=self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        stream.wait_event(self.copied)
        with torch.cuda.stream(stream):
            self.fetched.copy_(self.host, non_blocking=True)
            self.arrived = torch.cuda.Event()
            self.arrived.record(stream)
        self.fetched.record_stream(stream)  # freed unused, the block waits for the copy before it is reused
        return self.host.numel()

    def on_device(self) -> torch.Tensor:
        back = self._in_use()
        if back is None:
            if self.fetched is not None:  # fetched ahead on the side stream: wait for that copy only
                back, self.fetched = self.fetched, None
                torch.cuda.current_stream(self.device).wait_event(self.arrived)
            else:
                if self.copied is not None:
                    torch.cuda.current_stream(self.device).wait_event(self.copied)
                back = self.host.to(self.device, non_blocking=True)
            self.back = weakref.ref(back)
        return back

    def in_flight(self) -> int:
        """Bytes fetched ahead and not used yet."""
        return self.host.numel() if self.fetched is not None else 0

    def _in_use(self) -> torch.Tensor | None:
        return self.back() if self.back is not None else None


@dataclasses.dataclass
class _Saved:
    storage: _HostStorage
    dtype: torch.dtype
    shape: tuple
    stride: tuple
    offset: int


class HostActivations:
    """Saved-tensor hooks that move each saved storage to host memory and back; `bytes`: the host bytes alive, and
    their peak since `reset_peak`. `layers`: how many layers' saved tensors move in a forward on this rank (the
    fetch-ahead window is one layer's share of the bytes moved). `taking`: whether what autograd saves now moves
    (always, unless `follow` limits it to some blocks)."""

    SCAN = 512  # saved storages looked at, at most, per fetch ahead (a layer saves a few dozen)

    def __init__(self, device: torch.device | str, layers: int = 1):
        self.device = torch.device(device)
        self.layers = max(1, layers)
        self.taking = True
        self.bytes = BytesInUse()
        # device data_ptr -> its copy, while both the device storage and a saved tensor of the copy live
        self._copies: dict[int, weakref.ref] = {}
        self._saved: dict[int, weakref.ref] = {}  # index -> copy, while the copy lives
        self._count = 0
        self._window = 0  # bytes fetched ahead, set when a backward begins
        self._backward = False
        cuda = self.device.type == "cuda"
        self._out = torch.cuda.Stream(self.device) if cuda else None
        self._in = torch.cuda.Stream(self.device) if cuda else None

    @classmethod
    def of_model(cls, device, model: torch.nn.Module, first_layers: int | None = None) -> "HostActivations":
        """The offload of a rank's `model`: what its decoder blocks save, or with `first_layers` what its first blocks
        save."""
        blocks = list(model.decoder_layers().values())[:first_layers]
        offload = cls(device, layers=len(blocks))
        offload.follow(blocks)
        return offload

    def follow(self, blocks) -> None:
        """Move only what `blocks` save: `taking` from each one's forward pre-hook to its forward hook."""
        self.taking = False
        begins, ends = (torch.compiler.disable(functools.partial(self._take, taking)) for taking in (True, False))
        for block in blocks:
            block.register_forward_pre_hook(begins)
            block.register_forward_hook(ends)

    def _take(self, taking: bool, *_) -> None:
        self.taking = taking

    def saved_count(self) -> int:
        """How many storages have been copied to the host so far: a tensor saved now comes after those."""
        return self._count

    def begin_backward(self, before: int) -> None:
        """A backward unpacks a tensor saved when `before` storages had been copied (`saved_count`): if it is the
        backward's first, fetch one layer's share of the host bytes ahead, from the storage saved last before it
        (with a pipeline, storages saved after it may be a later micro-batch's, which its backward does not need)."""
        if self._in is not None and not self._backward:
            self._backward, self._window = True, self.bytes.now // self.layers
            self._fetch_before(before)

    def pack(self, t: torch.Tensor) -> _Saved:
        self._backward = False
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
        if self._in is not None:
            self.begin_backward(saved.storage.index)
            self._fetch_before(saved.storage.index)
        raw = saved.storage.on_device()
        out = torch.empty(0, dtype=saved.dtype, device=raw.device)
        return out.set_(raw.untyped_storage(), saved.offset, saved.shape, saved.stride)

    def _fetch_before(self, index: int) -> None:
        """Fetch the storages saved before `index` (latest first) until `_window` bytes are on their way."""
        ahead = 0
        for i in range(index - 1, max(-1, index - 1 - self.SCAN), -1):
            ref = self._saved.get(i)
            copy = ref() if ref is not None else None
            if copy is None:
                continue
            ahead += copy.in_flight() or copy.fetch(self._in)
            if ahead >= self._window:
                return

    def _copy(self, storage, version: int) -> _HostStorage:
        raw = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
        cuda = raw.is_cuda
        host = torch.empty(raw.numel(), dtype=torch.uint8, pin_memory=cuda)
        copy = _HostStorage(host, raw.device, version, self._count)
        self._saved[self._count] = weakref.ref(copy)
        weakref.finalize(copy, self._saved.pop, self._count, None)
        self._count += 1
        if cuda:
            self._out.wait_stream(torch.cuda.current_stream(raw.device))
            with torch.cuda.stream(self._out):
                host.copy_(raw, non_blocking=True)
                copy.copied = torch.cuda.Event()
                copy.copied.record(self._out)
            raw.record_stream(self._out)  # the allocator keeps the storage until the copy is done
        else:
            host.copy_(raw)
        self.bytes.add(host.numel())
        weakref.finalize(copy, self.bytes.sub, host.numel())
        return copy

    def _forget(self, key: int, known: weakref.ref) -> None:
        """The device storage is freed: its address may be reused by another."""
        if self._copies.get(key) is known:
            del self._copies[key]
