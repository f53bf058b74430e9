"""Start local processes the way torchrun does and supervise them like its elastic agent, or use torchrun's.

From a plain shell, `tensorpar <command>` re-runs itself as N child processes with the
environment torchrun would give them (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT): on Linux
forked from the copy of itself it made after its imports (`tensorpar.distributed.zygote`), elsewhere
started anew. Under torchrun (or in such a child) the command just runs.

The launcher (`Supervisor`) never exits while one of its workers lives:

- SIGTERM or SIGINT to the launcher is forwarded once to every worker (each runs in its own
  session, so a Ctrl-C at the terminal reaches them only through the launcher); workers still
  alive after the grace period are killed; a second signal kills them at once. The launcher then
  exits with 128 + the signal's number.
- When a worker fails, the others are stopped (SIGTERM, a short grace, then SIGKILL; a worker that is itself
  stopped, by SIGSTOP or a debugger, cannot act on SIGTERM and is killed at once) and one line
  per failed rank says its rank, pid, exit status or signal, and the last error it reported (each
  worker writes its error to the file named by TENSORPAR_ERROR_FILE). The launcher's own status
  is the first failure's (128 + signal for a worker killed by a signal).
- A worker that stops on its own after SIGTERM or SIGINT (status 143 or 130: a scheduler signalled every
  process of the job, or someone signalled one rank) is a stop, not a failure: the others, which agree
  on the stop among themselves, get the grace period and no second signal.
- On Linux each worker asks, first thing, to be killed if the launcher dies (PR_SET_PDEATHSIG,
  `follow_launcher`), so even a launcher killed with SIGKILL leaves no orphan training on. A worker of
  torchrun's agent does the same with the agent.
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time

from tensorpar.distributed import zygote
from tensorpar.distributed.prctl import PR_SET_NAME, PR_SET_PDEATHSIG, prctl

SPAWNED_ENV = "TENSORPAR_SPAWNED"
ERROR_FILE_ENV = "TENSORPAR_ERROR_FILE"
LAUNCHER_PID_ENV = "TENSORPAR_LAUNCHER_PID"
TORCHRUN_ENV = "TORCHELASTIC_RUN_ID"  # torchrun's agent sets it in every worker it starts
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
DEFAULT_GRACE_S = 30.0
FAILURE_GRACE_S = 5.0  # after a worker failed, the others are likely stuck in a collective: stop them soon


def under_launcher() -> bool:
    """True under torchrun or in a process that tensorpar itself spawned."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def world_size(options) -> int:
    """The number of processes a command with these layout options runs on: the launcher's (torchrun's, or
    this one's for its workers), or the ones it will start (`nproc`, else tp x cp x pp x dp)."""
    if under_launcher():
        return int(os.environ["WORLD_SIZE"])
    return options.nproc or options.tp * options.cp * options.pp * (options.dp or 1)


def free_port() -> int:
    """A TCP port free on 127.0.0.1 for rank 0's rendezvous store. Drawn at random below the kernel's ephemeral range
    and checked: a port the kernel picks (bind to port 0) comes from that range, where every outgoing connection
    (gloo opens several per pair of ranks) also takes its local port, so on a busy machine one of them could take it
    between this check and rank 0's bind. The kernel's own pick where no such port is free."""
    low = _ephemeral_low()
    rng = random.SystemRandom()
    for _ in range(100):
        port = rng.randrange(max(1024, low - 16384), low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (Linux: /proc/sys/net/ipv4/ip_local_port_range; IANA's 49152
    elsewhere)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 49152


def usable_cpus() -> int:
    """The cores this process may run on: a cgroup's, taskset's or Slurm's share where the OS says so (Linux), else
    the machine's."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def threads_per_process(nprocs: int, cpus: int | None = None) -> int:
    """The threads each of `nprocs` processes gets of `cpus` cores (default: those this process may use)."""
    return max(1, (cpus or usable_cpus()) // nprocs)


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def record_error(message: str) -> None:
    """Leave this process's last error where its launcher looks for it (a no-op outside a tensorpar launcher)."""
    path = os.environ.get(ERROR_FILE_ENV)
    if path:
        try:
            with open(path, "w") as f:
                f.write(message.strip() + "\n")
        except OSError:
            pass


def follow_launcher() -> None:
    """In a worker of a tensorpar launcher or of torchrun's agent: be killed when the launcher dies (Linux), or
    exit now if it already has; a rank of tensorpar's launcher is also named `tensorpar-rN` (/proc/PID/comm, what
    ps and top show). Called first thing by the command line (a no-op elsewhere).

    torchrun starts each worker in a session of its own and does not do this: an agent killed with SIGKILL (or
    its node's process group killed) would leave its workers training on, with the other nodes' ranks, as
    orphans; with it they die, and the other nodes' ranks fail their next collective, naming it."""
    launcher = os.environ.get(LAUNCHER_PID_ENV)
    if launcher is None and TORCHRUN_ENV in os.environ and "RANK" in os.environ:
        launcher = str(os.getppid())  # torchrun's agent starts its workers itself
    if launcher is None:
        return
    prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if LAUNCHER_PID_ENV in os.environ:  # tensorpar's own ranks are named by rank in ps and top
        prctl(PR_SET_NAME, ctypes.c_char_p(f"tensorpar-r{os.environ.get('RANK', '')}".encode()[:15]))
    if os.getppid() != int(launcher):  # the launcher died before prctl took effect
        os._exit(1)


def stop_signal(returncode: int | None) -> int | None:
    """The stop signal (SIGTERM, SIGINT) a process ended on, by dying of it or by exiting with 128 + it."""
    for signum in STOP_SIGNALS:
        if returncode in (-signum, 128 + signum):
            return signum
    return None


class ForkedProcess:
    """A child process this process did not start with `subprocess` (a rank forked from the zygote), with the part of
    `subprocess.Popen`'s interface the supervisor uses: pid, returncode, poll, wait, send_signal."""

    def __init__(self, pid: int):
        self.pid, self.returncode = pid, None

    def _reaped(self, flags: int) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, flags)
            except ChildProcessError:  # reaped elsewhere: its status is lost
                self.returncode = 255
                return self.returncode
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def poll(self) -> int | None:
        return self._reaped(os.WNOHANG)

    def wait(self) -> int:
        return self._reaped(0)

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, signum)


@dataclasses.dataclass
class _Worker:
    rank: int
    proc: subprocess.Popen | ForkedProcess
    error_file: str
    failed_first: bool = False  # failed on its own, before the launcher stopped it
    signalled: bool = False  # the launcher forwarded the stop signal to it

    def last_error(self) -> str:
        try:
            with open(self.error_file) as f:
                lines = [ln.strip() for ln in f if ln.strip()]
        except OSError:
            return ""
        return lines[-1] if lines else ""

    def describe(self, when: str = "") -> str:
        code = self.proc.returncode
        what = f"was killed by {signal_name(-code)}" if code < 0 else f"exited with status {code}"
        error = self.last_error()
        return f"rank {self.rank} (pid {self.proc.pid}) {what}{when}" + (f": {error}" if error else "")


def _is_stopped(pid: int) -> bool:
    """Whether the process is stopped (state T, or t when traced); False where /proc cannot tell."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except (OSError, IndexError):
        return False


def _status(code: int) -> int:
    return 128 - code if code < 0 else code


class Supervisor:
    """Runs ``python -m tensorpar *argv`` as `nprocs` local ranks and watches them until all have exited."""

    def __init__(self, nprocs: int, argv: list[str], grace_s: float = DEFAULT_GRACE_S, poll_s: float = 0.05):
        self.nprocs, self.argv, self.grace_s, self.poll_s = nprocs, argv, grace_s, poll_s
        self.workers: list[_Worker] = []
        self.signum: int | None = None  # the first stop signal received
        self.kill_at: float | None = None  # when the workers still alive get SIGKILL
        self.kill_after = grace_s  # the grace that kill_at gives

    def _start(self, tmp: str) -> None:
        port = free_port()
        envs = []
        for rank in range(self.nprocs):
            env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(self.nprocs), LOCAL_RANK=str(rank),
                       LOCAL_WORLD_SIZE=str(self.nprocs), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                       **{SPAWNED_ENV: "1", ERROR_FILE_ENV: os.path.join(tmp, f"rank-{rank}.err"),
                          LAUNCHER_PID_ENV: str(os.getpid())})
            env.setdefault("OMP_NUM_THREADS", str(threads_per_process(self.nprocs)))
            envs.append(env)
        for rank, proc in enumerate(self._processes(envs)):
            self.workers.append(_Worker(rank, proc, envs[rank][ERROR_FILE_ENV]))
        if self.signum is not None:  # a signal that came while the workers were starting reaches them all
            self._forward([w for w in self.workers if not w.signalled])

    def _processes(self, envs: list[dict]) -> list:
        """One process per environment, each in a session of its own: forked from the zygote where this process
        has one (`tensorpar.distributed.zygote`), else `python -m tensorpar ARGV` started anew."""
        forker = zygote.take()
        pids = forker.start(envs) if forker is not None else None
        if pids is not None:
            return [ForkedProcess(pid) for pid in pids]
        return [subprocess.Popen([sys.executable, "-m", "tensorpar", *self.argv], env=env, start_new_session=True)
                for env in envs]

    def _alive(self) -> list[_Worker]:
        return [w for w in self.workers if w.proc.poll() is None]

    def _send(self, signum: int, workers=None) -> None:
        for w in self._alive() if workers is None else workers:
            try:
                w.proc.send_signal(signum)
            except ProcessLookupError:
                pass

    def _forward(self, workers) -> None:
        self._send(self.signum, workers)
        for w in workers:
            w.signalled = True

    def _on_signal(self, signum, frame) -> None:
        if self.signum is not None:  # a second signal: stop now
            self._send(signal.SIGKILL)
            return
        self.signum = signum
        self._forward(self._alive())
        self._kill_in(self.grace_s)

    def _kill_in(self, seconds: float) -> None:
        self.kill_at, self.kill_after = time.monotonic() + seconds, seconds

    def _kill_overdue(self) -> None:
        if self.kill_at is not None and time.monotonic() >= self.kill_at:
            for w in self._alive():
                sys.stderr.write(f"tensorpar: error: rank {w.rank} (pid {w.proc.pid}) did not stop within "
                                 f"{self.kill_after:g} s; killing it\n")
            self._send(signal.SIGKILL)
            self.kill_at = None

    def _watch(self) -> int:
        while True:
            self._kill_overdue()
            alive = self._alive()
            ended = [w for w in self.workers if w.proc.returncode not in (None, 0)]
            stops = [stop_signal(w.proc.returncode) for w in ended if stop_signal(w.proc.returncode)]
            if self.signum is None and stops and not any(w.failed_first for w in self.workers):
                self.signum = stops[0]  # a rank stopping on a signal of its own: the others stop with it
                self._kill_in(self.grace_s)
            failed = [w for w in ended if stop_signal(w.proc.returncode) is None]
            if self.signum is None and failed and not any(w.failed_first for w in self.workers):
                for w in failed:
                    w.failed_first = True
                self._send(signal.SIGTERM)
                # A rank stopped by SIGSTOP (or held by a debugger) cannot act on SIGTERM: it goes at once.
                self._send(signal.SIGKILL, [w for w in self._alive() if _is_stopped(w.proc.pid)])
                self._kill_in(FAILURE_GRACE_S)
            if not alive:
                return self._report()
            time.sleep(self.poll_s)

    def _report(self) -> int:
        if self.signum is not None and not any(w.failed_first for w in self.workers):
            # Stopped by the signal, unless every rank had finished its work anyway.
            return 0 if all(w.proc.returncode == 0 for w in self.workers) else 128 + self.signum
        first = sorted((w for w in self.workers if w.failed_first), key=lambda w: (w.proc.returncode >= 0, w.rank))
        if not first:
            return 0
        lines = [w.describe() for w in first]
        after = f" after rank {first[0].rank} failed"
        stopped = []
        for w in self.workers:
            if not w.failed_first and w.proc.returncode != 0:
                if w.last_error():  # it failed on its own too (a collective with the dead rank, say)
                    lines.append(w.describe(after))
                else:
                    stopped.append(str(w.rank))
        if stopped:
            lines.append(f"stopped rank{'s' if len(stopped) > 1 else ''} {', '.join(stopped)}{after}")
        for line in lines:
            sys.stderr.write(f"tensorpar: error: {line}\n")
        sys.stderr.flush()
        return _status(first[0].proc.returncode)

    def run(self) -> int:
        handlers = {s: signal.signal(s, self._on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            with tempfile.TemporaryDirectory(prefix="tensorpar-launch-") as tmp:
                self._start(tmp)
                return self._watch()
        finally:
            if self._alive():  # an exception in the launcher itself: take the workers down with it
                self._send(signal.SIGKILL)
                for w in self.workers:
                    w.proc.wait()
            for s, h in handlers.items():
                signal.signal(s, h)


def spawn_local(nprocs: int, argv: list[str], grace_s: float = DEFAULT_GRACE_S) -> int:
    """Run ``python -m tensorpar *argv`` as `nprocs` supervised ranks on this machine; the job's exit status."""
    return Supervisor(nprocs, argv, grace_s).run()
