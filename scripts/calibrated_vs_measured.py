"""The calibrated planner against `tensorpar train` on this machine: six layouts, predicted vs measured step time.

    .venv/bin/python scripts/calibrated_vs_measured.py [--steps 5] [--repeats 1] [--out runs/calibration]

1. `tensorpar calibrate --device cpu` twice: with all cores (a one-process run) and with cores / 2 threads and
   the collectives over 2 gloo processes (what each rank of a two-process run gets);
2. `tensorpar train` of a small Llama-style model (fp32) in six layouts: single, full recomputation, TP 2,
   TP 2 + SP, PP 2, DP 2 with ZeRO-1; measured = the median step time after the first step;
3. the planner's step time for the same layout with `plan --hardware` of the matching profile.

With ``--repeats R`` each layout is trained R times, round-robin (every layout once, then again): measured = the
median of the R runs' medians, and the spread (lowest - highest run median) is printed beside it, with the load
average (`/proc/loadavg`, 1 minute) before each of the layout's runs. Profiles already in ``--out`` are reused:
pass a fresh folder to calibrate again. Every run's figures go to ``--out``/results.json. Measuring on a shared,
loaded machine is noisy: read the figures as provisional.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile

from tensorpar.distributed.launch import threads_per_process
from tensorpar.models import get_config
from tensorpar.planning.calibration import load_profile
from tensorpar.planning.cluster import make_cluster
from tensorpar.planning.layout import Layout
from tensorpar.planning.search import evaluate

MODEL = get_config("tiny").replace(hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=4, ffn_hidden_size=768)
SEQ, BATCH = 128, 8
LAYOUTS = [
    dict(),
    dict(recompute="full"),
    dict(tp=2),
    dict(tp=2, sequence_parallel=True),
    dict(pp=2, micro_batch_size=2),
    dict(dp=2, zero=1),
]


def _cli(*args, cwd):
    proc = subprocess.run([sys.executable, "-m", "tensorpar", *map(str, args)], cwd=cwd, capture_output=True,
                          text=True, timeout=1800)
    if proc.returncode:
        raise SystemExit(f"tensorpar {' '.join(map(str, args))} failed:\n{proc.stderr[-2000:]}")
    return proc.stdout


def _load() -> str:
    try:
        return pathlib.Path("/proc/loadavg").read_text().split()[0]
    except OSError:
        return "?"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--out", default="runs/calibration")
    a = ap.parse_args()
    out = pathlib.Path(a.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    work = tempfile.mkdtemp()
    model = out / "model.json"
    model.write_text(json.dumps(MODEL.to_dict()))
    profiles = {}
    for world in (1, 2):
        path = out / f"profile-{world}.json"
        if not path.exists():
            _cli("calibrate", "--device", "cpu", "--out", path, "--threads", threads_per_process(world),
                 "--ranks", 2, *(["--no-collectives"] if world == 1 else []), cwd=work)
        profiles[world] = load_profile(str(path))
        spec = profiles[world][0]
        print(f"profile of {world} process(es): {spec.name}: fp32 peak {spec.peak('fp32') / 1e9:.1f} GFLOP/s, memory "
              f"{spec.hbm_bandwidth / 1e9:.1f} GB/s" + (f", link {spec.intra_node.bandwidth / 1e9:.2f} GB/s "
                                                       f"{spec.intra_node.latency * 1e3:.2f} ms" if world > 1 else "")
              + f" (load {_load()})")
    print("| layout | processes | measured step s | spread of runs | predicted step s | error | load |")
    print("|---|---|---|---|---|---|---|")
    runs = {i: [] for i in range(len(LAYOUTS))}
    loads = {i: [] for i in range(len(LAYOUTS))}
    # Round-robin over the layouts (every layout once, then again): the machine's speed drifts over minutes, and
    # measuring one layout's repeats back to back would put the drift into that layout's figure.
    for _ in range(a.repeats):
        for i, lay in enumerate(LAYOUTS):
            loads[i].append(_load())
            runs[i].append(_measure(model, lay, a.steps, work))
    rows = []
    for i, lay in enumerate(LAYOUTS):
        tp, pp, dp, mbs = _shape(lay)
        world = tp * pp * dp
        measured = statistics.median(runs[i])
        spec, curve = profiles[world]
        cluster = make_cluster(spec, world, gpus_per_node=world, curve=curve, link_efficiency=1.0)
        layout = Layout(tp=tp, pp=pp, dp=dp, sequence_parallel=bool(lay.get("sequence_parallel")),
                        micro_batch_size=mbs, recompute=lay.get("recompute", "none"), zero=lay.get("zero", 0))
        plan = evaluate(MODEL, layout, cluster, SEQ, BATCH, "tensorpar-fp32")
        pred = plan.time.step_time_s if plan.time else float("nan")
        print(f"| {layout.label()} | {world} | {measured:.3f} | {min(runs[i]):.3f}-{max(runs[i]):.3f} | {pred:.3f} | "
              f"{100 * (pred / measured - 1):+.0f}% | {'/'.join(loads[i])} |")
        sys.stdout.flush()
        rows.append({"layout": layout.label(), "processes": world, "runs_s": runs[i], "measured_s": measured,
                     "predicted_s": pred, "error": pred / measured - 1, "load": loads[i]})
    within = sum(abs(r["error"]) <= 0.15 for r in rows)
    print(f"{within} of {len(rows)} within 15% (unrounded); every figure in {out / 'results.json'}")
    (out / "results.json").write_text(json.dumps(rows, indent=1))


def _shape(lay) -> tuple[int, int, int, int]:
    """(tp, pp, dp, micro-batch size) of one of `LAYOUTS`."""
    tp, pp, dp = lay.get("tp", 1), lay.get("pp", 1), lay.get("dp", 1)
    return tp, pp, dp, lay.get("micro_batch_size", BATCH // dp)


def _measure(model, lay, steps, work) -> float:
    """One `tensorpar train` of the layout: the median step time after the first step."""
    tp, pp, dp, mbs = _shape(lay)
    metrics = pathlib.Path(work) / "metrics.jsonl"
    args = ["train", "--model", model, "--tp", tp, "--pp", pp, "--dp", dp, "--steps", steps, "--seed", 0,
            "--global-batch-size", BATCH, "--micro-batch-size", mbs, "--seq-len", SEQ, "--metrics", metrics,
            "--recompute", lay.get("recompute", "none"), "--zero", lay.get("zero", 0)]
    if lay.get("sequence_parallel"):
        args.append("--sequence-parallel")
    if metrics.exists():
        metrics.unlink()
    _cli(*args, cwd=work)
    times = [json.loads(line)["step_time_s"] for line in metrics.read_text().splitlines()]
    return statistics.median(times[1:] or times)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
