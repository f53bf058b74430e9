"""Reading the ranks' flight records together (`tensorpar diagnose`): which rank is behind, in which collective
the others waited, and which ranks disagree about a collective.

The n-th collective on a group is the same call on every member (tensorpar.distributed.flight_recorder), so:
- a member whose record of a group ends before the collective the others are waiting in never reached it (it is
  stopped, hangs, or died: a rank that left no record at all died or was killed or stopped before it could write);
- members whose n-th collective on a group differs in operation, size or dtype ran different programs there (a
  mismatched collective, which hangs or corrupts the run).
"""

from __future__ import annotations

import glob
import json
import os

from tensorpar.distributed.flight_recorder import FORMAT
from tensorpar.errors import TensorparError


def load_records(folder: str) -> dict[int, dict]:
    """{rank: its flight record} of OUT_DIR/flight (or of `folder` itself when it holds the rank files)."""
    if not os.path.isdir(folder):
        raise TensorparError(f"{folder} is not a folder: give a run's OUT_DIR or its flight folder")
    if os.path.isdir(os.path.join(folder, "flight")):
        folder = os.path.join(folder, "flight")
    records = {}
    for path in sorted(glob.glob(os.path.join(folder, "rank*.json"))):
        try:
            with open(path) as f:
                record = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            raise TensorparError(f"cannot read the flight record {path}: {e}") from e
        if record.get("format") != FORMAT:
            raise TensorparError(f"{path} is not a tensorpar flight record (format {record.get('format')!r})")
        records[record["rank"]] = record
    if not records:
        raise TensorparError(f"no flight records (rank*.json) in {folder}: a run writes them to OUT_DIR/flight when a "
                             f"collective fails, when it is stopped, or at its end with --dump-collectives-on-exit")
    return records


def _by_group(records: dict[int, dict], p2p: bool = False) -> dict[tuple[str, tuple[int, ...]], dict]:
    """{(group name, its ranks): {rank: {sequence number: entry}}} of the collectives (`p2p`: of the point-to-point
    transfers, numbered apart)."""
    groups: dict = {}
    for rank, record in records.items():
        for entry in record["entries"]:
            if entry.get("p2p", False) == p2p:
                key = (entry["group"], tuple(entry["ranks"]))
                groups.setdefault(key, {}).setdefault(rank, {})[entry["seq"]] = entry
    return groups


def _describe(entry: dict) -> str:
    return f"{entry['op']} #{entry['seq']} on group '{entry['group']}' (ranks {entry['ranks']}; " \
           f"{entry['elements']} {entry['dtype'].replace('torch.', '')} elements)"


def mismatches(records: dict[int, dict]) -> list[str]:
    """One sentence per group whose members' records disagree about a collective (the first such one)."""
    out = []
    for (name, ranks), by_rank in sorted(_by_group(records).items()):
        common = sorted(set.intersection(*(set(d) for d in by_rank.values())))
        for seq in common:
            kinds = {r: (d[seq]["op"], d[seq]["elements"], d[seq]["dtype"]) for r, d in sorted(by_rank.items())}
            if len(set(kinds.values())) > 1:
                calls = ", ".join(f"rank {r} {op} of {n} {dtype.replace('torch.', '')}"
                                  for r, (op, n, dtype) in kinds.items())
                out.append(f"The ranks disagree about collective #{seq} on group '{name}' (ranks {list(ranks)}): "
                           f"{calls}: a mismatched collective (the ranks ran different code there).")
                break
    return out


def stuck(records: dict[int, dict]) -> list[str]:
    """One sentence per collective that some ranks started and did not complete, naming the members behind."""
    out = []
    for (name, ranks), by_rank in sorted(_by_group(records).items()):
        # Collectives on a group complete in order: a rank waits in its first one not completed (later ones it may
        # have started asynchronously).
        waiting = {r: min(s for s, e in d.items() if e["state"] != "completed")
                   for r, d in by_rank.items() if any(e["state"] != "completed" for e in d.values())}
        if not waiting:
            continue
        seq = max(waiting.values())
        waiters = sorted(r for r, s in waiting.items() if s == seq)
        entry = by_rank[waiters[0]][seq]
        ended = {r: by_rank[r][seq]["state"] for r in waiters}
        how = " and ".join(f"rank {r} ({state})" for r, state in ended.items())
        behind = []
        for r in ranks:
            last = max(by_rank.get(r, {0: None}))  # 0: the rank's record holds nothing of this group
            if r not in records:
                behind.append(f"rank {r} left no record")
            elif last < seq:
                behind.append(f"rank {r} never started it (its record of that group ends at #{last})")
        out.append(f"{how[0].upper()}{how[1:]} waited in {_describe(entry)}; " +
                   ("; ".join(behind) if behind else "every member started it") + ".")
    return out + _p2p_waits(records)


def _p2p_waits(records: dict[int, dict]) -> list[str]:
    """One sentence per rank and group with point-to-point transfers not completed: the one it failed in (else the
    first it started), and how many more it had started (a pipeline's sends and receives not yet waited for)."""
    out = []
    for (name, ranks), by_rank in sorted(_by_group(records, p2p=True).items()):
        for r, d in sorted(by_rank.items()):
            pending = [e for _, e in sorted(d.items()) if e["state"] != "completed"]
            if not pending:
                continue
            lead = next((e for e in pending if e["state"] == "failed"), pending[0])
            more = len(pending) - 1
            others = f", with {more} more started and not completed" if more else ""
            out.append(f"Rank {r} ({lead['state']}) waited in a point-to-point {lead['op']} on group '{name}' "
                       f"(ranks {list(ranks)}; {lead['elements']} elements){others}.")
    return out


def diagnose(records: dict[int, dict]) -> str:
    """One paragraph: the ranks without a record, the collectives ranks waited in and who was behind, the
    mismatched collectives, and why each rank wrote its record."""
    stale = earlier_records(records)
    records = {r: rec for r, rec in records.items() if r not in stale}
    world = max(r["world_size"] for r in records.values())
    missing = [r for r in range(world) if r not in records]
    sentences = []
    if missing:
        it = "it" if len(missing) == 1 else "they"
        sentences.append(f"{_ranks(missing)} left no flight record: {it} died, or {it} were killed or stopped before "
                         f"writing one (a stopped or hung rank is the usual cause of the others' timeouts)."
                         .replace("it were", "it was"))
    findings = stuck(records) + mismatches(records)
    sentences += findings or ["Every recorded collective completed on every rank that wrote a record."]
    if stale:
        sentences.append(f"Left out: the record{'s' if len(stale) > 1 else ''} of {_ranks(stale).lower()}, written "
                         f"before the newest run's ranks started (an earlier run's, in the same folder).")
    reasons = "; ".join(_reason(r, rec["reason"]) for r, rec in sorted(records.items()))
    sentences.append(f"The records were written because of: {reasons}.")
    return " ".join(sentences)


def earlier_records(records: dict[int, dict]) -> list[int]:
    """The ranks whose record an earlier run left in the folder: written before the newest record's run started
    (each recorder notes when it was made, before the rendezvous, so every record of a run is written after every
    one of its ranks started). Records without that time are taken as current."""
    began = max(rec.get("started", 0.0) for rec in records.values())
    return sorted(r for r, rec in records.items() if rec.get("time", began) < began)


def _reason(rank: int, reason: str) -> str:
    """Why `rank` wrote its record, named once (a collective's error already starts with its rank)."""
    return reason if reason.startswith((f"rank {rank}:", f"rank {rank} ")) else f"rank {rank}: {reason}"


def _ranks(ranks: list[int]) -> str:
    return f"Rank {ranks[0]}" if len(ranks) == 1 else "Ranks " + ", ".join(map(str, ranks))
