"""The round trip the test suite waits on: a small gloo all-reduce (and all-to-all) between N local processes.

    .venv/bin/python bench/gloo_latency.py [--ranks 2 3 4] [--kib 4]

Each rank runs 1 thread; rank 0 prints the mean microseconds of 300 calls after 20 warm-ups, for each world size.
The parity tests are mostly such calls (a TP 2 training step of the tests' 8-layer model makes 53 all-reduces of a
few KiB), so on a machine with fewer cores than ranks their run time follows these figures, not the FLOPs.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tensorpar.distributed.launch import free_port


def _rank(rank: int, world: int, port: int, numel: int, calls: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    x, out = torch.ones(numel), torch.empty(world * numel)
    ops = {"all_reduce": lambda: dist.all_reduce(x),
           "all_to_all": lambda: dist.all_to_all_single(out, x.repeat(world))}
    for name, op in ops.items():
        for _ in range(20):
            op()
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(calls):
            op()
        if rank == 0:
            print(f"{world} ranks  {name:<10} {(time.perf_counter() - t0) / calls * 1e6:8.0f} us", flush=True)
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 3, 4], help="world sizes to time")
    ap.add_argument("--kib", type=float, default=4.0, help="size of the fp32 tensor reduced")
    ap.add_argument("--calls", type=int, default=300)
    args = ap.parse_args()
    print(f"{os.cpu_count()} cores; a {args.kib:g} KiB fp32 tensor; mean of {args.calls} calls")
    for world in args.ranks:
        mp.spawn(_rank, args=(world, free_port(), int(args.kib * 256), args.calls), nprocs=world)


if __name__ == "__main__":
    main()
