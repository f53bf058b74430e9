"""Under torchrun, every rank gets to say why it refuses to start.

Bad options are refused by every rank on its own, before the process group exists, so that no rank waits in a
collective for one that has quit. But torchrun's agent stops the whole job (SIGTERM) the moment one worker exits:
on a loaded machine a rank still importing torch when its sibling exits is killed before it could print its own
refusal, and the user reading that rank's log sees only a signal. So a rank refusing under torchrun first counts
itself in the agent's store and waits, at most `timeout_s`, until every rank of the job has done the same. Ranks
that refuse for the same reason (the options are the same everywhere) all print it and leave together within
milliseconds; a rank that started fine never counts, and the refusing ones leave after `timeout_s`.
"""

from __future__ import annotations

import datetime
import os
import time

from tensorpar.distributed.launch import TORCHRUN_ENV

WAIT_S = 10.0


def wait_for_siblings_to_refuse(timeout_s: float = WAIT_S) -> bool:
    """Count this refusing rank in torchrun's store and wait until every rank has refused or `timeout_s` passed;
    whether every rank did. Does nothing (False) outside torchrun, in a world of one, once the process group
    exists (the error then comes from a running job), or where the agent's store cannot be reached."""
    env = os.environ
    world = int(env.get("WORLD_SIZE", "1"))
    if TORCHRUN_ENV not in env or world <= 1 or env.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return False
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return False
    try:
        store = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), is_master=False,
                              timeout=datetime.timedelta(seconds=timeout_s))
        key = f"tensorpar/refused/{env.get('TORCHELASTIC_RESTART_COUNT', '0')}"
        count = store.add(key, 1)
        deadline = time.monotonic() + timeout_s
        while count < world and time.monotonic() < deadline:
            time.sleep(0.02)
            count = store.add(key, 0)
        return count >= world
    except Exception:  # noqa: BLE001 - an unreachable store only loses the wait, never the refusal itself
        return False
