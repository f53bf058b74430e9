#!/usr/bin/env python
"""What Muon costs over AdamW: the training step of the same model, data and layout with `--optimizer muon` and with
`--optimizer adamw`, each a `tensorpar train` run started by this script (gloo on CPU), one after the other.

Muon adds, per step, the Newton-Schulz iterations of every hidden matrix (each orthogonalised once, by the one
rank that owns it) and, under TP or ZeRO, the all-gathers and reduce-scatters that bring each matrix to its owner
and its update back (tensorpar.data_parallel.muon_matrices). The step time is each run's median `step_time_s`
(metrics.jsonl) over its steps after `--warmup`; the runs alternate (AdamW, Muon, AdamW, Muon, ... `--repeats`
times) and each optimizer's fastest median counts, as the cores are shared. Each rank runs one thread.

    .venv/bin/python bench/muon_step.py                          # about 5 minutes on 2 busy cores
    .venv/bin/python bench/muon_step.py --layouts tp1 --steps 6  # a quick check

The last line is ``muon/adamw tp1=X.XX tp2-dp2-zero1=Y.YY`` (step-time ratios, one per layout).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

LAYOUTS = {"tp1": [], "tp2-dp2-zero1": ["--tp", "2", "--dp", "2", "--zero", "1"],
           "dp2-zero3": ["--dp", "2", "--zero", "3"]}


def step_time(a, layout: str, optimizer: str, folder: str) -> float:
    """The median step time of one `tensorpar train` run (seconds)."""
    metrics = os.path.join(folder, f"{layout}-{optimizer}.jsonl")
    cmd = [sys.executable, "-m", "tensorpar", "train", "--model", a.model, "--steps", str(a.warmup + a.steps),
           "--seq-len", str(a.seq_len), "--global-batch-size", str(a.global_batch_size), "--optimizer", optimizer,
           "--val-every", "0", "--val-fraction", "0", "--no-progress", "--metrics", metrics,
           "--out-dir", os.path.join(folder, f"{layout}-{optimizer}"), *LAYOUTS[layout]]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, env={**os.environ, "OMP_NUM_THREADS": "1"})
    with open(metrics) as f:
        records = [json.loads(line) for line in f]
    return statistics.median(r["step_time_s"] for r in records[a.warmup:])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layouts", default="tp1,tp2-dp2-zero1", help=f"comma-separated, of {', '.join(LAYOUTS)}")
    p.add_argument("--model", default="tiny", help="preset or config .json (default: tiny, 128 wide, 4 layers)")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--global-batch-size", type=int, default=8)
    p.add_argument("--repeats", type=int, default=2)
    a = p.parse_args()
    ratios = {}
    with tempfile.TemporaryDirectory() as folder:
        for layout in a.layouts.split(","):
            runs = [(opt, step_time(a, layout, opt, folder)) for _ in range(a.repeats) for opt in ("adamw", "muon")]
            times = {opt: min(t for o, t in runs if o == opt) for opt in ("adamw", "muon")}
            ratios[layout] = times["muon"] / times["adamw"]
            print(f"{layout}: step {times['adamw'] * 1e3:.1f} ms with AdamW, {times['muon'] * 1e3:.1f} ms with Muon")
    print("muon/adamw " + " ".join(f"{k}={v:.2f}" for k, v in ratios.items()))


if __name__ == "__main__":
    main()
