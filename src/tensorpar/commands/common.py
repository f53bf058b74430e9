"""What every multi-process command does: check the layout, then run here or start the ranks."""

from __future__ import annotations

import os

import torch

from tensorpar.distributed.launch import spawn_local, under_launcher
from tensorpar.distributed.mesh import resolve_layout


def add_layout_args(parser, tp_default: int = 1) -> None:
    parser.add_argument("--tp", type=int, default=tp_default, help="tensor-parallel size (default %(default)s)")
    parser.add_argument("--pp", type=int, default=1, help="pipeline-parallel size (default %(default)s)")
    parser.add_argument("--dp", type=int, default=None, help="data-parallel size (default: the rest of the world)")
    parser.add_argument(
        "--nproc", type=int, default=None,
        help="processes to start from a plain shell (default tp*pp*dp); ignored under torchrun",
    )


def world_size(args) -> int:
    """The number of processes this command will run on: the launcher's, or the ones it will start."""
    if under_launcher():
        return int(os.environ["WORLD_SIZE"])
    return args.nproc or args.tp * args.pp * (args.dp or 1)


def launch(args, argv: list[str], run_rank) -> int:
    """Run `run_rank(args)` on every rank: here when under a launcher or alone, else in spawned local processes.

    The layout is checked first, so a layout that cannot work fails before any process or
    process group exists (under torchrun: on every rank, before the rendezvous).
    """
    if under_launcher():
        world = int(os.environ["WORLD_SIZE"])
        resolve_layout(world, args.tp, args.pp, args.dp)
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", torch.get_num_threads())))
        return run_rank(args)
    world = world_size(args)
    resolve_layout(world, args.tp, args.pp, args.dp)
    if world == 1:
        return run_rank(args)
    return spawn_local(world, argv)
