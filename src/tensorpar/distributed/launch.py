"""Start local processes the way torchrun does, or use torchrun's.

From a plain shell, `tensorpar <command>` re-runs itself as N child processes with the
environment torchrun would give them (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT).
Under torchrun (or in such a child) the command just runs. If any child fails, the others are
stopped so that no rank is left waiting in a collective.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

SPAWNED_ENV = "TENSORPAR_SPAWNED"


def under_launcher() -> bool:
    """True under torchrun or in a process that tensorpar itself spawned."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def threads_per_process(nprocs: int) -> int:
    return max(1, (os.cpu_count() or 1) // nprocs)


def spawn_local(nprocs: int, argv: list[str], grace_s: float = 5.0) -> int:
    """Run ``python -m tensorpar *argv`` as `nprocs` ranks on this machine; the first failing exit code, or 0."""
    port = free_port()
    procs = []
    for rank in range(nprocs):
        env = dict(os.environ)
        env.update(
            RANK=str(rank),
            WORLD_SIZE=str(nprocs),
            LOCAL_RANK=str(rank),
            LOCAL_WORLD_SIZE=str(nprocs),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            **{SPAWNED_ENV: "1"},
        )
        env.setdefault("OMP_NUM_THREADS", str(threads_per_process(nprocs)))
        procs.append(subprocess.Popen([sys.executable, "-m", "tensorpar", *argv], env=env))

    def stop_all():
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for p in procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()

    try:
        while True:
            codes = [p.poll() for p in procs]
            failed = [c for c in codes if c not in (None, 0)]
            if failed:
                stop_all()
                return failed[0]
            if all(c == 0 for c in codes):
                return 0
            time.sleep(0.05)
    except KeyboardInterrupt:
        stop_all()
        return 130
