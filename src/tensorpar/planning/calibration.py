"""Calibration: measure the machine at hand so the planner predicts it (`tensorpar calibrate`, `plan --hardware`).

`calibrate` times, on one device (cpu or cuda):

- GEMMs ``torch.matmul(A[m, k], B[k, n])`` over a sweep of shapes (small to large, thin and square) per dtype
  (fp8: ``torch._scaled_mm``, measured by default on GPUs that have it);
- optionally (``--sustain SECONDS``) each dtype's best GEMM back to back for that long: the rate a GPU keeps
  once its power limit lowers its clock;
- memory bandwidth: a large ``copy_`` (bytes read + written per second);
- the host, for the offloading levers (`tensorpar.planning.host_calibration`): copies between the device and host
  memory, and an AdamW step over fp32 tensors in host memory;
- collectives (all_reduce, all_gather, reduce_scatter, all_to_all, send/recv) by message size and group size,
  with gloo on CPU processes (``--device cpu``) or NCCL across the GPUs of the node (``--device cuda`` with
  more than one GPU);

and fits the `DeviceCurve` of `tensorpar.planning.devices` to the GEMM times (a small grid search over
k_overhead, wave_quantization, launch, the tile and the level ``gemm_efficiency``, minimising the squared log
error; the peak is the best measured rate, which one lucky timing can set, so the level the shapes share is
fitted below it instead of pinned to it) and an alpha-beta `Link` to each collective's
times (least squares of time = alpha x steps + bytes-moved / beta). `load_profile` turns the JSON back into
a `GPUSpec` and a `DeviceCurve` for the planner.

Two things the CPU measurement must get right to predict a multi-process run:

- every rank measures its GEMMs and bandwidth at the same time as the others and *in step* (`_together`: the
  same number of calls per timed batch, each batch started after a barrier). Without it a rank that finishes a
  shape early leaves the cores to the other, which then times itself on the whole machine.
- the reduce-scatter is timed through tensorpar's own `Group.reduce_scatter`: on gloo an all-to-all of the
  blocks and a local sum (PyTorch's gloo reduce-scatter all-reduces a clone of the whole input), which moves
  what a ring reduce-scatter moves and is fitted and priced so.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tensorpar.config.hardware import DEFAULT_LINK_EFFICIENCY, GPUSpec, Link
from tensorpar.distributed.comm import Group
from tensorpar.errors import TensorparError
from tensorpar.planning.devices import DeviceCurve, gemm_time
from tensorpar.planning.host_calibration import HOST_LINK_LATENCY_S, Timer, measure_host

CPU_SHAPES = [(m, n, k) for m in (64, 256, 1024) for n in (64, 256, 1024) for k in (64, 256, 1024)]
CUDA_SHAPES = [(m, n, k) for m in (128, 1024, 4096, 16384) for n in (128, 1024, 4096, 16384)
               for k in (128, 1024, 4096, 16384)]
COLLECTIVE_SIZES = (4 * 1024, 64 * 1024, 1024 * 1024, 8 * 1024 * 1024)
COLLECTIVE_OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send")


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _calls_in(fn, device, seconds: float) -> int:
    """How many calls of `fn` take about `seconds` (timed on one call after a warm-up call)."""
    fn()
    _sync(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    return max(1, int(seconds / max(time.perf_counter() - t0, 1e-7)))


def _time(fn, device, min_s: float = 0.05, min_reps: int = 3, together=None) -> float:
    """Median-of-batches seconds per call of `fn` (after a warm-up). With `together` (several processes measuring
    at once, `_together`) every process runs the same number of calls per batch and starts each batch at the same
    moment, so each batch is timed while the others really compute too."""
    reps, samples = _calls_in(fn, device, min_s / 3), []
    if together is not None:
        reps = together(reps)
    for _ in range(min_reps):
        if together is not None:
            together()
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        _sync(device)
        samples.append((time.perf_counter() - t0) / reps)
    return sorted(samples)[len(samples) // 2]


def timer(device) -> Timer:
    """Seconds per call of a function on `device`, timed as calibrate times its measures (`_time`, one process)."""
    return lambda fn: _time(fn, device)


def _together(reps: int | None = None) -> int | None:
    """Keep the processes of a concurrent CPU measurement in step: with `reps`, agree on the largest; without,
    wait for every process (a barrier) before the next timed batch."""
    if reps is None:
        dist.barrier()
        return None
    agreed = torch.tensor([reps])
    dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
    return int(agreed.item())


FP8 = torch.float8_e4m3fn


def gemm_fn(device, dtype: torch.dtype, m: int, n: int, k: int):
    """A callable that runs one (m, n, k) GEMM in `dtype`. fp8 goes through ``torch._scaled_mm`` (e4m3 inputs,
    per-tensor scales, bf16 output: what Transformer Engine's and torchao's fp8 linears run), whose second
    operand must be column-major."""
    if dtype == FP8:
        a = torch.randn(m, k, device=device).to(FP8)
        b = torch.randn(n, k, device=device).to(FP8).t()
        one = torch.ones((), device=device)
        return lambda: torch._scaled_mm(a, b, one, one, out_dtype=torch.bfloat16)
    a = torch.randn(m, k, device=device, dtype=dtype)
    b = torch.randn(k, n, device=device, dtype=dtype)
    return lambda: torch.matmul(a, b)


def measure_gemms(device, dtype: torch.dtype, shapes, together=None) -> list[dict]:
    out = []
    for m, n, k in shapes:
        t = _time(gemm_fn(device, dtype, m, n, k), device, together=together)
        out.append({"m": m, "n": n, "k": k, "seconds": t, "flops_per_s": 2.0 * m * n * k / t})
    return out


def measure_sustained(device, dtype: torch.dtype, shape, seconds: float, swept_flops_per_s: float,
                      window_s: float = 0.5, min_windows: int = 10) -> dict:
    """The rate of one GEMM run back to back for `seconds`, in windows of about `window_s` (shorter if `seconds`
    would hold fewer than `min_windows`, and never fewer windows than that, even when some overran their time): a
    GPU at its power limit lowers its clock after some seconds of tensor-core load, which a sweep of short timings
    (each shape a fraction of a second) does not see. ``ratio`` is the rate of the last quarter of the windows (median) over
    `swept_flops_per_s`, the sweep's rate of the same shape (what the fitted level stands for): the share of it
    that training, hours of such load, keeps. The first windows' rate is recorded beside it: a device already
    hot from the sweep starts below the sweep's rate."""
    m, n, k = shape
    fn = gemm_fn(device, dtype, m, n, k)
    reps = _calls_in(fn, device, min(window_s, seconds / min_windows))
    rates, start = [], time.perf_counter()
    while len(rates) < min_windows or time.perf_counter() - start < seconds:
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        _sync(device)
        rates.append(2.0 * m * n * k * reps / (time.perf_counter() - t0))
    head = sorted(rates[:3])
    tail = sorted(rates[-max(1, len(rates) // 4):])
    first, last = head[len(head) // 2], tail[len(tail) // 2]
    return {"m": m, "n": n, "k": k, "seconds": time.perf_counter() - start, "first_flops_per_s": first,
            "last_flops_per_s": last, "swept_flops_per_s": swept_flops_per_s,
            "ratio": min(1.0, last / swept_flops_per_s), "windows": rates}


def measure_bandwidth(device, nbytes: int, together=None) -> float:
    src = torch.empty(nbytes // 4, device=device, dtype=torch.float32).fill_(1.0)
    dst = torch.empty_like(src)
    t = _time(lambda: dst.copy_(src), device, together=together)
    return 2.0 * nbytes / t


def measure_attention(device, dtype: torch.dtype, peak: float, together=None) -> tuple[float, float]:
    """(forward, backward) efficiency of causal scaled-dot-product attention against `peak`, at one shape (the
    planner's flash-attention model: 2 b h s^2 d FLOPs forward, 2.5 x that backward)."""
    b, heads, s, d = (1, 8, 1024, 64) if device.type == "cpu" else (2, 16, 4096, 128)
    q, k, v = (torch.randn(b, heads, s, d, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
    sdpa = torch.nn.functional.scaled_dot_product_attention
    fwd = _time(lambda: sdpa(q, k, v, is_causal=True), device, together=together)
    out = sdpa(q, k, v, is_causal=True)
    grad = torch.ones_like(out)
    both = _time(lambda: torch.autograd.grad(sdpa(q, k, v, is_causal=True), (q, k, v), grad), device,
                 together=together)
    flops = 2.0 * b * heads * s * s * d
    return min(1.0, flops / fwd / peak), min(1.0, 2.5 * flops / max(both - fwd, 1e-9) / peak)


FIT_EFFICIENCIES = tuple(x / 100 for x in range(50, 101, 2))


def fit_curve(name: str, points: list[dict], peak: float, hbm: float, units: int, dtype: str) -> DeviceCurve:
    """The `DeviceCurve` whose `gemm_time` best matches the measured `points` (squared log error), its
    ``gemm_efficiency`` (the fraction of `peak`, the best single measurement, that the shapes reach together)
    fitted with the rest."""
    best, best_err = None, math.inf
    nbytes = _DTYPES[dtype].itemsize if dtype in _DTYPES else 2  # the planner times a GEMM's bytes in its dtype
    for tile in (32, 64, 128):
        for k_over in (0.0, 16.0, 64.0, 128.0, 256.0):
            for wq in (0.0, 0.5, 1.0):
                for launch in (1e-6, 5e-6, 20e-6, 50e-6):
                    for eff in FIT_EFFICIENCIES:
                        c = DeviceCurve(name, {dtype: eff, "bf16": eff}, units, tile, tile, k_over, wq, launch, 1.0)
                        err = sum(math.log(gemm_time(p["m"], p["n"], p["k"], peak, hbm, c, dtype, nbytes)
                                           / p["seconds"]) ** 2 for p in points)
                        if err < best_err:
                            best, best_err = c, err
    return best


def _fit_link(samples: list[tuple[float, float, float]]) -> Link:
    """alpha, beta from (steps, bytes moved per rank, seconds) by least squares (beta > 0, alpha >= 0)."""
    n = len(samples)
    sxx = sum(s * s for s, _, _ in samples)
    syy = sum(b * b for _, b, _ in samples)
    sxy = sum(s * b for s, b, _ in samples)
    sxt = sum(s * t for s, _, t in samples)
    syt = sum(b * t for _, b, t in samples)
    det = sxx * syy - sxy * sxy
    if n < 2 or abs(det) < 1e-30:
        raise TensorparError("too few collective samples to fit a link")
    alpha = (sxt * syy - syt * sxy) / det
    inv_beta = (sxx * syt - sxy * sxt) / det
    return Link(1.0 / max(inv_beta, 1e-15), max(alpha, 0.0))


def _steps_and_bytes(op: str, nbytes: int, n: int) -> tuple[float, float]:
    """(latency steps, bytes each rank moves) of the ring algorithm (`collective_cost.collective_time`); tensorpar's
    reduce-scatter moves a ring's bytes on gloo too (an all-to-all of the blocks and a local sum)."""
    if op == "all_reduce":
        return 2 * (n - 1), 2 * (n - 1) * nbytes / n
    if op == "send":
        return 1, nbytes
    return n - 1, (n - 1) * nbytes / n


def _collective_worker(rank: int, world: int, port: int, backend: str, sizes, queue, device_args=None) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    threads = device_args["threads"] if device_args else 1
    torch.set_num_threads(threads)
    dist.init_process_group(backend, rank=rank, world_size=world)
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    measured = None
    if device_args:  # every rank measures at once: what each rank of a `world`-process run gets of the machine
        dist.barrier()
        measured = _measure_device(device, device_args["dtypes"], device_args["shapes"], threads,
                                   f"cpu ({threads} thread{'s' if threads > 1 else ''} x {world} processes)",
                                   together=_together)
        dist.barrier()
    group = Group("calibrate", list(range(world)), dist.group.WORLD, global_rank=rank)
    results = []
    for op in COLLECTIVE_OPS:
        for nbytes in sizes:
            numel = max(world, nbytes // 4 // world * world)
            x = torch.ones(numel, device=device)
            out = torch.empty(numel // world, device=device)
            gathered = [torch.empty_like(out) for _ in range(world)]

            def call():
                if op == "all_reduce":
                    dist.all_reduce(x)
                elif op == "all_gather":
                    dist.all_gather(gathered, out)
                elif op == "reduce_scatter":  # tensorpar's own (on gloo: all-to-all + local sum)
                    group.reduce_scatter_async(out, x).wait()
                elif op == "all_to_all":  # a fresh receive buffer per call, as Group.all_to_all makes
                    dist.all_to_all_single(torch.empty_like(x), x)
                elif rank == 0:
                    dist.send(x, 1)
                elif rank == 1:
                    dist.recv(x, 0)

            reps = 20 if nbytes <= (1 << 20) else 5  # the same on every rank: each call is a collective
            call()
            samples = []
            for _ in range(3):
                dist.barrier()
                t0 = time.perf_counter()
                for _ in range(reps):
                    call()
                _sync(device)
                samples.append((time.perf_counter() - t0) / reps)
            results.append({"op": op, "bytes": numel * 4, "ranks": world, "seconds": min(samples)})
    if rank == 0:
        queue.put((results, measured))
    dist.destroy_process_group()


def measure_collectives(world: int, backend: str, sizes=COLLECTIVE_SIZES, device_args=None):
    """(collective timings, and with `device_args` rank 0's device measurement taken while every rank measured)."""
    if world < 2:
        return [], None
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with __import__("socket").socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [ctx.Process(target=_collective_worker, args=(r, world, port, backend, sizes, queue, device_args))
             for r in range(world)]
    for p in procs:
        p.start()
    results = queue.get(timeout=600)
    for p in procs:
        p.join()
    return results


_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp8": FP8}


def _measure_device(dev, dtypes, shapes, units: int, name: str, together=None, sustain_s: float = 0.0) -> dict:
    """GEMMs, bandwidth, attention and the fitted curve of one device (or one rank's share of a CPU, measured by
    every rank in step: `together`); with `sustain_s`, each dtype's best shape run back to back for that long."""
    hbm = measure_bandwidth(dev, (1 << 30) if dev.type == "cuda" else (64 << 20), together)
    out = {"name": name, "units": units, "hbm_bandwidth": hbm, "gemms": {}, "peak_flops": {}, "curves": {}}
    for dt in dtypes:
        points = measure_gemms(dev, _DTYPES[dt], shapes, together)
        peak = max(p["flops_per_s"] for p in points)
        curve = fit_curve(f"calibrated {name}", points, peak, hbm, units, dt)
        out["gemms"][dt] = points
        out["peak_flops"][dt] = peak
        out["curves"][dt] = {f.name: getattr(curve, f.name) for f in dataclasses.fields(curve)
                             if f.name not in ("name", "gemm_efficiency", "source", "attention_efficiency")}
        out["curves"][dt]["gemm_efficiency"] = curve.efficiency(dt)
        if dt != "fp8":  # fp8 linears run their attention in bf16: it is measured there
            out["curves"][dt]["attention_efficiency"] = list(measure_attention(dev, _DTYPES[dt], peak, together))
        if sustain_s > 0:
            best = max(points, key=lambda p: p["flops_per_s"])
            shape = (best["m"], best["n"], best["k"])
            out.setdefault("sustained", {})[dt] = measure_sustained(dev, _DTYPES[dt], shape, sustain_s,
                                                                    best["flops_per_s"])
    out.update(measure_host(dev, lambda fn: _time(fn, dev, together=together), hbm))
    return out


def fp8_supported(dev) -> bool:
    """Whether this device runs e4m3 fp8 GEMMs (``torch._scaled_mm``): an NVIDIA GPU of compute capability 8.9
    (Ada) or newer, or a CPU (PyTorch's reference kernel: slow, for checking). ROCm reports its own capability
    numbers, and its MI300 fp8 is another format (e4m3fnuz): not measured here."""
    if not hasattr(torch, "_scaled_mm"):
        return False
    if dev.type == "cpu":
        return True
    return dev.type == "cuda" and torch.version.hip is None and torch.cuda.get_device_capability(dev) >= (8, 9)


def calibrate(device: str = "cpu", *, ranks: int = 2, dtypes=None, shapes=None, collective_sizes=COLLECTIVE_SIZES,
              measure_comm: bool = True, threads: int | None = None, sustain_s: float = 0.0) -> dict:
    """Measure this machine: GEMMs, bandwidth, collectives, and the fitted curve and link (a JSON-able dict).

    On CPU with collectives over `ranks` > 1 processes, the GEMMs and the bandwidth are measured in every one of
    them at once (`threads` each): the share of the cores and the memory bus a rank of such a run gets. With
    `sustain_s` > 0 (one device only), each dtype's best GEMM also runs back to back for that many seconds
    (`measure_sustained`), and `load_profile` scales that dtype's level by the rate it kept."""
    if device not in ("cpu", "cuda"):
        raise TensorparError(f"--device must be cpu or cuda, got {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise TensorparError("--device cuda: no CUDA device is visible")
    if sustain_s < 0:
        raise TensorparError(f"--sustain must be 0 or more seconds, got {sustain_s}")
    dev = torch.device("cuda", 0) if device == "cuda" else torch.device("cpu")
    if dtypes is None:
        dtypes = ("bf16", "fp32") + (("fp8",) if fp8_supported(dev) else ()) if device == "cuda" else ("fp32", "bf16")
    unknown = [dt for dt in dtypes if dt not in _DTYPES]
    if unknown:
        raise TensorparError(f"unknown dtype(s) {', '.join(unknown)} to calibrate; known: {', '.join(_DTYPES)}")
    if "fp8" in dtypes and not fp8_supported(dev):
        where = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "this CPU"
        raise TensorparError(f"fp8 GEMMs cannot be measured on {where}: torch._scaled_mm in e4m3 needs an NVIDIA "
                             f"GPU of compute capability 8.9 or newer (or a PyTorch whose CPU build has it)")
    if all(dt == "fp8" for dt in dtypes):
        raise TensorparError("calibrate fp8 together with bf16 (--dtypes bf16,fp8): attention and the other "
                             "non-linear work of an fp8 run run in bf16")
    shapes = shapes or (CUDA_SHAPES if device == "cuda" else CPU_SHAPES)
    threads = threads or torch.get_num_threads()
    memory = torch.cuda.get_device_properties(dev).total_memory if device == "cuda" else os.sysconf("SC_PAGE_SIZE") * \
        os.sysconf("SC_PHYS_PAGES")
    concurrent = device == "cpu" and measure_comm and ranks > 1
    if concurrent and sustain_s:
        raise TensorparError("--sustain measures one process: add --no-collectives or --ranks 1")
    measured = None
    if measure_comm:
        backend = "nccl" if device == "cuda" else "gloo"
        world = min(ranks, torch.cuda.device_count()) if device == "cuda" else ranks
        args = {"threads": threads, "dtypes": dtypes, "shapes": shapes} if concurrent else None
        colls, measured = measure_collectives(world, backend, collective_sizes, args)
    if measured is None:
        units = torch.cuda.get_device_properties(dev).multi_processor_count if device == "cuda" else threads
        name = torch.cuda.get_device_name(dev) if device == "cuda" else f"cpu ({threads} threads)"
        measured = _measure_device(dev, dtypes, shapes, units, name, sustain_s=sustain_s)
    library = "nccl" if device == "cuda" else "gloo"
    profile = {"device": device, "memory_bytes": memory, "collectives_library": library, **measured}
    if measure_comm:
        profile["collectives"] = colls
        if colls:
            samples = [(*_steps_and_bytes(c["op"], c["bytes"], c["ranks"]), c["seconds"]) for c in colls]
            link = _fit_link(samples)
            profile["link"] = {"bandwidth": link.bandwidth, "latency": link.latency}
    return profile


def load_profile(path: str) -> tuple[GPUSpec, DeviceCurve]:
    """(GPUSpec, DeviceCurve) of a `tensorpar calibrate` profile: peaks are the best measured rates, so MFU is
    reported against what the device reached, and the links are the fitted alpha-beta (intra and inter alike)."""
    try:
        with open(path) as f:
            prof = json.load(f)
    except FileNotFoundError:
        raise TensorparError(f"hardware profile '{path}' does not exist (write one with 'tensorpar calibrate "
                             f"--out {path}')") from None
    except json.JSONDecodeError as e:
        raise TensorparError(f"hardware profile '{path}' is not JSON: {e}") from None
    missing = [k for k in ("peak_flops", "hbm_bandwidth", "curves", "memory_bytes") if k not in prof]
    if missing:
        raise TensorparError(f"hardware profile '{path}' lacks {', '.join(missing)}: not a tensorpar calibrate output")
    link = Link(**prof["link"]) if "link" in prof else Link(10e9, 20e-6)
    peaks = dict(prof["peak_flops"])
    # each measured dtype's fitted level of its peak (profiles written before it was fitted: 1, the best rate)
    efficiency = {dt: float(prof["curves"].get(dt, {}).get("gemm_efficiency", 1.0)) for dt in peaks}
    for dt, run in prof.get("sustained", {}).items():  # the share of the short-run rate kept under sustained load
        if dt in efficiency:
            efficiency[dt] *= min(1.0, float(run["ratio"]))
    stand_ins = {}
    for alias, src in (("bf16", "fp32"), ("fp32", "bf16"), ("tf32", "fp32"), ("fp8", "bf16")):
        if alias not in peaks and src in peaks:  # an unmeasured dtype runs at another's peak and level
            peaks[alias], efficiency[alias] = peaks[src], efficiency[src]
            stand_ins[alias] = stand_ins.get(src, src)
    library = prof.get("collectives_library", "gloo" if prof.get("device") == "cpu" else "nccl")
    spec = GPUSpec(f"calibrated:{prof.get('name', path)}", int(prof["memory_bytes"]), peaks,
                   float(prof["hbm_bandwidth"]), link, link, f"tensorpar calibrate ({path})", library,
                   peak_stand_ins=stand_ins, **_host_fields(prof))
    # the curve's shape from the first dtype measured (fp32 on CPU, bf16 on GPUs), never fp8's (no attention there)
    fields = dict(next(c for dt, c in prof["curves"].items() if dt != "fp8"))
    if "attention_efficiency" in fields:
        fields["attention_efficiency"] = tuple(fields["attention_efficiency"])
    fields.pop("gemm_efficiency", None)
    curve = DeviceCurve(f"calibrated:{prof.get('name', path)}", efficiency, **fields)
    return spec, curve


def _host_fields(prof: dict) -> dict:
    """The GPUSpec's host figures from a profile: the link each way as measured (the slower of the two in a
    profile that kept only that). One written before they were measured: a GPU's link is PCIe 5.0
    as copies reach it (the catalog's nominal figure x its default efficiency: `plan --hardware` takes a profile's
    links as measured), its host AdamW the catalog's; a CPU's copies stay within its memory (half the copy bandwidth
    counted both ways) and it steps an offloaded optimizer as fast as its own."""
    out = {}
    if "host_link" in prof:
        link = prof["host_link"]
        out["host_link"] = Link(float(link.get("device_to_host", link["bandwidth"])), float(link["latency"]))
        out["host_link_back"] = Link(float(link.get("host_to_device", link["bandwidth"])), float(link["latency"]))
    elif prof.get("device") == "cpu":
        out["host_link"] = Link(float(prof["hbm_bandwidth"]) / 2, HOST_LINK_LATENCY_S)
    else:
        nominal = GPUSpec.host_link
        out["host_link"] = Link(nominal.bandwidth * DEFAULT_LINK_EFFICIENCY, nominal.latency)
    if "host_optimizer_bandwidth" in prof:
        out["host_optimizer_bandwidth"] = float(prof["host_optimizer_bandwidth"])
    elif prof.get("device") == "cpu":
        out["host_optimizer_bandwidth"] = float(prof["hbm_bandwidth"])
    return out
