"""Exposed TP communication: the seconds of a tensorpar TP step that compute does not cover, with the TP overlap
(tensorpar.tensor_parallel.tp_overlap) on and off, measured in the same processes on the same model and batch.

    exposed = median over rounds of (step time with the real collectives
                                     - step time of the same step with every collective replaced by a no-op)

The no-op collectives return at once and touch only this rank's memory: an all-reduce leaves its input as it
is, an all-gather fills every rank's slot with this rank's tensor, a reduce-scatter keeps this rank's own
block. The values are then wrong (they are not used) but every shape, every GEMM and every copy is the same,
so the difference is what the collectives add to the step: their own time where nothing runs beside them,
the time a rank waits for its slower peer, and what a collective running in the background takes from the
compute beside it (on a 2-core machine the gloo threads share the cores with the GEMMs). Each round runs the
four configurations (overlap on/off x real/no-op collectives) once, in alternating order, so that a change of
machine load hits them alike, and the difference is taken within each round (between steps run seconds
apart); a first round warms them up, untimed. Ranks pass a barrier before every step. Rank 0's times are
reported.

Also measured, `cpu_share`: one all-reduce of the step's activation size run alone (nothing computing beside it),
its wall time and the CPU time this process spent on it (the gloo worker thread's copies through the kernel's TCP
stack and the reduction). Overlap hides a collective by running compute while it travels; on a machine where
every core is already computing (2 ranks x 1 thread on 2 cores), the collective's CPU time cannot be hidden,
only the rest of its wall time (waiting on the peer and the network). So `cpu_s / wall_s` bounds from below what
overlap can achieve here: exposed(overlap) / exposed(no overlap) >= about cpu_s / wall_s where the exposed time
is the collectives' own. On a GPU with NCCL the collective runs on other SMs and the bound does not apply.

Also reported, for the real steps: `blocked`, the seconds per step the ranks spent inside a blocking
collective or waiting for an asynchronous one (tensorpar's CommStats timing), which leaves out that last
cost (compute slowed by a background collective).
"""

from __future__ import annotations

import contextlib
import os
import statistics
import time

import torch

from tensorpar.distributed import collective_calls


class _Done:
    """The handle of a no-op collective: already complete."""

    def wait(self, *args, **kwargs) -> bool:
        return True


def _no_all_reduce(tensor, op=None, group=None, async_op=False):
    return _Done() if async_op else None


def _no_all_gather(out, tensor, group=None, async_op=False):
    out.view(-1, tensor.numel()).copy_(tensor.reshape(1, -1))
    return _Done() if async_op else None


def _no_reduce_scatter(out, tensor, op=None, group=None, async_op=False):
    out.copy_(tensor.reshape(-1, out.numel())[0].view_as(out))
    return _Done() if async_op else None


@contextlib.contextmanager
def no_collectives():
    """Within: tensorpar's all-reduces, all-gathers and reduce-scatters are no-ops (barriers still synchronise)."""
    fakes = {"all_reduce": _no_all_reduce, "all_gather_single": _no_all_gather,
             "reduce_scatter_single": _no_reduce_scatter}
    saved = [(calls, name, getattr(calls, name)) for calls in (collective_calls.DIRECT, collective_calls.GLOO)
             for name in fakes]
    for calls, name, _ in saved:
        setattr(calls, name, fakes[name])
    try:
        yield
    finally:
        for calls, name, real in saved:
            setattr(calls, name, real)


def cpu_share(group, numel: int, repeats: int = 10) -> dict:
    """Blocking all-reduces of `numel` fp32 elements over `group`, alone: {"mbytes", "wall_s", "cpu_s"} per
    all-reduce, the medians of `repeats` (wall time, and this process's CPU time over all its threads)."""
    tensor = torch.ones(numel)
    walls, cpus = [], []
    for i in range(repeats + 2):
        group.barrier()
        c0, t0 = time.process_time(), time.perf_counter()
        group.all_reduce(tensor)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        if i >= 2:  # two warm-up rounds
            walls.append(wall)
            cpus.append(cpu)
    return {"mbytes": numel * 4 / 1e6, "wall_s": statistics.median(walls), "cpu_s": statistics.median(cpus)}


def measure(steps, barrier, stats, rounds: int) -> dict:
    """{"overlap": {...}, "no_overlap": {...}}, each with the median `step_s` (real collectives), `compute_s`
    (no-op collectives), `exposed_s` (the median of their differences within a round) and `blocked_s` (median
    seconds per step inside collectives); `steps[on]` runs one training step of the model built with the TP
    overlap `on` (the same weights both ways)."""
    configs = [(on, real) for on in (True, False) for real in (True, False)]
    times = {c: [] for c in configs}
    blocked = {on: [] for on in (True, False)}
    timing = stats.timing
    try:
        for r in range(rounds + 1):
            for on, real in configs if r % 2 else configs[::-1]:
                barrier()
                stats.reset()
                stats.timing = real
                t0 = time.perf_counter()
                with contextlib.nullcontext() if real else no_collectives():
                    steps[on]()
                seconds = time.perf_counter() - t0
                if os.environ.get("EXPOSED_DEBUG"):
                    print(f"round {r} overlap={on} real={real}: {seconds:.4f} s", flush=True)
                if r:
                    times[(on, real)].append(seconds)
                    if real:
                        blocked[on].append(stats.seconds())
    finally:
        stats.timing = timing
        stats.reset()
    out = {}
    for on in (True, False):
        step_s, compute_s = statistics.median(times[(on, True)]), statistics.median(times[(on, False)])
        exposed_s = statistics.median(a - b for a, b in zip(times[(on, True)], times[(on, False)]))
        out["overlap" if on else "no_overlap"] = {"step_s": step_s, "compute_s": compute_s, "exposed_s": exposed_s,
                                                  "blocked_s": statistics.median(blocked[on])}
    return out


def print_exposed(results: dict, labels: dict, variants: list, args) -> str | None:
    """Print the exposed-communication table of bench/tp_step.py's tensorpar TP=2 variants (`labels`: their names);
    return the `exposed_comm` line of TP=2."""
    line = None
    for variant in variants:
        by_rank = results[variant].get("exposed_by_rank") or []
        if not by_rank or not by_rank[0]:
            continue
        print()
        print(f"{labels[variant]}: exposed communication per step ({args.exposed_rounds} rounds; rank 0's "
              f"medians; exposed: step with the real collectives minus the same step with no-op ones, per round; "
              f"blocked: seconds inside collectives, mean of the ranks)")
        for mode, label in (("overlap", "TP overlap on"), ("no_overlap", "--no-tp-overlap")):
            r = by_rank[0][mode]
            blocked = statistics.mean(e[mode]["blocked_s"] for e in by_rank)
            print(f"  {label:<16} step {r['step_s']:.4f} s   no-op collectives {r['compute_s']:.4f} s   "
                  f"exposed {r['exposed_s']:.4f} s   blocked {blocked:.4f} s")
        share = by_rank[0].get("cpu_share")
        if share:
            print(f"  one all_reduce of {share['mbytes']:.1f} MB alone: {share['wall_s'] * 1e3:.1f} ms wall, "
                  f"{share['cpu_s'] * 1e3:.1f} ms CPU of rank 0's process ({share['cpu_s'] / share['wall_s']:.0%}): "
                  f"with every core computing, overlap can hide at most {1 - share['cpu_s'] / share['wall_s']:.0%} "
                  f"of a collective's time (bench/exposed_comm.py)")
        if variant == "tensorpar":
            e = by_rank[0]
            line = f"exposed_comm overlap={e['overlap']['exposed_s']:.3f} no_overlap={e['no_overlap']['exposed_s']:.3f}"
    if "tensorpar" in results and "tensorpar-sp" in results:
        sp = statistics.median(results["tensorpar-sp"]["step_s"]) / statistics.median(results["tensorpar"]["step_s"])
        print(f"\ntp2+sp/tp2={sp:.3f}")
    return line
