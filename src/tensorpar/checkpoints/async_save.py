"""Asynchronous checkpoint saves (`--async-save`): the training thread copies this rank's share of the checkpoint
to host memory, and a background thread writes and hashes it while training goes on.

Who does what (the phases are those of `save_checkpoint`, checkpoints/sharded.py):

- the training thread, at a save: waits for the previous save and commits it, has rank 0 make the temporary
  folder (a barrier), takes the shards (ZeRO's gathers of parameters and moments: collectives) and copies them
  into host buffers (pinned on CUDA, plain on CPU), then starts the writer thread. The buffers are kept from save
  to save: they are the only extra memory (`staged_bytes`, one copy of what this rank writes);
- the writer thread: writes and hashes this rank's files, nothing else. No collective ever runs on it: gloo and
  NCCL collectives issued from two threads on one group can interleave and hang;
- the training thread, after each step while a save is pending (`poll`): one all-reduce (MAX) of every rank's
  (failed, still writing) flags. Once no rank is still writing, or one has failed, `commit_save` gathers every
  rank's file list (or error): rank 0 checks the files, writes meta.json, renames the folder into place and moves
  `latest`; an error fails every rank with its rank and file named. `wait` joins the writer first: the next save,
  a stop and the end of the run call it, so a run never ends with a save uncommitted.

Until the commit's rename a kill leaves only `.tmp-step-N` beside the previous checkpoint, which `latest` still
names. The per-step agreement is Megatron-LM's (its async save finalizes by an all-reduce of per-rank completion
each step); its writes run in forked processes, these in a thread: safetensors' writer and hashlib release the
GIL while they copy and hash.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import threading
import time

import torch

from tensorpar.checkpoints.sharded import Shard, begin_save, commit_save, step_folder, take_shards, write_shards
from tensorpar.distributed.sharding import shard_spec, tag


@dataclasses.dataclass
class _PendingSave:
    """A save whose files the writer thread is writing."""

    root: str
    step: int
    tmp: str
    shards: list[Shard]  # the host copies
    facts: dict  # meta.json's optimizer_step, model, run_id, layout, train, options
    keep_last: int
    stage_s: float  # training-thread seconds spent taking and copying the shards
    done: threading.Event = dataclasses.field(default_factory=threading.Event)
    result: list | str | None = None  # the writer's file entries, or what went wrong; set before `done`
    write_s: float = 0.0
    write_cpu_s: float = 0.0  # the writer thread's CPU time: what it takes from the cores training runs on


class AsyncCheckpointer:
    """One rank's asynchronous saves: at most one pending at a time. `save`, `poll` and `wait` are collectives
    (every rank calls them at the same steps); they run on the training thread only."""

    def __init__(self, mesh):
        self.mesh = mesh
        self._buffers: dict[tuple, torch.Tensor] = {}  # (file, kind, name) -> its host copy, reused
        self._pending: _PendingSave | None = None
        self.history: list[dict] = []  # one entry per committed save

    @property
    def staged_bytes(self) -> int:
        """Bytes of host memory the copies hold (this rank's share of one checkpoint)."""
        return sum(b.numel() * b.element_size() for b in self._buffers.values())

    @property
    def pending(self) -> bool:
        return self._pending is not None

    def save(self, root: str, step: int, model, optimizer, facts: dict, keep_last: int) -> str:
        """Start saving step `step` (committing a pending save first); the folder it will have once committed."""
        self.wait(step)
        t0 = time.perf_counter()
        tmp = begin_save(root, step, self.mesh)
        with optimizer.gathered():  # ZeRO-3: the parameters are whole only inside
            shards, opt_step = take_shards(model, optimizer, self.mesh)
            staged = [self._stage(s) for s in shards]
        if self.mesh.device.type == "cuda":
            torch.cuda.current_stream(self.mesh.device).synchronize()  # the copies to pinned memory have landed
        pending = _PendingSave(root, step, tmp, staged, {"optimizer_step": opt_step, **facts}, keep_last,
                               time.perf_counter() - t0)
        threading.Thread(target=self._write, args=(pending,), name=f"tensorpar-save-step-{step}",
                         daemon=True).start()  # daemon: a run that fails does not wait for it
        self._pending = pending
        return step_folder(root, step)

    def poll(self, steps_done: int) -> str | None:
        """After a step: commit the pending save if every rank has written its files (or fail every rank if one
        could not); the committed folder, else None."""
        p = self._pending
        if p is None:
            return None
        done = p.done.is_set()
        flags = torch.tensor([int(done and isinstance(p.result, str)), int(not done)], device=self.mesh.device)
        self.mesh.world_group.all_reduce(flags, op="max")
        failed, writing = (int(x) for x in flags.tolist())
        if writing and not failed:
            return None
        return self._commit(steps_done, 0.0)

    def wait(self, steps_done: int) -> str | None:
        """Wait for the pending save's files and commit it; its folder, or None when no save was pending."""
        p = self._pending
        if p is None:
            return None
        t0 = time.perf_counter()
        p.done.wait()
        return self._commit(steps_done, time.perf_counter() - t0)

    def summary(self) -> dict:
        return {"staged_mib": self.staged_bytes / 2**20, "saves": self.history}

    def _commit(self, steps_done: int, waited_s: float) -> str:
        p, self._pending = self._pending, None
        result = p.result if p.done.is_set() else None  # None: still writing (another rank has failed)
        final = commit_save(p.root, p.step, result, self.mesh, p.facts, p.keep_last)
        self.history.append({"step": p.step, "committed_after_step": steps_done, "stage_s": p.stage_s,
                             "write_s": p.write_s, "write_cpu_s": p.write_cpu_s, "waited_s": waited_s})
        return final

    def _write(self, p: _PendingSave) -> None:
        _lowest_cpu_priority()
        t0, c0 = time.perf_counter(), time.thread_time()
        try:
            p.result = write_shards(p.tmp, p.step, p.shards)
        except BaseException as e:  # noqa: BLE001 - reported by the commit, on every rank
            p.result = f"the writer thread failed: {type(e).__name__}: {e}"
        finally:
            p.write_s, p.write_cpu_s = time.perf_counter() - t0, time.thread_time() - c0
            p.done.set()

    def _stage(self, shard: Shard) -> Shard:
        """`shard` copied to host buffers: what the file holds (the fp32 master where there is one) and no more."""
        params, moments = {}, {}
        for name, p in shard.params.items():
            m = shard.moments[name]
            params[name] = tag(self._copy((shard.file_name, "param", name), m.get("master", p.detach())),
                               shard_spec(p))
            moments[name] = {k: self._copy((shard.file_name, k, name), v) for k, v in m.items() if k != "master"}
        return Shard(shard.file_name, params, moments, shard.position)

    def _copy(self, key: tuple, t: torch.Tensor) -> torch.Tensor:
        buf = self._buffers.get(key)
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
            buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=t.is_cuda)
            self._buffers[key] = buf
        buf.copy_(t.detach(), non_blocking=t.is_cuda)
        return buf


def _lowest_cpu_priority() -> None:
    """Nice 19 for the calling thread (on Linux the nice value is per thread): the writer runs on the cycles training
    leaves idle and takes few from a busy core. Lowering one's own priority needs no privilege."""
    if sys.platform == "linux":
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        except OSError:
            pass
