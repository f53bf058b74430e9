"""How much of a gloo all-reduce can hide behind a GEMM on this machine: the bound on TP overlap.

    .venv/bin/torchrun --nproc-per-node 2 bench/overlap_bound.py [--mbytes 4.2] [--collectives 8] [--gemms 20]

Each of the 2 ranks (1 thread each, as a TP 2 run on 2 cores) times, median of 5 rounds:

    gemms       a loop of GEMMs of the default bench model's shape ([2048, 512] x [512, 1536]), alone
    collectives the same number of all-reduces as a TP 2 step has per block, alone (blocking), with the CPU
                time this process spends on them (the gloo worker thread's copies and reductions)
    beside      the all-reduces started asynchronously, then the GEMM loop, then waited for: overlap at its best

hidden = (gemms + collectives - beside) / collectives is the share of the collectives' time that overlap
hid. Where every core computes, a collective's CPU time cannot hide: `hidden` stays near 1 - cpu/wall.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist


def timed(fn, rounds: int = 5) -> tuple[float, float]:
    """Median wall and CPU seconds (this process, all threads) of `fn` over `rounds`, ranks in step."""
    walls, cpus = [], []
    fn()  # warm-up
    for _ in range(rounds):
        dist.barrier()
        c0, t0 = time.process_time(), time.perf_counter()
        fn()
        walls.append(time.perf_counter() - t0)
        cpus.append(time.process_time() - c0)
    return statistics.median(walls), statistics.median(cpus)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mbytes", type=float, default=4.2, help="size of each all-reduce (fp32)")
    ap.add_argument("--collectives", type=int, default=8)
    ap.add_argument("--gemms", type=int, default=20)
    args = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    a, w = torch.randn(2048, 512), torch.randn(1536, 512)
    bufs = [torch.ones(int(args.mbytes * 1e6 / 4)) for _ in range(args.collectives)]

    def gemms():
        for _ in range(args.gemms):
            torch.mm(a, w.t())

    def collectives():
        for b in bufs:
            dist.all_reduce(b)

    def beside():
        pending = [dist.all_reduce(b, async_op=True) for b in bufs]
        gemms()
        for p in pending:
            p.wait()

    g, _ = timed(gemms)
    c, c_cpu = timed(collectives)
    b, _ = timed(beside)
    if dist.get_rank() == 0:
        print(f"rank 0, 1 thread: gemms {g:.3f} s; {args.collectives} all-reduces of {args.mbytes} MB {c:.3f} s wall, "
              f"{c_cpu:.3f} s CPU ({c_cpu / c:.0%}); both, the all-reduces beside the gemms {b:.3f} s")
        print(f"hidden={(g + c - b) / c:.2f} of the all-reduces' time (bound where every core computes: about "
              f"1 - cpu/wall = {1 - c_cpu / c:.2f})")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
