#!/usr/bin/env python
"""Time one training step (forward + backward + AdamW, fp32) of one GPT-2-style model three ways.

    single     tensorpar's Transformer on a one-rank mesh (TP=1): 1 process x 2 threads
    tensorpar  tensorpar's Transformer at TP=2 over gloo:         2 processes x 1 thread
    dtensor    PyTorch-native TP=2 (DTensor, parallelize_module): 2 processes x 1 thread

All three start from the same dense weights (a plain PyTorch model built once from the seed)
and see the same batch. The DTensor variant splits only the transformer blocks (q/k/v/fc1
column-wise, o_proj/fc2 row-wise, as torchtitan does); its embedding, tied LM head and loss stay
replicated on both ranks. tensorpar splits the embedding, the head and the loss by vocabulary.

One command does everything (it starts its own worker processes):

    .venv/bin/python bench/tp_step.py                       # the default model, ~ minutes on 2 cores
    .venv/bin/python bench/tp_step.py --hidden 128 --layers 2 --steps 3   # a quick check
    python bench/tp_step.py --device cuda --dtype bf16 --hidden 2048 --layers 16 --seq-len 2048
        # on GPUs: one GPU per process, NCCL; the TP=2 variants need 2 GPUs and are skipped with one

With `--device cuda` every process uses the GPU of its local rank and NCCL; timings wait for the GPU
(torch.cuda.synchronize) and the table adds each variant's MFU against the GPU's datasheet peak.
`--dtype bf16` runs every variant in bf16 (parameters, activations, AdamW state): a speed figure, not
tensorpar's bf16 recipe (which keeps fp32 master weights); the initial losses are then compared to 2e-2.

Each variant runs `--warmup` untimed steps, then `--steps` timed ones; the median step time of
rank 0 is reported (multi-process variants pass a barrier before every step, outside the timing).
Before training, every variant computes the loss of the initial weights, which must agree with
the single-process loss to `--loss-rtol` (relative). The last line of the output is

    tp2/single=X.XX tp2/dtensor=Y.YY

the ratios of median step times: tensorpar TP=2 over single, tensorpar TP=2 over DTensor TP=2.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from tensorpar.distributed.launch import free_port  # rank 0's rendezvous port

import exposed_comm  # bench/exposed_comm.py: the exposed-communication measurement
from plain_gpt import PlainGPT, parallelize_dtensor, to_tensorpar_names  # bench/plain_gpt.py: the peer

VARIANTS = {
    # name: (label, processes, threads per process)
    "single": ("single (tensorpar TP=1)", 1, 2),
    "tensorpar": ("tensorpar TP=2", 2, 1),
    "dtensor": ("DTensor TP=2", 2, 1),
    # not run by default, for reference: tensorpar TP=2 with sequence parallelism, and the plain
    # PyTorch model below in one process, its loss over the logits as they are or cast to fp32
    "tensorpar-sp": ("tensorpar TP=2 + SP", 2, 1),
    "single-chunked": ("single, chunked loss", 1, 2),  # the head and loss as `tensorpar train` runs them
    "plain": ("plain PyTorch (1 proc)", 1, 2),
    "plain-fp32-loss": ("plain, fp32 loss (1 proc)", 1, 2),
}


# ---------------------------------------------------------------------------------------------
# Configuration, batch
# ---------------------------------------------------------------------------------------------


def model_config(args):
    from tensorpar.models import ModelConfig

    return ModelConfig(
        family="gpt2", vocab_size=args.vocab, hidden_size=args.hidden, num_layers=args.layers,
        num_heads=args.heads, ffn_hidden_size=args.ffn or 4 * args.hidden, max_seq_len=max(args.seq_len, 256),
        activation="gelu_new", tie_embeddings=True, dropout=0.0,
    )


def make_batch(args):
    g = torch.Generator().manual_seed(args.seed + 1)
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq_len + 1), generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


# ---------------------------------------------------------------------------------------------
# Worker: one process of one variant
# ---------------------------------------------------------------------------------------------


def worker(args) -> None:
    threads = int(os.environ.get("OMP_NUM_THREADS", "1"))
    torch.set_num_threads(threads)
    import torch.distributed as dist

    import tensorpar
    from tensorpar.config.precision import Precision
    from tensorpar.config.choices import LOSS_CHUNK_TOKENS
    from tensorpar.models.build import Execution, build_transformer

    variant = args.worker
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    device = torch.device(args.device, rank) if args.device == "cuda" else torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    torch.manual_seed(args.seed)
    cfg = model_config(args)
    state = {k: v.to(dtype) for k, v in torch.load(args.state, weights_only=True).items()}
    ids, targets = (t.to(device) for t in make_batch(args))

    def synchronize():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    mesh = None
    if variant in ("single", "single-chunked", "tensorpar", "tensorpar-sp"):
        mesh = tensorpar.init_mesh(tp=world, device=device)  # world of 1 for "single": no process group at all

        def build(tp_overlap=True):
            layout = mesh.layout.replace(sequence_parallel=variant == "tensorpar-sp")
            chunk = LOSS_CHUNK_TOKENS if variant == "single-chunked" else None
            return build_transformer(cfg, mesh, layout, Precision(args.dtype),
                                     Execution(tp_overlap=tp_overlap, loss_chunk_tokens=chunk),
                                     weights=to_tensorpar_names(state), source="dense weights").to(dtype).train()

        model = build()
        barrier = mesh.tp_group.barrier
    elif variant == "dtensor":
        from torch.distributed.device_mesh import init_device_mesh

        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=rank, world_size=world)
        device_mesh = init_device_mesh(device.type, (world,))
        model = PlainGPT(cfg).to(device=device, dtype=dtype)
        model.load_state_dict(state)
        parallelize_dtensor(model, device_mesh)
        barrier = dist.barrier
    else:  # plain, plain-fp32-loss
        model = PlainGPT(cfg, fp32_loss=variant == "plain-fp32-loss").to(device=device, dtype=dtype)
        model.load_state_dict(state)
        barrier = lambda: None  # noqa: E731
    model.train()

    with torch.no_grad():
        initial_loss = model(ids, targets).item()

    def make_step(model):
        """One timed training step of `model`: (loss, (step, forward, backward, optimizer seconds))."""
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)

        def step():
            optimizer.zero_grad(set_to_none=True)
            synchronize()
            t0 = time.perf_counter()
            loss = model(ids, targets)
            synchronize()
            t1 = time.perf_counter()
            loss.backward()
            synchronize()
            t2 = time.perf_counter()
            optimizer.step()
            synchronize()
            t3 = time.perf_counter()
            return loss.item(), (t3 - t0, t1 - t0, t2 - t1, t3 - t2)

        return step

    step = make_step(model)

    times, last_loss = [], None
    for i in range(args.warmup + args.steps):
        barrier()
        last_loss, t = step()
        if i >= args.warmup:
            times.append(t)

    comm = None
    if variant.startswith("tensorpar") and args.comm_steps > 0:
        # A few more steps with tensorpar's collective timing on (wall time inside each gloo call,
        # which includes waiting for the peer to arrive). Not part of the timed steps above.
        mesh.stats.reset()
        mesh.stats.timing = True
        comm_times = []
        for _ in range(args.comm_steps):
            barrier()
            comm_times.append(step()[1][0])
        n = args.comm_steps
        comm = {
            "step_s": statistics.median(comm_times),
            "per_op": {
                f"{op}/{group}": {"calls": c.calls / n, "mbytes": c.bytes / n / 1e6, "seconds": c.seconds / n}
                for (op, group), c in sorted(mesh.stats.snapshot().items())
            },
        }

    exposed = None
    if variant.startswith("tensorpar") and world > 1 and args.exposed_rounds > 0:
        # The same model and weights built without the overlap: the overlap is chosen when a model is built.
        steps = {True: step, False: make_step(build(tp_overlap=False))}
        exposed = exposed_comm.measure(steps, barrier, mesh.stats, args.exposed_rounds)
        exposed["cpu_share"] = exposed_comm.cpu_share(mesh.tp_group, args.batch * args.seq_len * args.hidden)

    profile = None
    if args.profile > 0:
        from torch.profiler import ProfilerActivity, profile as torch_profile

        with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(args.profile):
                barrier()
                step()
        profile = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.profile_rows)

    # Every rank writes its result; the table uses rank 0's, the collective timings both.
    result = {
        "variant": variant,
        "world": world,
        "threads": threads,
        "initial_loss": initial_loss,
        "last_loss": last_loss,
        "step_s": [t[0] for t in times],
        "fwd_s": [t[1] for t in times],
        "bwd_s": [t[2] for t in times],
        "opt_s": [t[3] for t in times],
        "comm": comm,
        "exposed": exposed,
        "profile": profile,
    }
    with open(f"{args.result}.{rank}", "w") as f:
        json.dump(result, f)
    if mesh is not None:
        mesh.destroy()
    elif dist.is_initialized():
        dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------
# Driver
# ---------------------------------------------------------------------------------------------


def worker_argv(args, variant: str, state_path: str, result_path: str) -> list[str]:
    argv = [sys.executable, os.path.abspath(__file__), "--worker", variant, "--state", state_path,
            "--result", result_path]
    for flag in ("hidden", "layers", "heads", "ffn", "vocab", "batch", "seq_len", "steps", "warmup", "seed",
                 "lr", "comm_steps", "exposed_rounds", "profile", "profile_rows", "device", "dtype"):
        value = getattr(args, flag)
        if value is not None:
            argv += ["--" + flag.replace("_", "-"), str(value)]
    return argv


def _cpu_seconds() -> tuple[float, float] | None:
    """(busy, total) CPU seconds of the whole machine since boot, summed over CPUs (Linux /proc/stat)."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    tick = os.sysconf("SC_CLK_TCK")
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return (sum(fields[:8]) - idle) / tick, sum(fields[:8]) / tick


def _own_cpu_seconds() -> float:
    """CPU seconds used by this process and its finished children."""
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def launch(args, variant: str, state_path: str, workdir: str) -> dict:
    """Run one variant's worker processes; returns rank 0's result plus `other_load`: the share of the
    machine's CPU time that processes other than this benchmark used meanwhile (a noise indicator)."""
    _, nprocs, threads = VARIANTS[variant]
    cpu0, own0 = _cpu_seconds(), _own_cpu_seconds()
    result_path = os.path.join(workdir, f"{variant}.json")
    port = free_port()
    procs = []
    for rank in range(nprocs):
        env = dict(os.environ)
        for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
            env.pop(key, None)
        env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
        if nprocs > 1:
            env.update(RANK=str(rank), WORLD_SIZE=str(nprocs), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(nprocs),
                       MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        procs.append(subprocess.Popen(worker_argv(args, variant, state_path, result_path), env=env))
    deadline = time.monotonic() + args.timeout
    try:
        while True:
            codes = [p.poll() for p in procs]
            failed = [c for c in codes if c not in (None, 0)]
            if failed or time.monotonic() > deadline:
                raise RuntimeError(f"variant {variant}: worker exit codes {codes}" + ("" if failed else " (timed out)"))
            if all(c == 0 for c in codes):
                break
            time.sleep(0.05)
    finally:
        for p in procs:  # only the processes started here, by handle
            if p.poll() is None:
                p.kill()
                p.wait()
    cpu1, own1 = _cpu_seconds(), _own_cpu_seconds()
    ranks = []
    for rank in range(nprocs):
        with open(f"{result_path}.{rank}") as f:
            ranks.append(json.load(f))
    result = ranks[0]
    result["comm_by_rank"] = [r["comm"] for r in ranks]
    result["exposed_by_rank"] = [r.get("exposed") for r in ranks]
    result["other_load"] = None
    if cpu0 and cpu1 and cpu1[1] > cpu0[1]:
        foreign = (cpu1[0] - cpu0[0]) - (own1 - own0)
        result["other_load"] = max(0.0, foreign / (cpu1[1] - cpu0[1]))
    return result


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--ffn", type=int, default=None, help="MLP width (default 4 x hidden)")
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--steps", type=int, default=10, help="timed steps per variant")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps before them")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="cuda: one GPU per process (local rank), NCCL; variants needing more GPUs are skipped")
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32",
                   help="parameters, activations and optimizer state of every variant")
    p.add_argument("--comm-steps", type=int, default=3,
                   help="extra tensorpar TP=2 steps with collective timing on (0: skip)")
    p.add_argument("--exposed-rounds", type=int, default=5,
                   help="rounds of the exposed-communication measurement of the tensorpar TP=2 variants, TP overlap\n"
                        "on and off, real and no-op collectives (4 extra steps per round; 0: skip)")
    p.add_argument("--profile", type=int, default=0,
                   help="after timing, profile this many extra steps per variant (torch.profiler, rank 0)")
    p.add_argument("--profile-rows", type=int, default=15)
    p.add_argument("--variants", default="single,tensorpar,tensorpar-sp,dtensor",
                   help="comma-separated subset of: " + ", ".join(VARIANTS))
    p.add_argument("--loss-rtol", type=float, default=None, help="default 1e-4 (fp32), 2e-2 (bf16)")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per variant")
    # internal: run as one worker process
    p.add_argument("--worker", choices=list(VARIANTS), help=argparse.SUPPRESS)
    p.add_argument("--state", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        sys.exit(f"unknown variant(s) {unknown}; choose from {list(VARIANTS)}")

    torch.set_num_threads(2)
    if args.loss_rtol is None:
        args.loss_rtol = 1e-4 if args.dtype == "fp32" else 2e-2
    gpus = 0
    if args.device == "cuda":
        if not torch.cuda.is_available():
            sys.exit("--device cuda: no CUDA device visible to PyTorch")
        gpus = torch.cuda.device_count()
        skipped = [v for v in variants if VARIANTS[v][1] > gpus]
        for v in skipped:
            print(f"skipping {VARIANTS[v][0]}: it needs {VARIANTS[v][1]} GPUs, {gpus} visible")
        variants = [v for v in variants if v not in skipped]
        if not variants:
            sys.exit("no variant fits the visible GPUs")
    cfg = model_config(args)
    tokens = args.batch * args.seq_len
    print(f"model: gpt2-style hidden {cfg.hidden_size}, {cfg.num_layers} layers, {cfg.num_heads} heads, "
          f"ffn {cfg.ffn_hidden_size}, vocab {cfg.vocab_size}, max_seq_len {cfg.max_seq_len}, tied embeddings, "
          f"no dropout; {cfg.num_parameters() / 1e6:.2f}M parameters")
    where = (f"{gpus} x {torch.cuda.get_device_name(0)}" if args.device == "cuda" else f"{os.cpu_count()} CPUs")
    print(f"step: forward + backward + AdamW, {args.dtype}; batch {args.batch} x seq {args.seq_len} = {tokens} tokens; "
          f"{args.warmup} warmup + {args.steps} timed steps; torch {torch.__version__}, {where}")
    print("DTensor TP=2: blocks split (q/k/v/fc1 ColwiseParallel, o_proj/fc2 RowwiseParallel); "
          "embedding, tied head and loss replicated")

    # The dense weights, built once from the seed; every variant loads them.
    torch.manual_seed(args.seed)
    dense = PlainGPT(cfg)
    dense.init_gpt2(cfg.init_std, cfg.num_layers)
    ids, targets = make_batch(args)
    with torch.no_grad():  # fp32, on the benchmark's device (a large model on the CPU would take minutes)
        device = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
        dense_loss = dense.to(device)(ids.to(device), targets.to(device)).item()
        dense.cpu()
        if device.type == "cuda":
            torch.cuda.empty_cache()

    results = {}
    with tempfile.TemporaryDirectory(prefix="tp_step_") as workdir:
        state_path = os.path.join(workdir, "dense.pt")
        torch.save(dense.state_dict(), state_path)
        for variant in variants:
            label, nprocs, threads = VARIANTS[variant]
            print(f"running {label} ({nprocs} x {threads} thread{'s' if threads > 1 else ''}) ...", flush=True)
            results[variant] = launch(args, variant, state_path, workdir)

    def median(variant, key="step_s"):
        return statistics.median(results[variant][key])

    peak = None
    if args.device == "cuda":
        from tensorpar.models.flops import train_flops_per_token
        from tensorpar.training.mfu import peak_flops

        peak, peak_source = peak_flops(torch.device("cuda", 0), args.dtype)
        flops_per_step = train_flops_per_token(cfg, args.seq_len) * tokens

    print()
    print(f"{'variant':<26}{'procs x thr':>12}{'median s/step':>15}{'tokens/s':>10}"
          f"{'fwd s':>8}{'bwd s':>8}{'opt s':>8}{'min s':>8}{'max s':>8}{'other load':>12}"
          + (f"{'MFU':>7}" if peak else ""))
    for variant in variants:
        label, nprocs, threads = VARIANTS[variant]
        r = results[variant]
        m = median(variant)
        print(f"{label:<26}{f'{nprocs} x {threads}':>12}{m:>15.4f}{tokens / m:>10.0f}"
              f"{median(variant, 'fwd_s'):>8.3f}{median(variant, 'bwd_s'):>8.3f}{median(variant, 'opt_s'):>8.3f}"
              f"{min(r['step_s']):>8.3f}{max(r['step_s']):>8.3f}"
              f"{'n/a' if r['other_load'] is None else format(r['other_load'], '.0%'):>12}"
              + (f"{flops_per_step / m / (peak * nprocs):>7.1%}" if peak else ""))
    print("(rank 0's medians; fwd/bwd/opt are the medians of each phase, so they need not add up exactly;\n"
          " other load: share of the machine's CPU time used by other processes while the variant ran)")
    if peak:
        print(f"(MFU: {train_flops_per_token(cfg, args.seq_len):.3g} model FLOPs per token (6N + attention) x tokens / "
              f"step time / (GPUs x {peak / 1e12:.0f} TFLOP/s peak, {peak_source}))")
    noisy = [v for v in variants if (results[v]["other_load"] or 0) > 0.05]
    if noisy:
        print(f"WARNING: other processes used > 5% of the CPUs during {', '.join(noisy)}: timings are disturbed")

    for variant in variants:
        if results[variant].get("profile"):
            print(f"\ntorch.profiler, {VARIANTS[variant][0]}, rank 0, {args.profile} step(s):")
            print(results[variant]["profile"])

    for variant in variants:
        comms = results[variant].get("comm_by_rank") or []
        if not comms or not comms[0]:
            continue
        print()
        print(f"{VARIANTS[variant][0]}: collectives per step ({args.comm_steps} extra steps with tensorpar's "
              f"timing on; seconds are wall time inside the gloo call, waiting for the peer included)")
        for rank, comm in enumerate(comms):
            total = sum(c["seconds"] for c in comm["per_op"].values())
            ops = ", ".join(f"{k} {c['calls']:.0f} x = {c['mbytes']:.1f} MB in {c['seconds']:.4f} s"
                            for k, c in comm["per_op"].items())
            print(f"  rank {rank}: {ops}; total {total:.4f} s of a {comm['step_s']:.4f} s step "
                  f"({100 * total / comm['step_s']:.1f}%)")

    print()
    print(f"initial loss: plain dense model {dense_loss:.6f}")
    ok = True
    ref = results["single"]["initial_loss"] if "single" in results else dense_loss
    for variant in variants:
        r = results[variant]
        rel = abs(r["initial_loss"] - ref) / abs(ref)
        good = rel <= args.loss_rtol
        ok &= good
        print(f"initial loss: {VARIANTS[variant][0]:<26}{r['initial_loss']:.6f}  rel. diff vs single {rel:.1e}  "
              f"{'OK' if good else 'MISMATCH'}   (loss after last step {r['last_loss']:.6f})")
    if not ok:
        print(f"ERROR: initial losses differ by more than {args.loss_rtol:g} relative")

    def ratio(a, b):
        return f"{median(a) / median(b):.2f}" if a in results and b in results else "n/a"

    exposed_line = exposed_comm.print_exposed(results, {v: VARIANTS[v][0] for v in VARIANTS}, variants, args)
    if exposed_line:
        print(exposed_line)
    print(f"tp2/single={ratio('tensorpar', 'single')} tp2/dtensor={ratio('tensorpar', 'dtensor')}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
