"""A flight recorder of collectives: each rank's last collectives, written down when a run goes wrong.

Every `Group` of a mesh shares one `CommStats`, and through it one `FlightRecorder`: each collective is entered
when it starts (group, its members, operation, elements, dtype, its sequence number on that group) and marked
completed or failed when it ends. Only the last `capacity` entries are kept. When a collective fails (a timeout, a
peer that died or broke off) the recorder writes them to ``FOLDER/rank{r}.json`` before the error propagates; the
trainer does the same when the run is stopped by a signal, or at its end with ``--dump-collectives-on-exit``.
`tensorpar diagnose` (tensorpar.distributed.flight_diagnosis) reads the ranks' files together.

Ranks that run the same program issue the same collectives on a group in the same order, so the n-th collective
of group 'tp' is the same call on every member: sequence numbers are what the ranks' records are compared by.
Point-to-point sends and receives (the pipeline's) are numbered apart (`p2p`): each involves two ranks, not the
group.
"""

from __future__ import annotations

import collections
import json
import os
import time

FORMAT = "tensorpar-flight-1"
P2P_OPS = ("send", "recv")


class FlightRecorder:
    """The last `capacity` collectives of this process. `folder`: where `dump` writes (None: nowhere)."""

    def __init__(self, capacity: int = 2000):
        self.entries: collections.deque = collections.deque(maxlen=capacity)
        self.sequence: dict[str, int] = collections.defaultdict(int)
        self.folder: str | None = None
        self.rank, self.world_size = 0, 1
        self.started = time.time()  # before the rendezvous: every rank of a run writes its record after this

    def start(self, group: str, ranks: list[int], op: str, elements: int, dtype: str) -> dict:
        """Enter a collective that is starting; returns its entry (to `end`)."""
        p2p = op in P2P_OPS
        key = f"{group} p2p" if p2p else group
        self.sequence[key] += 1
        entry = {"seq": self.sequence[key], "group": group, "ranks": list(ranks), "op": op, "elements": elements,
                 "dtype": dtype, "p2p": p2p, "start": time.time(), "end": None, "state": "started"}
        self.entries.append(entry)
        return entry

    @staticmethod
    def end(entry: dict, ok: bool = True) -> None:
        entry["end"], entry["state"] = time.time(), "completed" if ok else "failed"

    def dump(self, reason: str) -> str | None:
        """Write the entries to FOLDER/rank{r}.json (atomically); the path, or None without a folder."""
        if self.folder is None:
            return None
        os.makedirs(self.folder, exist_ok=True)
        path = os.path.join(self.folder, f"rank{self.rank}.json")
        record = {"format": FORMAT, "rank": self.rank, "world_size": self.world_size, "pid": os.getpid(),
                  "started": self.started, "reason": reason, "time": time.time(), "entries": list(self.entries)}
        tmp = f"{path}.tmp-{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump(record, f)
        os.replace(tmp, path)
        return path
