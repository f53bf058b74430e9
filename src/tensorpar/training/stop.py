"""Stopping a training run on SIGTERM or SIGINT (Ctrl-C) the way a scheduler expects: cleanly, and saved.

The first signal only sets a flag. Before each step every rank all-reduces its flag (MAX, one
4-byte collective on the world group), so all ranks see the stop at the same step whichever
of them received the signal first; the run then saves the last completed step (with `--save`)
and ends with status 128 + the signal's number. This is Megatron-LM's exit-signal handler, with the
agreement made explicit.

A second signal means "stop now" only where nobody else escalates: under tensorpar's launcher the
launcher does (it turns a second signal into SIGKILL), and a scheduler that signals every process of
the job makes each rank receive the stop twice (once directly, once forwarded), so there
(``escalate=False``) repeats are ignored. Elsewhere (torchrun, one process) a second signal more than
`REPEAT_WINDOW_S` after the first restores the default action and re-raises it, and, as tensorpar's launcher
kills its ranks `--grace-period` seconds after the first, the process ends itself then (``grace_s``) if the step it
waits for (a long one, or one stuck) has not ended: a stop always ends the run within the grace period.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

import torch

from tensorpar.distributed.launch import STOP_SIGNALS, signal_name

REPEAT_WINDOW_S = 1.0  # a second copy of the same stop arriving this soon is the same stop


class GracefulStop:
    """Catches STOP_SIGNALS while installed (a context manager; the main thread only) and says, collectively,
    whether the run should stop before its next step."""

    def __init__(self, escalate: bool = True, grace_s: float | None = None):
        self.signum: int | None = None
        self.escalate, self.grace_s = escalate, grace_s
        self._timer: threading.Timer | None = None
        self._first_at = 0.0
        self._previous: dict[int, object] = {}

    def __enter__(self) -> "GracefulStop":
        if threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.signal(s, self._handle) for s in STOP_SIGNALS}
        return self

    def __exit__(self, *exc) -> None:
        if self._timer is not None:  # the run ended within its grace period
            self._timer.cancel()
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous = {}

    def _handle(self, signum, frame) -> None:
        if self.signum is None:
            self.signum, self._first_at = signum, time.monotonic()
            if self.escalate and self.grace_s is not None:
                self._timer = threading.Timer(self.grace_s, self._expire, args=(signum,))
                self._timer.daemon = True
                self._timer.start()
        elif self.escalate and time.monotonic() - self._first_at > REPEAT_WINDOW_S:  # a second stop: now
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)

    def _expire(self, signum: int) -> None:
        """The grace period is over and the process still runs: end it (a thread cannot re-raise the signal)."""
        sys.stderr.write(f"tensorpar: error: still running {self.grace_s:g} s after {signal_name(signum)} "
                         f"(--grace-period): stopped without finishing the step\n")
        sys.stderr.flush()
        os._exit(128 + signum)

    def agreed(self, group, device) -> int | None:
        """The stop signal if any rank of `group` received one (a collective: every rank calls it), else None."""
        flag = torch.tensor([self.signum or 0], dtype=torch.int32, device=device)
        group.all_reduce(flag, op="max")
        return int(flag.item()) or None
