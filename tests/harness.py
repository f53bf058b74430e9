"""A pool of local gloo processes, started once and reused by many checks.

Process start-up (importing torch, the gloo rendezvous) costs seconds, so each world size gets
one pool per test session. A check is a module-level function ``check(*args)``; `WorkerPool.run`
executes it on every rank and returns the per-rank results, or raises with the failing rank's
traceback. Checks build their meshes through `mesh(...)`, which caches them per layout so that
process groups are created once per pool as well.
"""

from __future__ import annotations

import os
import queue
import time
import traceback

import torch.multiprocessing as mp

from tensorpar.distributed.launch import free_port

TASK_TIMEOUT_S = float(os.environ.get("TENSORPAR_TEST_TIMEOUT", "180"))

_meshes: dict = {}  # per worker process: (tp, pp, dp, cp, ep, expert_tp, device) -> Mesh
_process_groups: dict = {}  # per worker process: (ranks, n, timeout, backend) -> a group the meshes share


def mesh(tp: int, pp: int = 1, dp: int | None = None, cp: int = 1, ep: int | None = None, expert_tp: int = 1,
         device: str = "cpu", dp_replicate: int = 1):
    """The (cached) mesh for this layout, inside a worker: its process groups are those of the earlier layouts
    where they have the same ranks (creating gloo groups is most of the cost of a short run's first step)."""
    from unittest import mock

    import torch.distributed as dist

    import tensorpar

    key = (tp, pp, dp, cp, ep, expert_tp, str(device), dp_replicate)
    if key not in _meshes:
        create, asked = dist.new_group, {}

        def new_group_once(ranks, timeout=None, backend=None):
            # Two dimensions of one layout with the same ranks keep two groups, as in a run (the n-th request for a
            # set of ranks takes the n-th group of it). Every rank of a pool builds the same meshes in the same
            # order, so every rank skips the same (world-collective) creations; the meshes are never destroyed
            # (`_worker` leaves with os._exit), so no group is destroyed under another mesh.
            nth = asked[tuple(ranks)] = asked.get(tuple(ranks), -1) + 1
            group_key = (tuple(ranks), nth, timeout, backend)
            if group_key not in _process_groups:
                _process_groups[group_key] = create(ranks, timeout=timeout, backend=backend)
            return _process_groups[group_key]

        with mock.patch.object(dist, "new_group", new_group_once):
            _meshes[key] = tensorpar.init_mesh(tp=tp, pp=pp, dp=dp, cp=cp, ep=ep, expert_tp=expert_tp,
                                               device=device, timeout=60, dp_replicate=dp_replicate)
    m = _meshes[key]
    m.stats.reset()
    return m


def train(options):
    """`tensorpar.training.train(options)` on this worker's cached mesh of the run's layout: the process groups of
    a layout are created once per pool, not once per training run."""
    from tensorpar.training import run_training, validate

    run = validate(options)
    lay, moe = run.layout, run.cfg.is_moe
    return run_training(run, mesh=mesh(lay.tp, lay.pp, lay.dp, lay.cp, lay.expert_parallel(moe),
                                       lay.expert_tp if moe else 1, run.options.device or "cpu", lay.dp_replicate))


def _worker(rank: int, world_size: int, port: int, tasks, results) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        OMP_NUM_THREADS="1",
    )
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=60))
    while True:
        task = tasks.get()
        if task is None:
            break
        fn, args, kwargs = task
        try:
            results.put((rank, True, fn(*args, **kwargs)))
        except BaseException as e:  # noqa: BLE001 - report everything to the parent
            results.put((rank, False, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    # Leave without tearing down the world: every rank is leaving, and gloo's orderly teardown of the pool's groups
    # (one per cached mesh dimension) would cost seconds.
    os._exit(0)


# torch._dynamo: torch.optim imports it at the first optimizer a process builds (1.3 s here).
_PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "tensorpar.training", "harness"]


def _context():
    """A forkserver that has imported torch and tensorpar once: each worker is forked from it, ready, instead of
    importing them again (two to three seconds of CPU per worker)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


class WorkerPool:
    def __init__(self, world_size: int):
        self.world_size = world_size
        ctx = _context()
        self.tasks = [ctx.Queue() for _ in range(world_size)]
        self.results = ctx.Queue()
        port = free_port()
        self.procs = [
            ctx.Process(target=_worker, args=(r, world_size, port, self.tasks[r], self.results), daemon=True)
            for r in range(world_size)
        ]
        for p in self.procs:
            p.start()
        self.broken = False

    def run(self, fn, *args, timeout: float = TASK_TIMEOUT_S, **kwargs) -> list:
        """Run ``fn(*args, **kwargs)`` on every rank; the list of results in rank order."""
        if self.broken:
            raise RuntimeError("worker pool is broken by an earlier failure")
        for q in self.tasks:
            q.put((fn, args, kwargs))
        out, errors = [None] * self.world_size, {}
        for _ in range(self.world_size):
            try:
                # Once a rank has failed, its peers are likely stuck in a collective: don't wait long for them.
                rank, ok, value = self._next_result(15 if errors else timeout)
            except (queue.Empty, ChildProcessError) as e:
                self.broken = True
                self.close()
                if errors:
                    first = min(errors)
                    raise AssertionError(f"{fn.__name__} failed on ranks {sorted(errors)} (the others hung); "
                                         f"rank {first}:\n{errors[first]}") from None
                if isinstance(e, ChildProcessError):
                    raise AssertionError(f"{fn.__name__}: {e}") from None
                raise TimeoutError(f"{fn.__name__} did not finish on all {self.world_size} ranks within {timeout}s")
            if ok:
                out[rank] = value
            else:
                errors[rank] = value
        if errors:
            first = min(errors)
            raise AssertionError(f"{fn.__name__} failed on ranks {sorted(errors)}; rank {first}:\n{errors[first]}")
        return out

    def _next_result(self, timeout: float):
        """The next (rank, ok, value); queue.Empty after `timeout`, ChildProcessError as soon as a worker has died."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                return self.results.get(timeout=min(1.0, max(0.0, deadline - time.monotonic())))
            except queue.Empty:
                dead = [(r, p.exitcode) for r, p in enumerate(self.procs) if p.exitcode is not None]
                if dead:
                    raise ChildProcessError(", ".join(f"worker rank {r} died (exit code {c})" for r, c in dead))
                if time.monotonic() >= deadline:
                    raise

    def close(self) -> None:
        """Stop the workers: asked to leave, then killed. Nothing they hold outlives the session (no files, no
        checkpoints), and a gloo world's orderly teardown would cost seconds per pool."""
        for q, p in zip(self.tasks, self.procs):
            if p.is_alive():
                try:
                    q.put(None)
                except Exception:
                    pass
        deadline = time.monotonic() + 1.0
        for p in self.procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
        for p in self.procs:
            if p.is_alive():
                p.kill()
                p.join()


class Pools:
    """One lazily started pool per world size, shared by the whole test session."""

    def __init__(self):
        self._pools: dict[int, WorkerPool] = {}

    def __call__(self, world_size: int) -> WorkerPool:
        pool = self._pools.get(world_size)
        if pool is None or pool.broken:
            pool = self._pools[world_size] = WorkerPool(world_size)
        return pool

    def close(self) -> None:
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()


def run_cli(argv, hide_modules=()):
    """`tensorpar ARGV` run by this worker as one rank of the pool's world, as torchrun would start it: (exit
    status, stdout, stderr). `hide_modules`: modules whose import fails meanwhile (as if not installed)."""
    import contextlib
    import io
    import sys

    from tensorpar.cli import main

    out, err = io.StringIO(), io.StringIO()
    names = {m for m in sys.modules for h in hide_modules if m.startswith(h + ".")} | set(hide_modules)
    hidden = {name: sys.modules.get(name) for name in names}
    try:
        sys.modules.update(dict.fromkeys(names))  # None in sys.modules: `import name` raises ImportError
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main([str(a) for a in argv])
    finally:
        for name, module in hidden.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module
    return code, out.getvalue(), err.getvalue()
