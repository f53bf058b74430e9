#!/usr/bin/env python
"""Step time and memory of data parallelism at DP 2, ZeRO 0/1/2/3, against PyTorch FSDP2 on the same model.

    zero0 .. zero3   tensorpar's Transformer with `BucketedOptimizer` (ZeRO 0/1/2) or
                     `FullyShardedOptimizer` (ZeRO-3), 2 processes x `--threads` threads, gloo or NCCL
    fsdp2            the same tensorpar Transformer (TP 1) sharded by PyTorch's `fully_shard` (FSDP2):
                     each block, then the root; torch's AdamW (foreach) and clip_grad_norm_

Every variant starts from the same weights (the model's seeded initialisation), sees the same batches
(each rank its own half of the global batch, `--micro-batches` micro-batches per step) and must agree on the
first step's loss. Each variant runs `--warmup` untimed steps, then `--steps` timed ones; rank 0's median is
reported. Memory: parameters, gradients and optimizer state per rank as tensorpar's ledgers count them, and
for FSDP2 the bytes of its local shards and their gradients and states (what it keeps between steps); with
CUDA also the allocator's peak for every variant. With `--plot PATH` the memory per rank is drawn.

    .venv/bin/python bench/zero_step.py                              # the default model, a few minutes on 2 cores
    .venv/bin/python bench/zero_step.py --hidden 128 --layers 2 --steps 3   # a quick check
    .venv/bin/python bench/zero_step.py --device cuda                # one GPU per rank (NCCL)

The last line is ``zero3/zero1=X.XX zero3/fsdp2=Y.YY`` (ratios of median step times).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.multiprocessing as mp

from tensorpar.distributed.launch import free_port  # rank 0's rendezvous port

VARIANTS = ("zero0", "zero1", "zero2", "zero3", "fsdp2")


def model_config(a):
    from tensorpar.models import get_config

    return get_config("tiny").replace(hidden_size=a.hidden, num_layers=a.layers, num_heads=a.heads,
                                      num_kv_heads=a.heads, ffn_hidden_size=4 * a.hidden, vocab_size=a.vocab,
                                      max_seq_len=a.seq_len)


def build(variant: str, a, mesh):
    from tensorpar.models.build import build_transformer
    from tensorpar.data_parallel import data_parallel_optimizer
    from tensorpar.data_parallel import FullyShardedOptimizer

    torch.manual_seed(0)
    model = build_transformer(model_config(a), mesh, seed=0)
    model.train()
    kw = dict(lr=1e-3, weight_decay=0.1)
    if variant == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for block in model.layers.values():
            fully_shard(block)
        fully_shard(model)
        return model, torch.optim.AdamW(model.parameters(), betas=(0.9, 0.95), foreach=True, **kw)
    if variant == "zero3":
        return model, FullyShardedOptimizer(model, mesh, **kw)
    return model, data_parallel_optimizer(model, mesh, zero=int(variant[-1]), bucket_bytes=int(a.bucket_mb * 2**20), **kw)


def one_step(variant, model, opt, batches, activations):
    with activations.measuring(model) if variant != "fsdp2" else contextlib.nullcontext():
        if variant != "fsdp2":
            opt.begin_step(len(batches))
        losses = []
        for i, batch in enumerate(batches):
            if variant == "fsdp2":  # reduce-scatter only after the last micro-batch, as tensorpar's ZeRO-1 does
                model.set_requires_gradient_sync(i == len(batches) - 1)
            loss = model(batch[:, :-1], batch[:, 1:])
            (loss / len(batches)).backward()
            losses.append(loss.item())
    if variant == "fsdp2":
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
    else:
        opt.finish_backward()
        opt.clip_and_step(1.0)
    return sum(losses) / len(losses)


def fsdp2_memory(model, opt) -> dict:
    def local(t):
        t = t.to_local() if hasattr(t, "to_local") else t
        return t.numel() * t.element_size()

    params = sum(local(p) for p in model.parameters())
    states = sum(local(t) for s in opt.state.values() for t in s.values() if torch.is_tensor(t) and t.dim() > 0)
    return {"parameters": params, "gradients": params, "optimizer": states}


def worker(rank: int, world: int, port: int, a, out_path: str) -> None:
    from tensorpar.distributed.mesh import init_mesh
    from tensorpar.training.memory_meter import ActivationMeter

    torch.set_num_threads(a.threads)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    mesh = init_mesh(tp=1, dp=world, device=a.device)
    results = {}
    g = torch.Generator().manual_seed(1)
    cfg = model_config(a)
    data = torch.randint(0, cfg.vocab_size, (a.warmup + a.steps, world, a.micro_batches, a.micro_batch,
                                             a.seq_len + 1), generator=g)
    for variant in a.variants:
        model, opt = build(variant, a, mesh)
        activations = ActivationMeter()
        times, first = [], None
        for step in range(a.warmup + a.steps):
            batches = [data[step, rank, i].to(mesh.device) for i in range(a.micro_batches)]
            mesh.world_group.barrier()
            if mesh.device.type == "cuda":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
            loss = one_step(variant, model, opt, batches, activations)
            if mesh.device.type == "cuda":
                torch.cuda.synchronize()
            if step == 0:
                first = loss
            if step >= a.warmup:
                times.append(time.perf_counter() - t0)
        mem = fsdp2_memory(model, opt) if variant == "fsdp2" else dict(opt.memory())
        mem["activations"] = activations.bytes.peak if variant != "fsdp2" else None
        if mesh.device.type == "cuda":
            mem["allocated"] = torch.cuda.max_memory_allocated()
        results[variant] = {"median_s": statistics.median(times), "first_loss": first, "memory": mem}
        del model, opt
    per_rank = mesh.world_group.all_gather_object(results)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(per_rank, f)
    mesh.destroy()


def plot(per_rank, path: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds = ("parameters", "gradients", "optimizer", "gathered", "activations")
    variants = list(per_rank[0])
    fig, ax = plt.subplots(figsize=(8, 4))
    for r, results in enumerate(per_rank):
        bottom = [0.0] * len(variants)
        for k, kind in enumerate(kinds):
            vals = [(results[v]["memory"].get(kind) or 0) / 2**20 for v in variants]
            xs = [i + 0.38 * r for i in range(len(variants))]
            ax.bar(xs, vals, 0.36, bottom=bottom, color=f"C{k}", label=kind if r == 0 else None)
            bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set_xticks([i + 0.19 for i in range(len(variants))], [f"{v}\n(rank 0 | 1)" for v in variants])
    ax.set_ylabel("MiB per rank")
    ax.set_title("memory per rank at DP 2 (FSDP2: its shards, gradients and AdamW states only)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return path


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--micro-batches", type=int, default=1)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--device", default="cpu")
    p.add_argument("--bucket-mb", type=float, default=25.0, help="ZeRO 0-2 gradient bucket size")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--plot", default=None, help="draw memory per rank to this PNG")
    a = p.parse_args()
    a.variants = a.variants.split(",")
    out = os.path.join(tempfile.mkdtemp(), "zero_step.json")
    mp.spawn(worker, args=(2, free_port(), a, out), nprocs=2, join=True)
    with open(out) as f:
        per_rank = json.load(f)
    cfg = model_config(a)
    print(f"model: hidden {cfg.hidden_size}, {cfg.num_layers} layers, vocab {cfg.vocab_size}, "
          f"{cfg.num_parameters() / 1e6:.1f}M parameters; DP 2, {a.micro_batches} x {a.micro_batch} sequences of "
          f"{a.seq_len} per rank per step, {a.device}, {a.threads} thread(s) per rank, torch {torch.__version__}")
    print(f"{'variant':8} {'step s':>8} {'first loss':>11} {'params MiB':>11} {'grads MiB':>10} {'optim MiB':>10} "
          f"{'gathered':>9} {'activ. MiB':>11}" + (" alloc MiB" if a.device.startswith("cuda") else ""))
    ref_loss = per_rank[0][a.variants[0]]["first_loss"]
    for v in a.variants:
        r = per_rank[0][v]
        m = {k: (x / 2**20 if x is not None else float("nan")) for k, x in r["memory"].items()}
        print(f"{v:8} {r['median_s']:8.3f} {r['first_loss']:11.5f} {m['parameters']:11.2f} {m['gradients']:10.2f} "
              f"{m['optimizer']:10.2f} {m.get('gathered', 0.0):9.2f} {m['activations']:11.2f}"
              + (f" {m['allocated']:9.1f}" if "allocated" in m else ""))
        if abs(r["first_loss"] - ref_loss) > 1e-4 * abs(ref_loss):
            print(f"ERROR: {v}'s first loss {r['first_loss']} differs from {a.variants[0]}'s {ref_loss}")
            return 1
    if a.plot:
        print(f"memory plot: {plot(per_rank, a.plot)}")
    t = {v: per_rank[0][v]["median_s"] for v in a.variants}
    if {"zero3", "zero1", "fsdp2"} <= set(t):
        print(f"zero3/zero1={t['zero3'] / t['zero1']:.2f} zero3/fsdp2={t['zero3'] / t['fsdp2']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
