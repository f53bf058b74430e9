"""What every multi-process command does: check the layout, then run here or start the ranks."""

from __future__ import annotations

import os

import torch

from tensorpar.distributed.launch import spawn_local, under_launcher, world_size
from tensorpar.distributed.mesh import resolve_layout


def launch(options, argv: list[str], run_rank) -> int:
    """Run `run_rank()` on every rank: here when under a launcher or alone, else in spawned local processes
    (each re-runs this command line, and so validates its options once itself).

    The layout is checked first, so a layout that cannot work fails before any process or
    process group exists (under torchrun: on every rank, before the rendezvous).
    """
    world = world_size(options)
    resolve_layout(world, options.tp, options.pp, options.dp, options.cp)
    if under_launcher():
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", torch.get_num_threads())))
        return run_rank()
    if world == 1:
        return run_rank()
    return spawn_local(world, argv, grace_s=options.grace_period)
