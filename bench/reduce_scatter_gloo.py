"""tensorpar's reduce-scatter on gloo against torch's, and against an all-reduce of the same tensor.

    .venv/bin/torchrun --nproc-per-node 2 bench/reduce_scatter_gloo.py [--mbytes 4.2]

ProcessGroupGloo's reduce_scatter_tensor all-reduces a clone of the whole tensor and copies one block out;
tensorpar's `Group.reduce_scatter` on gloo is an all-to-all of the blocks and a local sum
(`tensorpar.distributed.collective_calls.reduce_scatter_by_all_to_all`). Prints rank 0's median wall and CPU
milliseconds of each (1 thread per rank, ranks in step, 10 calls after 2 warm-ups) and checks that both give
the same block.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

from tensorpar.distributed.comm import Group


def timed(fn, calls: int = 10) -> tuple[float, float]:
    walls, cpus = [], []
    for i in range(calls + 2):
        dist.barrier()
        c0, t0 = time.process_time(), time.perf_counter()
        fn()
        if i >= 2:
            walls.append(time.perf_counter() - t0)
            cpus.append(time.process_time() - c0)
    return statistics.median(walls) * 1e3, statistics.median(cpus) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mbytes", type=float, default=4.2, help="size of the tensor reduced (fp32)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    size = dist.get_world_size()
    group = Group("tp", list(range(size)), dist.group.WORLD)
    n = int(args.mbytes * 1e6 / 4) // size * size
    x = torch.randn(n, generator=torch.Generator().manual_seed(dist.get_rank()))
    y, out_torch, out_tp = x.clone(), torch.empty(n // size), torch.empty(n // size)
    rows = {
        "all_reduce (torch)": timed(lambda: dist.all_reduce(y)),
        "reduce_scatter_tensor (torch)": timed(lambda: dist.reduce_scatter_tensor(out_torch, x)),
        "reduce_scatter (tensorpar)": timed(lambda: group.reduce_scatter_async(out_tp, x).wait()),
    }
    same = torch.allclose(out_torch, out_tp, rtol=1e-6, atol=1e-6)
    if dist.get_rank() == 0:
        print(f"{size} ranks x 1 thread, {n * 4 / 1e6:.1f} MB fp32; rank 0's medians (ms wall / ms CPU):")
        for name, (wall, cpu) in rows.items():
            print(f"  {name:<30} {wall:7.2f} / {cpu:6.2f}")
        speedup = rows["reduce_scatter_tensor (torch)"][0] / rows["reduce_scatter (tensorpar)"][0]
        print(f"same block: {same}; reduce_scatter tensorpar/torch = {1 / speedup:.2f}")
    dist.destroy_process_group()
    if not same:
        raise SystemExit("tensorpar's reduce-scatter differs from torch's")


if __name__ == "__main__":
    main()
