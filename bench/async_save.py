#!/usr/bin/env python
"""What --async-save costs the steps it overlaps: the step time while a save is being written in the background vs
the step time with no save in flight, in the same run; and the stall a blocking save of the same model causes.

    .venv/bin/python bench/async_save.py                        # 69M parameters, 792 MiB a save; ~90 s
    .venv/bin/python bench/async_save.py --hidden 256 --layers 2 --steps 12 --save-every 6   # a quick check
    .venv/bin/python bench/async_save.py --threads 1            # leave a core to the writer thread

One process (world 1; gloo on CPU, NCCL with --device cuda), one model, one session per mode, the training loop's
own pieces in its order: `train_step`, then `Session.poll_saves` (one all-reduce while a save is pending), then
`Session.save` every --save-every steps. Each iteration is timed whole on the training thread (the step, the poll
and, at a save, the copy to host memory and the ZeRO gathers). Steps are sorted into

    no save      no save was in flight during the step (nor started after it)
    while saving a save was being written in the background when the step began (the step whose poll commits the
                 save counts: it overlapped the writer at least in part)
    save step    the iteration that staged a save (the step, then the copy to host memory: the only time the
                 training thread spends on an asynchronous save besides the polls)

Each step's CPU time and the time it waited for a core (Linux schedstat) are printed too: on a shared machine
the wall time moves with the other processes' load, these much less. ``--no-nice`` runs the writer thread at the
training thread's priority instead of nice 19 (async_save._lowest_cpu_priority), to show what that choice buys.

The last line prints ``async/none=X.XX`` (mean iteration time while saving / mean with no save), the save's
duration in steps, and ``blocking_stall=Y.Y steps`` (a blocking save's time, in no-save steps). The first save of
each mode and --warmup steps are untimed. On a shared machine rerun and compare `load` (the 1-minute load average).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch


def runqueue_s() -> float:
    """Seconds the calling thread has spent runnable but waiting for a core (Linux schedstat), else 0."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return 0.0


def options(a, folder: str, model_file: str, async_save: bool):
    from tensorpar.training import TrainOptions

    return TrainOptions(model=model_file, steps=a.warmup + a.steps, seed=1, global_batch_size=a.batch,
                        micro_batch_size=a.batch, seq_len=a.seq_len, lr=1e-4, warmup_steps=1, val_every=0,
                        val_fraction=0.0, progress=False, metrics=None, out_dir=None, device=a.device,
                        save=folder, save_every=a.save_every, keep_last=2, async_save=async_save)


def run_mode(a, mesh, model_file: str, async_save: bool) -> dict:
    """Every iteration's (step index, seconds, kind) and each save's seconds, for one mode."""
    from tensorpar.training.loop import train_step
    from tensorpar.training.session import build_session
    from tensorpar.training.validate import validate

    folder = tempfile.mkdtemp(prefix="tensorpar-bench-save-", dir=a.dir)
    try:
        s = build_session(validate(options(a, folder, model_file, async_save), 1), mesh)
        rows, saves = [], []
        for step in range(a.warmup + a.steps):
            pending = s.async_saves is not None and s.async_saves.pending
            t0, c0, q0 = time.perf_counter(), time.thread_time(), runqueue_s()
            train_step(s, step)
            t1, c1, q1 = time.perf_counter(), time.thread_time(), runqueue_s()
            s.poll_saves(step + 1)
            t2 = time.perf_counter()
            saving = (step + 1) % a.save_every == 0
            if saving:
                s.save(step + 1)
            t3 = time.perf_counter()
            if saving:
                saves.append({"step": step + 1, "stage_s": t3 - t2})
            kind = "save step" if saving else ("while saving" if pending else "no save")
            rows.append({"step": step + 1, "train_s": t1 - t0, "train_cpu_s": c1 - c0, "train_wait_s": q1 - q0, "s": t3 - t0, "kind": kind,
                         "load": os.getloadavg()[0]})
        s.finish_saves(a.warmup + a.steps)
        history = s.async_saves.history if s.async_saves is not None else []
        staged = s.async_saves.staged_bytes if s.async_saves is not None else 0
        size = sum(f.stat().st_size for f in os.scandir(os.path.join(folder, sorted(
            d for d in os.listdir(folder) if d.startswith("step-"))[-1])))
        return {"rows": rows, "saves": saves, "history": history, "staged_bytes": staged, "checkpoint_bytes": size}
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def timed(result: dict, a) -> list[dict]:
    """The iterations after the warm-up and after the first save's commit (its host buffers are allocated then)."""
    commits = [h["committed_after_step"] for h in result["history"]]
    first = commits[0] if commits else (result["saves"][0]["step"] if result["saves"] else 0)
    return [r for r in result["rows"] if r["step"] > max(a.warmup, first)]


def describe(name: str, rows: list[dict], key: str = "s") -> tuple[tuple[float, float], str]:
    """((mean, median), a line) of the rows' `key` seconds."""
    if not rows:
        return (float("nan"), float("nan")), f"  {name:<13} no steps"
    xs = [r[key] for r in rows]
    mean, median = statistics.mean(xs), statistics.median(xs)
    load = statistics.mean(r["load"] for r in rows)
    return (mean, median), (f"  {name:<13} {len(xs):>3} steps  mean {mean:7.3f}s  median {median:7.3f}s  "
                  f"min {min(xs):7.3f}s  max {max(xs):7.3f}s  load {load:4.1f}")


def report(a, results: dict) -> None:
    print(f"model: {a.params / 1e6:.1f}M parameters, batch {a.batch} x seq {a.seq_len}, {a.device}, "
          f"{torch.get_num_threads()} torch threads on {os.cpu_count()} cores, writer thread at "
          f"{'normal priority' if a.no_nice else 'nice 19'}")
    out = {}
    for mode, result in results.items():
        rows = timed(result, a)
        by = {k: [r for r in rows if r["kind"] == k] for k in ("no save", "while saving", "save step")}
        print(f"{mode}: checkpoint {result['checkpoint_bytes'] / 2**20:.0f} MiB"
              + (f", {result['staged_bytes'] / 2**20:.0f} MiB staged in host memory" if result["staged_bytes"]
                 else ""))
        means = {}
        for kind, kind_rows in by.items():
            means[kind], line = describe(kind, kind_rows)
            print(line)
        for kind in ("no save", "while saving"):
            if by[kind]:
                print(describe(f"  {kind[:7]} cpu", by[kind], "train_cpu_s")[1] + "   the step's CPU time")
                print(describe(f"  {kind[:7]} wait", by[kind], "train_wait_s")[1] + "   waiting for a core")
        for h in result["history"][1:]:
            print(f"  save of step {h['step']}: written in {h['write_s']:.2f}s ({h['write_cpu_s']:.2f}s CPU), committed after step "
                  f"{h['committed_after_step']} ({h['committed_after_step'] - h['step']} steps), staging "
                  f"{h['stage_s']:.2f}s, waited {h['waited_s']:.2f}s")
        out[mode] = means
    line = ""
    if "blocking" in out:  # in steps: (the save step's time - a step's) / a step's, by means
        none = out["blocking"]["no save"][0]
        line = f"blocking_stall={(out['blocking']['save step'][0] - none) / none:.1f} steps"
    if "async" in out:
        history = results["async"]["history"][1:]
        in_steps = statistics.mean(h["committed_after_step"] - h["step"] for h in history) if history else 0
        (saving, saving_median), (none, none_median) = out["async"]["while saving"], out["async"]["no save"]
        staging = (out["async"]["save step"][0] - none) / none
        line = (f"async/none={saving / none:.2f} (medians {saving_median / none_median:.2f}) "
                f"save_steps={in_steps:.1f} staging={staging:.2f} steps " + line)
    print(line)


def gil_probe(a) -> None:
    """Whether the writer's work releases the GIL: a pure-Python counting thread's rate while safetensors writes a
    checkpoint-sized file and hashlib hashes it, against its rate alone (about 1.0: released; near 0: held)."""
    import hashlib
    import threading

    from safetensors.torch import save_file

    def count(seconds: float, out: list) -> None:
        n, end = 0, time.perf_counter() + seconds
        while time.perf_counter() < end:
            n += 1
        out.append(n / seconds)

    tensors = {f"t{i}": torch.randn(a.params // 8) for i in range(8)}
    with tempfile.TemporaryDirectory(dir=a.dir) as tmp:
        path = os.path.join(tmp, "probe.safetensors")

        def sha256() -> None:
            h = hashlib.sha256()
            with open(path, "rb") as f:
                for block in iter(lambda: f.read(1 << 20), b""):
                    h.update(block)

        for name, work in (("safetensors save_file", lambda: save_file(tensors, path)), ("hashlib sha256", sha256)):
            alone = []
            count(0.5, alone)
            beside = []
            t0 = time.perf_counter()
            counter = threading.Thread(target=count, args=(0.5, beside))
            counter.start()
            work()
            took = time.perf_counter() - t0
            counter.join()
            print(f"GIL probe: {name} ({took:.2f}s): a Python thread beside it ran at {beside[0] / alone[0]:.2f}x "
                  f"its rate alone")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=64, help="steps per mode (after --warmup)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--save-every", type=int, default=16)
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    p.add_argument("--modes", default="async,blocking")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dir", default=None, help="where the checkpoints go (default: the temporary folder)")
    p.add_argument("--no-nice", action="store_true", help="the writer thread at normal priority")
    p.add_argument("--gil-probe", action="store_true", help="only check that the writer's work releases the GIL")
    a = p.parse_args()
    if a.no_nice:
        from tensorpar.checkpoints import async_save

        async_save._lowest_cpu_priority = lambda: None
    if a.threads:
        torch.set_num_threads(a.threads)
    from tensorpar.distributed.mesh import init_mesh
    from tensorpar.models import get_config

    cfg = get_config("tiny").replace(hidden_size=a.hidden, num_layers=a.layers, num_heads=a.hidden // 64,
                                     num_kv_heads=a.hidden // 64, ffn_hidden_size=4 * a.hidden, vocab_size=a.vocab,
                                     max_seq_len=max(a.seq_len, 64))
    a.params = cfg.num_parameters()
    if a.gil_probe:
        return gil_probe(a)
    with tempfile.TemporaryDirectory() as tmp:
        model_file = os.path.join(tmp, "model.json")
        with open(model_file, "w") as f:
            json.dump(cfg.to_dict(), f)
        mesh = init_mesh(tp=1, device=a.device)
        try:
            results = {mode: run_mode(a, mesh, model_file, mode == "async") for mode in a.modes.split(",")}
        finally:
            mesh.destroy()
    report(a, results)


if __name__ == "__main__":
    sys.exit(main())
