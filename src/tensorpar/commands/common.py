"""What every multi-process command does: check the layout, then run here or start the ranks."""

from __future__ import annotations

import dataclasses
import math
import os
import sys

import torch

from tensorpar.distributed import zygote
from tensorpar.distributed.launch import spawn_local, under_launcher, world_size
from tensorpar.distributed.mesh import check_backend
from tensorpar.distributed.nodes import NodeLayout, tp_across_nodes
from tensorpar.errors import LayoutError, TensorparError
from tensorpar.layout import ParallelLayout, resolve_dp


def launch(options, argv: list[str], run_rank) -> int:
    """Run `run_rank()` on every rank: here when under a launcher or alone, else in spawned local processes
    (each re-runs this command line, and so validates its options once itself).

    The layout is checked first, so a layout that cannot work fails before any process or
    process group exists (under torchrun: on every rank, before the rendezvous). Across several nodes, rank 0
    warns when a tensor-parallel group would span two (see `tensorpar.distributed.nodes`).
    """
    world = world_size(options)
    resolve_dp(world, options.tp, options.cp, options.pp, options.dp)
    check_backend(options.device, options.backend)
    for flag, value in (("--timeout", options.timeout), ("--grace-period", options.grace_period)):
        if value is not None and not 0 < value < float("inf"):
            raise TensorparError(f"{flag} must be a positive number of seconds, got {value}")
    if under_launcher() or world == 1:
        zygote.discard()  # no rank to start here
    if under_launcher():
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", torch.get_num_threads())))
        warning = tp_across_nodes(options.tp, NodeLayout.from_env())
        if warning and os.environ.get("RANK") == "0":
            sys.stderr.write(f"tensorpar: {warning}\n")
        return run_rank()
    if world == 1:
        return run_rank()
    return spawn_local(world, argv, grace_s=options.grace_period)


def inference_layout(options, cfg, seq_len: int | None = None):
    """(`options` of an inference command (eval, generate, serve) with --ep (and --expert-tp) folded onto the ranks,
    their checked `ParallelLayout`), before any process exists. Without --dp (and --nproc), a run whose tp x cp ranks
    cannot hold the ep x expert_tp ranks that hold every expert once gets fold / gcd(tp x cp, fold) data-parallel
    groups, so that the fold divides tp x cp x dp."""
    tp, cp = options.tp, options.cp
    for flag, value in (("--ep", options.ep), ("--expert-tp", options.expert_tp)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise LayoutError(f"{flag} must be a positive integer, got {value!r}")
    fold = options.ep * options.expert_tp
    if fold > 1 and options.dp is None and options.nproc is None and not under_launcher():
        options = dataclasses.replace(options, dp=fold // math.gcd(tp * cp, fold))
    layout = ParallelLayout.from_options(options, world_size(options))
    layout.check(cfg, seq_len=seq_len, fp8=getattr(options, "dtype", "fp32") == "fp8")
    return options, layout


def decoding_layout(options, cfg, command: str):
    """(options with --ep folded, their checked layout) of a command that decodes token by token (generate, serve):
    one tensor-parallel group holds the whole model, with no sequence, pipeline or context parallelism (a new token
    has no sequence to split); a mixture-of-experts model with --ep runs replicas of that group."""
    if options.sequence_parallel:
        raise LayoutError(f"{command} runs without sequence parallelism (decoding one token a step has nothing to "
                          f"split along the sequence): drop --sequence-parallel")
    for flag, value in (("--pp", options.pp), ("--cp", options.cp)):
        if value != 1:
            raise LayoutError(f"{command} runs the model on one tensor-parallel group, without pipeline or context "
                              f"parallelism: {flag} must be 1, got {value}; drop {flag}")
    options, layout = inference_layout(options, cfg)
    if options.ep * options.expert_tp == 1 and layout.world != options.tp:
        raise LayoutError(f"{command} runs on exactly --tp processes (one tensor-parallel group, no data "
                          f"parallelism; a mixture-of-experts model with --ep or --expert-tp runs replicas of it): "
                          f"{layout.world} processes for --tp {options.tp}")
    return options, layout
