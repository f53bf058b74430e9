#!/usr/bin/env python
"""How long `tensorpar train` takes to start its local ranks: ranks forked from the launcher's zygote (the default on
Linux) against ranks started as new processes (TENSORPAR_FORK_RANKS=0), run alternately in this process tree.

Each run is a 3-step `tensorpar train` of a 2-layer model on the embedded corpus. Printed per variant: the median
seconds from the command's start to its first metrics line (the ranks have imported, built the model and trained a
step), to its exit, and the CPU seconds of the whole job (launcher and ranks). The last line is

    start fork/new=X exit fork/new=Y cpu fork/new=Z

    .venv/bin/python bench/rank_start.py                   # 2 ranks, 3 runs of each
    .venv/bin/python bench/rank_start.py --nproc 4 --runs 5
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

from tensorpar.models import get_config

VARIANTS = {"fork": "1", "new": "0"}


def one_run(fork: str, nproc: int, folder: str) -> tuple[float, float, float]:
    """(seconds to the first metrics line, seconds to exit, CPU seconds of the job) of one run."""
    metrics = os.path.join(folder, "run", "metrics.jsonl")
    if os.path.exists(metrics):
        os.remove(metrics)
    model = os.path.join(folder, "model.json")
    command = [sys.executable, "-m", "tensorpar", "train", "--model", model, "--tp", str(nproc), "--steps", "3",
               "--seq-len", "32", "--global-batch-size", "4", "--no-progress", "--val-every", "0",
               "--out-dir", os.path.join(folder, "run"), "--metrics", metrics]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.monotonic()
    proc = subprocess.Popen(command, env=dict(os.environ, TENSORPAR_FORK_RANKS=fork), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    first = None
    while proc.poll() is None:
        if first is None and os.path.exists(metrics) and os.path.getsize(metrics):
            first = time.monotonic() - t0
        time.sleep(0.005)
    end = time.monotonic() - t0
    if proc.returncode != 0:
        raise SystemExit(f"tensorpar train failed ({proc.returncode}): {proc.stderr.read()}")
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return first if first is not None else end, end, cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nproc", type=int, default=2, help="ranks (TP size)")
    parser.add_argument("--runs", type=int, default=3, help="runs of each variant, alternated")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="rank-start-") as folder:
        cfg = get_config("tiny").replace(num_layers=2)
        with open(os.path.join(folder, "model.json"), "w") as f:
            json.dump(cfg.to_dict(), f)
        times = {name: [] for name in VARIANTS}
        for _ in range(args.runs):
            for name, fork in VARIANTS.items():
                times[name].append(one_run(fork, args.nproc, folder))
    medians = {name: [statistics.median(r[i] for r in runs) for i in range(3)] for name, runs in times.items()}
    for name, (first, end, cpu) in medians.items():
        print(f"{name:>4}: first step after {first:.2f}s, exit after {end:.2f}s, {cpu:.2f} CPU s "
              f"({args.nproc} ranks, median of {args.runs})")
    (f1, e1, c1), (f0, e0, c0) = medians["fork"], medians["new"]
    print(f"start fork/new={f1 / f0:.2f} exit fork/new={e1 / e0:.2f} cpu fork/new={c1 / c0:.2f}")


if __name__ == "__main__":
    main()
