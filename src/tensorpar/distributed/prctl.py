"""Linux's prctl(2), the few options the launcher and its ranks use; a no-op elsewhere."""

from __future__ import annotations

import ctypes

PR_SET_PDEATHSIG = 1  # the signal this process gets when its parent dies
PR_SET_NAME = 15  # this process's name in /proc/PID/comm (what ps and top show), 15 bytes at most
PR_SET_CHILD_SUBREAPER = 36  # orphans below this process are reparented to it, not to init


def prctl(option: int, arg) -> bool:
    """prctl(option, arg); whether it took effect (False where there is no prctl: not Linux)."""
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(option, arg, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False
