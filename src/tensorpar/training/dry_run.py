"""`tensorpar train --dry-run --world-size N [--rank R]`: one rank of a world of N, built for real without it.

The run is validated at N ranks (every layout constraint), then PyTorch's fake process group stands in for the
world (collectives return at once, no peer exists) and this rank builds its part of the real model, optimizer and
ZeRO state on the meta device (shapes without storage: nothing is allocated, a 405B model's rank takes seconds).
One micro-batch then runs forward and backward through the rank's stage, and one optimizer step: the collectives
it would issue are counted by the mesh's `CommStats` as in a real run (under pipeline parallelism, without the
stage's point-to-point sends: its input is a meta tensor of the activation's shape). Reported: the rank's
parameter, gradient and optimizer bytes as its optimizer counts them (with LoRA: the adapters', the frozen base's
apart), its layout, and those collectives.

Data-dependent shapes (the rows of a vocabulary shard a batch looks up) are taken as "all of them" on meta. A
mixture-of-experts model's micro-batch is not run (its routing decides the sizes of its all-to-alls): its rank
reports the optimizer step's collectives only.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch
import torch.distributed as dist

from tensorpar.distributed.mesh import build_mesh
from tensorpar.errors import TensorparError
from tensorpar.training.session import build_model, build_optimizer
from tensorpar.training.validate import PreparedRun


@contextlib.contextmanager
def fake_world(rank: int, world_size: int):
    """A fake process group of `world_size` ranks in which this process is `rank`."""
    try:
        from torch.testing._internal.distributed.fake_pg import FakeStore
    except ImportError as e:  # pragma: no cover - torch builds without the testing package
        raise TensorparError(f"--dry-run needs PyTorch's fake process group (torch {torch.__version__} has none: "
                             f"{e})") from None
    if dist.is_initialized():
        raise TensorparError("--dry-run runs in a process of its own, not inside a distributed job")
    import torch.fx.experimental._config as fx_config

    assume, fx_config.meta_nonzero_assume_all_nonzero = fx_config.meta_nonzero_assume_all_nonzero, True
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()
        fx_config.meta_nonzero_assume_all_nonzero = assume


def dry_run(run: PreparedRun, rank: int) -> dict:
    """Build rank `rank` of `run` (validated for its world) on the meta device and run a micro-batch (two when the
    run has several: `_one_step`) and one optimizer step; the rank's bytes, and the collectives of the last
    micro-batch and the step."""
    o = run.options
    if not 0 <= rank < run.world_size:
        raise TensorparError(f"--rank {rank} is not a rank of a world of {run.world_size}")
    with fake_world(rank, run.world_size):
        mesh = build_mesh(run.layout, moe=run.cfg.is_moe, device="cpu")
        model, _ = build_model(run, mesh, meta=True)
        count = sum(p.numel() for p in model.parameters())  # this rank's TP / PP / EP shard, before ZeRO-3 frees it
        optimizer = build_optimizer(model, mesh, run)
        _one_step(model, optimizer, run, mesh.stats)
        memory = optimizer.memory()
        frozen = memory.get("frozen", sum(p.numel() * p.element_size() for p in model.parameters()
                                          if not p.requires_grad))  # ZeRO-3: its shards; else the whole base
        layout = dict(rank=rank, world_size=run.world_size, tp_rank=mesh.tp_rank, pp_rank=mesh.pp_rank,
                      dp_rank=mesh.dp_rank, cp_rank=mesh.cp_rank)
        collectives = [dict(op=op, group=group, calls=c.calls, bytes=c.bytes)
                       for (op, group), c in sorted(mesh.stats.snapshot().items())]
    return {"layout": layout, "parameter_count": count,
            "parameter_bytes": memory["parameters"], "gradient_bytes": memory["gradients"],
            "optimizer_bytes": memory["optimizer"], "host_optimizer_bytes": memory.get("host_optimizer", 0),
            "frozen_bytes": frozen,
            "collectives": collectives, "options": dataclasses.asdict(o)}


def _one_step(model, optimizer, run: PreparedRun, stats) -> None:
    """The forward and backward of up to two micro-batches through this rank's stage (the second meets what the
    first left: ZeRO-3's root gradient, ZeRO-2's slices), then the optimizer step, all on meta; `stats` counts the
    last micro-batch's collectives and the step's."""
    o = run.options
    ids = torch.zeros(o.micro_batch_size, o.seq_len, dtype=torch.long, device="meta")
    if model.first_stage:
        x = ids
    else:  # the previous stage's activations, as the pipeline would deliver them
        x = torch.zeros(o.micro_batch_size, run.layout.seq_shard(o.seq_len), run.cfg.hidden_size,
                        dtype=run.precision.param_dtype, device="meta", requires_grad=True)
    micro_batches = 1 if model.cfg.is_moe else min(2, run.num_micro_batches)
    optimizer.begin_step(micro_batches)
    for _ in range(micro_batches):
        stats.reset()
        if model.cfg.is_moe:  # the routing decides the all-to-all sizes: no values, no micro-batch; the step's traffic
            sum(p.sum() * 0 for p in model.parameters() if p.requires_grad).backward()
            continue
        out = model(x, ids if model.last_stage else None, dropout_seed=0)
        out.backward() if model.last_stage else out.backward(torch.zeros_like(out))
        if model.region.weight_grads is not None:  # zero-bubble schedules: the weight gradients the split left (W)
            model.region.weight_grads.run_all()
    optimizer.finish_backward()
    optimizer.clip_and_step(o.grad_clip)
