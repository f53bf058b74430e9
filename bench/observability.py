"""What seeing inside a run costs: the step time of `tensorpar train` at TP 2 with everything off, as it runs by
default, and with --tensorboard, measured in the same two processes in one run.

    .venv/bin/python bench/observability.py                 # the demo's run: tiny, seq-len 128, global batch 16
    .venv/bin/python bench/observability.py --rounds 3 --steps 5

Variants (each a whole `train()` of --steps steps on one mesh, created once):

    off          the flight recorder replaced by one that records nothing, no metrics file
    default      what `tensorpar train` does with no observability flag: the flight recorder, metrics.jsonl
                 (and the NaN / Inf check of the gradient norm, which every variant runs)
    tensorboard  default + --tensorboard DIR (every metric of each step as a scalar, flushed each step)

A variant's time is that of the step loop (training.loop._run_steps: the steps, the metrics record and its sinks;
not the model's construction) per step, on rank 0 (which writes the sinks): its wall time, and the CPU time of the
process (every thread: TensorBoard's writer thread too). On a shared machine the wall time moves with the other
processes' load and the CPU time much less, so both are printed. Each round runs the three in a rotated order, so
that a change of machine load hits them alike, and the ratios are taken within each round; a first round warms up,
untimed. The last line prints the medians of the per-round ratios.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

VARIANTS = ("off", "default", "tensorboard")


class _NoRecorder:
    """A flight recorder that records nothing: the `off` variant."""

    folder, rank, world_size = None, 0, 1

    def start(self, *args, **kwargs) -> dict:
        return {}

    @staticmethod
    def end(entry, ok: bool = True) -> None:
        pass

    def dump(self, reason: str) -> None:
        return None


def _options(args, variant: str, workdir: str):
    from tensorpar.training import TrainOptions

    out_dir = None if variant == "off" else os.path.join(workdir, variant)
    return TrainOptions(model=args.model, tp=2, steps=args.steps, seq_len=args.seq_len,
                        global_batch_size=args.global_batch_size, seed=0, val_every=0, val_fraction=0.0,
                        progress=False, sample_tokens=0, device="cpu", out_dir=out_dir,
                        metrics=None if out_dir is None else os.path.join(out_dir, "metrics.jsonl"),
                        tensorboard=os.path.join(workdir, "tb") if variant == "tensorboard" else None)


def _worker(rank: int, args, port: int, workdir: str, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=300))
    import tensorpar.training.loop as loop
    from tensorpar import init_mesh
    from tensorpar.training import run_training, validate

    run_steps, measured = loop._run_steps, []

    def timed_run_steps(*a, **kw):  # the step loop alone: (wall s, CPU s of this process)
        wall, cpu = time.perf_counter(), time.process_time()
        run_steps(*a, **kw)
        measured.append((time.perf_counter() - wall, time.process_time() - cpu))

    loop._run_steps = timed_run_steps
    mesh = init_mesh(tp=2, device="cpu")
    recorder = mesh.stats.flight
    times = {(v, kind): [] for v in VARIANTS for kind in ("wall", "cpu")}
    for round_ in range(args.rounds + 1):
        for i in range(len(VARIANTS)):
            variant = VARIANTS[(i + round_) % len(VARIANTS)]
            mesh.stats.flight = _NoRecorder() if variant == "off" else recorder
            dist.barrier()
            record = run_training(validate(_options(args, variant, workdir)), mesh=mesh)["history"][-1]
            if round_ > 0:  # round 0 warms up
                for kind, seconds in zip(("wall", "cpu"), measured[-1]):
                    times[variant, kind].append(seconds / args.steps)
    if rank == 0:
        results.put((times, record))
    dist.barrier()
    dist.destroy_process_group()


def _write_cost(record: dict, writes: int = 200) -> dict[str, float]:
    """Microseconds per `write` of a real step's record to each sink, TensorBoard's flush included."""
    from tensorpar.training.metric_sinks import TensorBoardSink
    from tensorpar.training.metrics import MetricsWriter

    out = {}
    with tempfile.TemporaryDirectory() as folder:
        for name, sink in (("metrics.jsonl", MetricsWriter(os.path.join(folder, "m.jsonl"))),
                           ("tensorboard", TensorBoardSink(os.path.join(folder, "tb")))):
            rounds = []
            for r in range(5):
                t0 = time.perf_counter()
                for step in range(writes):
                    sink.write({**record, "step": r * writes + step + 1})
                rounds.append((time.perf_counter() - t0) / writes * 1e6)
            sink.close()
            out[name] = statistics.median(rounds)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--global-batch-size", type=int, default=16)
    p.add_argument("--steps", type=int, default=20, help="steps per training run")
    p.add_argument("--rounds", type=int, default=5, help="timed rounds (each runs every variant once)")
    args = p.parse_args(argv)
    from tensorpar.distributed.launch import free_port

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    with tempfile.TemporaryDirectory() as workdir:
        procs = [ctx.Process(target=_worker, args=(r, args, port, workdir, results)) for r in range(2)]
        for proc in procs:
            proc.start()
        times, record = results.get(timeout=3600)
        for proc in procs:
            proc.join()
    print(f"{args.model} at TP 2, seq-len {args.seq_len}, global batch {args.global_batch_size}: {args.rounds} "
          f"rounds of {args.steps} steps per variant; rank 0's seconds per step (median over rounds)")
    for kind in ("wall", "cpu"):
        for variant in VARIANTS:
            print(f"  {kind:<4} {variant:<12} {statistics.median(times[variant, kind]):.4f}   rounds: "
                  + " ".join(f"{t:.4f}" for t in times[variant, kind]))

    def ratio(a: str, b: str, kind: str) -> str:
        return f"{statistics.median(x / y for x, y in zip(times[a, kind], times[b, kind])):.4f}"

    print(f"one step's record written alone ({len(record)} fields), microseconds per write, median of 5 x 200: "
          + ", ".join(f"{name} {us:.0f}" for name, us in _write_cost(record).items()))
    print(" ".join(f"{kind}: default/off={ratio('default', 'off', kind)} tensorboard/default="
                   f"{ratio('tensorboard', 'default', kind)} tensorboard/off={ratio('tensorboard', 'off', kind)}"
                   for kind in ("wall", "cpu")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
