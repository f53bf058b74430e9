"""Local ranks forked from a copy of the launcher made right after its imports, instead of each rank starting a new
Python and importing torch and tensorpar again: a rank starts in milliseconds instead of seconds (1.5 to 3 s of CPU
each on a 2-core machine, more where eight ranks import from a shared file system at once).

The copy, the zygote, is forked by `tensorpar`'s entry point before it does anything else: it has touched no GPU,
started no thread and opened no file, so a process forked from it is what a new `python -m tensorpar` is once its
imports are done. This is multiprocessing's forkserver with its modules preloaded, which CUDA supports (what CUDA
does not support is forking a process that has initialised it, as the launcher may have by then). The launcher asks
the zygote once, for all its ranks: the zygote forks them and exits, and the launcher, a child subreaper, adopts
them, so that they are its children as if it had started them (`Supervisor` waits for them and signals them).

Linux only; elsewhere, under a launcher (torchrun, srun, a rank itself) or with TENSORPAR_FORK_RANKS=0, every rank
is a new process (`subprocess`), as before. The zygote is a resource of the process's entry point: `fork_at_entry`
makes it, and the launcher takes it (`take`) or lets it go (`discard`); nothing else holds one.
"""

from __future__ import annotations

import gc
import os
import pickle
import random
import signal
import struct
import sys
import time

from tensorpar.distributed.prctl import PR_SET_CHILD_SUBREAPER, PR_SET_PDEATHSIG, prctl
from tensorpar.errors import TensorparError

FORK_ENV = "TENSORPAR_FORK_RANKS"
_REPARENT_TIMEOUT_S = 30.0


def _send(fd: int, obj) -> None:
    payload = pickle.dumps(obj)
    data = memoryview(struct.pack("<Q", len(payload)) + payload)
    while data:  # a signal can end a write to a pipe part-way
        data = data[os.write(fd, data):]


def _receive(fd: int):
    """The next object on `fd`; EOFError when the other end has closed it."""
    def read(n: int) -> bytes:
        out = b""
        while len(out) < n:
            chunk = os.read(fd, n - len(out))
            if not chunk:
                raise EOFError
            out += chunk
        return out

    return pickle.loads(read(struct.unpack("<Q", read(8))[0]))


class Zygote:
    """The launcher's handle on its zygote: `start(envs)` forks one rank per environment, once."""

    def __init__(self, pid: int, requests: int, replies: int):
        self.pid, self._requests, self._replies = pid, requests, replies

    def start(self, envs: list[dict[str, str]]) -> list[int] | None:
        """Fork a rank for each environment (in a session of its own, as `start_new_session`); their pids, each now
        this process's child. None where this process cannot adopt them (the caller starts new processes)."""
        if not prctl(PR_SET_CHILD_SUBREAPER, 1):
            self.discard()
            return None
        try:
            _send(self._requests, envs)
            return _receive(self._replies)
        except (OSError, EOFError) as e:
            # Some ranks may be forked already: starting others anew would start a rank twice. They stop when
            # this process exits (their death signal), and the command says what happened.
            raise TensorparError(f"the ranks could not be forked from the launcher's zygote ({e!r}); "
                                 f"{FORK_ENV}=0 starts each as a new process") from e
        finally:
            self.discard()  # the zygote exits once it has forked the ranks: they are reparented here

    def discard(self) -> None:
        """Let the zygote go (it exits when its request pipe closes) and reap it."""
        for fd in (self._requests, self._replies):
            try:
                os.close(fd)
            except OSError:
                pass
        self._requests = self._replies = -1
        try:
            os.waitpid(self.pid, 0)
        except ChildProcessError:
            pass


_zygote: Zygote | None = None


def wanted(argv: list[str], environ=os.environ) -> bool:
    """Whether the entry point of `tensorpar ARGV`, where it is not itself a rank of some launcher, should fork a
    zygote: on Linux, for the commands that start ranks, unless TENSORPAR_FORK_RANKS=0."""
    return (sys.platform.startswith("linux") and environ.get(FORK_ENV, "1") != "0" and bool(argv)
            and argv[0] in ("train", "eval", "generate", "serve", "demo"))


def fork_at_entry() -> None:
    """Fork the zygote. Returns in the launcher (holding it) and, later, in each rank forked from it: a rank returns
    with its own environment (RANK, WORLD_SIZE, ...), in its own session, as the launcher's child, and carries on
    as a rank of the same command line."""
    global _zygote
    requests_r, requests_w = os.pipe()
    replies_r, replies_w = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        os.close(requests_r)
        os.close(replies_w)
        _zygote = Zygote(pid, requests_w, replies_r)
        return
    os.close(requests_w)
    os.close(replies_r)
    _serve(requests_r, replies_w)  # returns only in a rank


def _serve(requests: int, replies: int) -> None:
    """The zygote: wait for the launcher's one request, fork its ranks, report their pids and exit."""
    launcher = os.getppid()
    prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != launcher:
        os._exit(0)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C at the terminal is the launcher's to forward
    try:
        envs = _receive(requests)
    except (EOFError, OSError):
        os._exit(0)
    # What the ranks inherit stays out of their garbage collections: a collection that visited it would write to
    # every page of it, copying each, and slow each rank's exit by about a second.
    gc.freeze()
    pids = []
    for env in envs:
        pid = os.fork()
        if pid == 0:
            os.close(requests)
            os.close(replies)
            _become_rank(env, launcher)
            return
        pids.append(pid)
    try:
        _send(replies, pids)
    finally:
        os._exit(0)


def _become_rank(env: dict[str, str], launcher: int) -> None:
    os.setsid()
    os.environ.clear()
    os.environ.update(env)
    random.seed()  # Python's own generator, seeded afresh as a new process's is
    signal.signal(signal.SIGINT, signal.default_int_handler)
    zygote, deadline = os.getppid(), time.monotonic() + _REPARENT_TIMEOUT_S
    while os.getppid() != launcher:  # until the zygote has exited and the launcher adopted this process
        if os.getppid() != zygote or time.monotonic() > deadline:
            os._exit(1)  # the launcher is gone
        time.sleep(0.001)


def take() -> Zygote | None:
    """The zygote, for the launcher to start its ranks with (once); None where there is none."""
    global _zygote
    zygote, _zygote = _zygote, None
    return zygote


def discard() -> None:
    """No rank will be started here: let the zygote go."""
    zygote = take()
    if zygote is not None:
        zygote.discard()
