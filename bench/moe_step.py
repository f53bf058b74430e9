#!/usr/bin/env python
"""Mixture-of-experts training steps under expert parallelism: the all-to-all share of the step, the load
imbalance, and the planner's prediction of the all-to-all time for the same layout.

    single       1 process holding every expert (the grouped/loop comparison alone; e.g. on one GPU)
    dp2-ep1      2 processes, every rank holds all experts: no all-to-all (the reference)
    dp2-ep2      2 processes, 4 experts each, tokens dispatched over the 2 ranks
    dp4-ep4      4 processes, 2 experts each
    tp2-dp2-ep4  4 processes: EP folds over the TP and DP ranks (each TP rank routes half of the tokens)

Every layout trains the same MoE model (tiny-moe widened so that the experts dominate the step: hidden
`--hidden`, `--experts` experts of width `--expert-ffn`, top-2, one shared expert) from the same seed on the
same global batch with tensorpar's `BucketedOptimizer` (expert gradients over expert-DP), gloo on CPU.
`--warmup` untimed steps, then `--steps` timed ones with the comm layer's timing on (`CommStats(timing=True)`:
each collective's wall time, waiting for the slowest peer included); rank 0's medians are reported.

all-to-all share = seconds inside all_to_all on the "ep" group / step time. Load imbalance = the busiest
expert's routing choices over the mean (`training.moe_metrics`, max over layers), mean over the timed steps.

Planner: gloo's all-to-all on this machine is calibrated first (alpha and beta of a pairwise exchange, fitted
from the fastest of ten 1 KiB and ten 4 MiB all-to-alls over the EP group), then `planning.communication.model_collectives`
lists the layout's all-to-alls (balanced routing) and `collective_time` prices them on that link. The
planner's GPU catalog has no CPU entry: this calibrated link is the only way to put gloo into its model.

Each layout runs with every `--expert-gemms` kind: ``grouped`` (the default: one grouped GEMM per projection for
a rank's experts, torch._grouped_mm) and ``loop`` (one GEMM per expert); the all-to-all figures are the first kind's.

    .venv/bin/python bench/moe_step.py --expert-gemms grouped   # about 6 minutes on 2 busy cores
    .venv/bin/python bench/moe_step.py --steps 2 --layouts dp2-ep2   # a quick check
    .venv/bin/python bench/moe_step.py --layouts single --device cuda --dtype bf16 --hidden 1024 --expert-ffn 2816 \
        --experts 16 --seq-len 1024     # grouped vs loop on one GPU (the grouped kernel: bf16 on sm90+)

The line before the last is ``grouped/loop LAYOUT=X.XX (cpu Y.YY) ...`` (ratios of the median step's wall time and of
rank 0's CPU seconds in it, with both kinds run); the last is
``a2a_share dp2-ep2=X.XX dp4-ep4=Y.YY tp2-dp2-ep4=Z.ZZ imbalance=I.II`` (the largest imbalance of the EP
layouts).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.multiprocessing as mp

from tensorpar.distributed.launch import free_port  # rank 0's rendezvous port

LAYOUTS = {"single": (1, 1, 1), "dp2-ep1": (1, 2, 1), "dp2-ep2": (1, 2, 2), "dp4-ep4": (1, 4, 4), "tp2-dp2-ep4": (2, 2, 4)}  # tp, dp, ep


def model_config(a):
    from tensorpar.models import get_config

    return get_config("tiny-moe").replace(hidden_size=a.hidden, num_layers=a.layers, num_heads=a.heads,
                                          num_kv_heads=a.heads // 2, ffn_hidden_size=2 * a.hidden,
                                          num_experts=a.experts, moe_ffn_hidden_size=a.expert_ffn,
                                          max_seq_len=a.seq_len)


def calibrate(group, sizes=(1024, 4 * 2**20), repeats=10) -> tuple[float, float]:
    """(latency s, bandwidth B/s) of a pairwise-exchange all-to-all over `group`, from two message sizes:
    t = (n - 1) (alpha + B / (n beta)) (planning.collective_cost.collective_time). Each size: 3 untimed calls,
    then the fastest of `repeats` (the link's own speed; the CPUs are shared and the step's calls also wait)."""
    n = group.size
    times = []
    for nbytes in sizes:
        x = torch.zeros(nbytes // 4)
        split = [x.numel() // n] * n
        samples = []
        for i in range(3 + repeats):
            group.barrier()
            t0 = time.perf_counter()
            group.all_to_all(x[: sum(split)], split, split)
            if i >= 3:
                samples.append(time.perf_counter() - t0)
        times.append(min(samples))
    (b1, b2), (t1, t2) = sizes, times
    per_byte = max((t2 - t1) / (b2 - b1), 1e-15)  # (n - 1) / (n beta)
    alpha = max(t1 / (n - 1) - b1 * per_byte / (n - 1), 1e-7)
    return alpha, (n - 1) / (n * per_byte)


def worker(rank: int, world: int, port: int, a, name: str, gemm: str, out_path: str) -> None:
    from tensorpar.distributed.comm import CommStats
    from tensorpar.distributed.mesh import init_mesh
    from tensorpar.config.precision import Precision
    from tensorpar.models.build import Execution, build_transformer
    from tensorpar.data_parallel import data_parallel_optimizer
    from tensorpar.training.moe_metrics import moe_step_metrics

    torch.set_num_threads(a.threads)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    tp, dp, ep = LAYOUTS[name]
    stats = CommStats()
    mesh = init_mesh(tp=tp, dp=dp, ep=ep, device=a.device, stats=stats)
    cfg = model_config(a)
    link = calibrate(mesh.ep_group) if ep > 1 else None
    torch.manual_seed(0)
    model = build_transformer(cfg, mesh, precision=Precision(a.dtype), execution=Execution(expert_gemm=gemm), seed=0)
    model.train()
    opt = data_parallel_optimizer(model, mesh, lr=1e-3, weight_decay=0.1, zero=1 if dp > 1 else 0)
    g = torch.Generator().manual_seed(1)
    per_rank = a.global_batch // dp
    data = torch.randint(0, cfg.vocab_size, (a.warmup + a.steps, a.global_batch, a.seq_len + 1), generator=g)
    data = data.to(mesh.device)
    steps = []
    for step in range(a.warmup + a.steps):
        mine = data[step, mesh.dp_rank * per_rank:(mesh.dp_rank + 1) * per_rank]
        batches = list(mine.split(a.micro_batch))
        mesh.world_group.barrier()
        stats.reset()
        stats.timing = step >= a.warmup
        t0, cpu0 = time.perf_counter(), time.process_time()
        opt.begin_step(len(batches))
        total = 0.0
        for batch in batches:
            loss = model(batch[:, :-1], batch[:, 1:], aux_scale=1.0 / len(batches))
            (loss / len(batches)).backward()
            total += loss.item() / len(batches)
        opt.finish_backward()
        opt.clip_and_step(1.0, None)
        if mesh.device.type == "cuda":
            torch.cuda.synchronize()
        elapsed, cpu = time.perf_counter() - t0, time.process_time() - cpu0
        stats.timing = False
        metrics = moe_step_metrics(model, cfg, mesh)
        if step >= a.warmup:
            steps.append({"step_s": elapsed, "cpu_s": cpu, "a2a_s": stats.seconds("all_to_all", "ep"),
                          "a2a_bytes": stats.bytes("all_to_all", "ep"), "a2a_calls": stats.calls("all_to_all", "ep"),
                          "comm_s": stats.seconds(), "imbalance": metrics["moe_load_imbalance"], "loss": total})
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump({"steps": steps, "link": link, "micro_batches": len(batches)}, f)
    mesh.destroy()


def predicted_a2a(cfg, name: str, a, link) -> float:
    """The planner's all-to-all seconds of one step of this layout on the calibrated gloo link."""
    from tensorpar.config.hardware import Link
    from tensorpar.planning.collective_cost import collective_time
    from tensorpar.planning.communication import model_collectives
    from tensorpar.planning.candidates import Candidate

    tp, dp, ep = LAYOUTS[name]
    layout = Candidate.of(tp=tp, dp=dp, ep=ep, micro_batch_size=a.micro_batch)
    m = a.global_batch // dp // a.micro_batch
    gloo = Link(bandwidth=link[1], latency=link[0])
    colls = [c for c in model_collectives(cfg, layout, a.micro_batch, a.seq_len) if c.group == "ep"]
    return m * sum(c.calls * collective_time(c.op, c.nbytes, ep, gloo) for c in colls), m * sum(
        c.total_bytes for c in colls)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--expert-ffn", type=int, default=256)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--global-batch", type=int, default=8)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--layouts", default=",".join(LAYOUTS))
    p.add_argument("--expert-gemms", default="grouped,loop", help="comma-separated: grouped, loop")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="fp32", help="fp32, bf16 (bf16 parameters, as train --dtype bf16)")
    a = p.parse_args()
    names, gemms = a.layouts.split(","), a.expert_gemms.split(",")
    cfg = model_config(a)
    print(f"model: tiny-moe widened: hidden {cfg.hidden_size}, {cfg.num_layers} MoE layers, {cfg.num_experts} experts "
          f"(top-{cfg.experts_per_token}, width {cfg.expert_ffn_size}, {cfg.num_shared_experts} shared), "
          f"{cfg.num_parameters() / 1e6:.1f}M parameters ({cfg.num_parameters(active=True) / 1e6:.1f}M active); "
          f"global batch {a.global_batch} x {a.seq_len} tokens, micro-batch {a.micro_batch}, {a.dtype} on "
          f"{a.device}, {a.threads} thread(s) per rank, torch {torch.__version__}; medians of {a.steps} steps, rank 0")
    print(f"{'layout':12} {'gemm':>7} {'ranks':>5} {'step s':>7} {'a2a s':>7} {'a2a share':>9} {'a2a MiB':>8} "
          f"{'calls':>6} {'all comm':>8} {'imbalance':>9} | {'gloo alpha us':>13} {'beta MB/s':>9} "
          f"{'planned a2a s':>13} {'measured/planned':>16}", flush=True)
    shares, imbalances, step_s = {}, [], {}
    for name in names:  # one layout at a time, its rows printed as soon as they have run
        for gemm in gemms:
            tp, dp, ep = LAYOUTS[name]
            out = os.path.join(tempfile.mkdtemp(), f"{name}.json")
            mp.spawn(worker, args=(tp * dp, free_port(), a, name, gemm, out), nprocs=tp * dp, join=True)
            with open(out) as f:
                r = json.load(f)
            step_s[name, gemm], share, imbalance = report_row(cfg, a, name, gemm, r)
            if r["link"] and gemm == gemms[0]:
                shares[name] = share
                imbalances.append(imbalance)
    print("a2a: all_to_all seconds on the EP group (timing on: wall time inside each gloo call, waiting for the "
          "slowest peer included); all comm: every collective's share; imbalance: busiest expert / mean (max over "
          "layers); planned: the planner's all-to-alls of this layout (balanced routing) on the gloo link "
          "calibrated above")
    if "grouped" in gemms and "loop" in gemms:
        print("grouped/loop " + " ".join(f"{n}={step_s[n, 'grouped'][0] / step_s[n, 'loop'][0]:.2f} "
                                          f"(cpu {step_s[n, 'grouped'][1] / step_s[n, 'loop'][1]:.2f})" for n in names))
    if shares:
        print("a2a_share " + " ".join(f"{k}={v:.2f}" for k, v in shares.items()) + f" imbalance={max(imbalances):.2f}")
    return 0


def report_row(cfg, a, name: str, gemm: str, r: dict) -> tuple[float, float, float]:
    """Print one layout's row; (its median step seconds, all-to-all share, mean imbalance)."""
    tp, dp, ep = LAYOUTS[name]
    med = {k: statistics.median(s[k] for s in r["steps"]) for k in ("step_s", "cpu_s", "a2a_s", "comm_s", "a2a_bytes")}
    calls = r["steps"][0]["a2a_calls"]
    imbalance = statistics.mean(s["imbalance"] for s in r["steps"])
    share = med["a2a_s"] / med["step_s"]
    plan = ""
    if r["link"]:
        planned, planned_bytes = predicted_a2a(cfg, name, a, r["link"])
        plan = (f" {1e6 * r['link'][0]:13.0f} {r['link'][1] / 1e6:9.0f} {planned:13.3f} "
                f"{med['a2a_s'] / planned:16.2f}")
        if planned_bytes != med["a2a_bytes"]:
            plan += f"  (planned {planned_bytes / 2**20:.2f} MiB)"
    print(f"{name:12} {gemm:>7} {tp * dp:>5} {med['step_s']:7.3f} {med['a2a_s']:7.3f} {100 * share:8.1f}% "
          f"{med['a2a_bytes'] / 2**20:8.2f} {calls:>6} {100 * med['comm_s'] / med['step_s']:7.1f}% "
          f"{imbalance:9.2f} |{plan}", flush=True)
    return (med["step_s"], med["cpu_s"]), share, imbalance


if __name__ == "__main__":
    sys.exit(main())
