"""`tensorpar plan`: which layout should I use on my cluster? (the Playbook's closing question)

Layout mode (the default)::

    tensorpar plan --model llama-8b --gpus 16 --gpu h100-80gb --seq-len 4096 --global-batch-size 256
                   [--top K] [--json] [--png PATH] [--precision tensorpar-bf16|tensorpar-fp16|
                   tensorpar-bf16-autocast|tensorpar-fp32|mixed-bf16|megatron-bf16] [--gpus-per-node 8] [--intra-bandwidth GB/s] [--inter-bandwidth GB/s]
                   [--intra-latency us] [--inter-latency us] [--memory-gib G] [--peak-tflops T]
                   [--mfu-ceiling F] [--overlap F] [--tp T] [--pp P] [--ep E] [--virtual-stages V]
                   [--zero 0 1 ..] [--recompute none ..] [--sequence-parallel both|on|off]

searches every tp x pp x dp x micro-batch x SP x recomputation x ZeRO layout (x ep for a
mixture-of-experts model: every size dividing num_experts and tp x cp x dp, or ``--ep E``)
(`tensorpar.planning.search`), prints the feasible ones ranked by predicted tokens/s with the
per-GPU memory breakdown, step time and MFU, and why the others fail. ``--png PATH`` writes the
memory breakdown of the top layouts (stacked bars) to PATH and the Playbook-style heatmap (tp x
pp, coloured by the best tokens/s) next to it (``PATH-heatmap.png``). No processes are started.

Schedule mode (``--schedule afab|1f1b|interleaved|zb-h1|zbv --pp P --microbatches M [--virtual-stages V]``)
draws a pipeline schedule instead (`run_schedule_command`, below).
"""

from __future__ import annotations

import json
import os
import re
import sys
from collections import Counter

from tensorpar.config import applicability
from tensorpar.config.choices import PLANNED_SCHEDULES
from tensorpar.config.fields import add_options, options_from_args
from tensorpar.config.hardware import GiB
from tensorpar.config.memory_levers import MemoryLevers
from tensorpar.config.options import PlanOptions
from tensorpar.errors import TensorparError
from tensorpar.layout import PipelineSplit, parse_pipeline_layers, require
from tensorpar.layout.stages import chunks_per_rank
from tensorpar.models import get_config
from tensorpar.pipeline_parallel.schedule_simulation import simulate
from tensorpar.pipeline_parallel.schedule_view import render_png, render_text as render_schedule_text
from tensorpar.pipeline_parallel.schedules import build_schedule, peak_in_flight, theoretical_bubble
from tensorpar.planning.calibration import load_profile
from tensorpar.planning.cluster import make_cluster
from tensorpar.planning.memory import MemoryBreakdown
from tensorpar.planning.precision_recipes import get_precision
from tensorpar.planning.search import best_by_mesh, search
from tensorpar.tensor_parallel.lora import LoraSpec


def _zero_label(lay) -> str:
    """The ZeRO stage, with HSDP's replica count: "3" or "3h2" (ZeRO-3 within each of 2 replicas)."""
    return f"{lay.zero}h{lay.dp_replicate}" if lay.dp_replicate > 1 else str(lay.zero)


def add_parser(sub) -> None:
    p = sub.add_parser("plan", help="rank parallel layouts for a model on a cluster (or draw a pipeline schedule)")
    add_options(p, PlanOptions, config_file=True)
    p.set_defaults(run=run)


def run(args, argv=None) -> int:
    options = options_from_args(PlanOptions, args, "plan")
    if options.schedule and options.model is None:
        missing = [f for f, v in (("--pp", options.pp), ("--microbatches", options.microbatches)) if v is None]
        if missing:
            raise TensorparError(f"--schedule {options.schedule} needs {' and '.join(missing)}")
        applicability.check("plan", options)  # the options of layout mode, which draws no schedule
        return run_schedule_command(options)
    return run_layouts(options)


# --------------------------------------------------------------------------- layout mode


def _cluster(options):
    gb, us = 1e9, 1e-6
    gpu, curve, link_eff = options.gpu, None, options.link_efficiency
    if options.hardware is not None:  # a calibrated profile: its measured peaks, curve and (already real) links
        gpu, curve = load_profile(options.hardware)
        link_eff = 1.0 if link_eff is None else link_eff
    return make_cluster(
        gpu, options.gpus, gpus_per_node=options.gpus_per_node, memory_gib=options.memory_gib, curve=curve,
        link_efficiency=link_eff, tp_overlap=options.tp_overlap, pp_overlap=options.pp_overlap,
        intra_bandwidth=_scaled(options.intra_bandwidth, gb),
        inter_bandwidth=_scaled(options.inter_bandwidth, gb),
        intra_latency=_scaled(options.intra_latency, us),
        inter_latency=_scaled(options.inter_latency, us),
        peak_bf16=_scaled(options.peak_tflops, 1e12),
        mfu_ceiling=options.mfu_ceiling, overlap=options.overlap, host_memory_gib=options.host_memory_gib,
        host_link_bandwidth=_scaled(options.host_link_bandwidth, gb),
        host_link_back_bandwidth=_scaled(options.host_link_back_bandwidth, gb),
        host_optimizer_bandwidth=_scaled(options.host_optimizer_bandwidth, gb),
    )


def _scaled(value: float | None, unit: float) -> float | None:
    return None if value is None else value * unit


def _check_args(options) -> None:
    gpu = options.gpu if options.hardware is None else options.hardware
    missing = [flag for flag, value in (("--model", options.model), ("--gpus", options.gpus), ("--gpu", gpu),
                                        ("--seq-len", options.seq_len), ("--global-batch-size", options.global_batch_size))
               if value is None]
    if missing:
        raise TensorparError(f"plan needs {', '.join(missing)} (or --schedule NAME --pp P --microbatches M "
                             f"to draw a pipeline schedule)")
    for flag, value in (("--gpus", options.gpus), ("--seq-len", options.seq_len),
                        ("--global-batch-size", options.global_batch_size), ("--gpus-per-node", options.gpus_per_node),
                        ("--virtual-stages", options.virtual_stages), ("--max-micro-batch", options.max_micro_batch)):
        if value < 1:
            raise TensorparError(f"{flag} must be a positive integer, got {value}")
    for flag, value in (("--host-link-bandwidth", options.host_link_bandwidth),
                        ("--host-link-back-bandwidth", options.host_link_back_bandwidth),
                        ("--host-optimizer-bandwidth", options.host_optimizer_bandwidth)):
        if value is not None and not value > 0:
            raise TensorparError(f"{flag} must be a positive number of GB/s, got {value}")
    for flag, value, unit in (("--peak-tflops", options.peak_tflops, "TFLOP/s"),
                              ("--memory-gib", options.memory_gib, "GiB"),
                              ("--host-memory-gib", options.host_memory_gib, "GiB")):
        if value is not None and not 0 < value < float("inf"):
            raise TensorparError(f"{flag} must be a positive number of {unit}, got {value}")
    if options.top is not None and options.top < 1:
        raise TensorparError(f"--top must be a positive integer, got {options.top}")
    for flag, value in (("--tp", options.tp), ("--pp", options.pp), *(("--cp", c) for c in options.cp)):
        if value is not None and (value < 1 or options.gpus % value):
            raise TensorparError(f"{flag} {value} does not divide the {options.gpus} GPUs")


def _check_ep(cfg, options) -> None:
    """--ep must name an expert-parallel size some layout can use: one dividing num_experts and the GPUs."""
    if options.ep is None:
        return
    if not cfg.is_moe:
        if options.ep != 1:
            raise TensorparError(f"--ep {options.ep} needs a mixture-of-experts model; '{options.model}' is dense "
                                 f"(leave --ep out, or use 1)")
        return
    valid = [e for e in range(1, cfg.num_experts + 1) if cfg.num_experts % e == 0 and options.gpus % e == 0]
    if options.ep not in valid:
        raise TensorparError(f"--ep {options.ep} does not divide both the {cfg.num_experts} experts of "
                             f"'{options.model}' and the {options.gpus} GPUs: each EP rank holds num_experts / ep "
                             f"experts and EP folds onto the tp x cp x dp ranks; valid: {valid}")


def plan_layouts(options):
    """(config, cluster, ranked plans) for parsed layout-mode arguments."""
    _check_args(options)
    applicability.check("plan", options)
    cfg = get_config(options.model)
    _check_ep(cfg, options)
    cluster = _cluster(options)
    space = {"virtual_stages": tuple(range(1, options.virtual_stages + 1)), "max_micro_batch": options.max_micro_batch,
             "zero": tuple(options.zero), "recompute": tuple(options.recompute), "cp": tuple(options.cp),
             "sequence_parallel": {"both": (False, True), "on": (True,), "off": (False,)}[options.sequence_parallel]}
    if options.tp is not None:
        space["tp"] = (options.tp,)
    if options.pp is not None:
        space["pp"] = (options.pp,)
    if options.ep is not None:
        space["ep"] = (options.ep,)
    if options.schedule is not None:  # layout mode: plan this schedule only
        if options.schedule not in PLANNED_SCHEDULES:
            raise TensorparError(f"plan --schedule {options.schedule}: the planner models {', '.join(PLANNED_SCHEDULES)}")
        space["schedules"] = (options.schedule,)
        if options.schedule == "interleaved" and options.virtual_stages < 2:
            space["virtual_stages"] = (2,)
    else:
        space["schedules"] = PLANNED_SCHEDULES
    if options.pipeline_layers is not None:
        split = parse_pipeline_layers(options.pipeline_layers)
        if options.pp is not None and options.pp != len(split):
            raise TensorparError(f"--pipeline-layers {options.pipeline_layers} has {len(split)} entries but --pp is "
                                 f"{options.pp}")
        require(PipelineSplit(cfg.num_layers, len(split), counts=split).problem())  # refused here, not per layout
        space["pipeline_layers"] = tuple(split)
    levers = MemoryLevers.of(options)
    for problem in levers.problems(num_layers=cfg.num_layers):  # the layout's problems are each candidate's
        raise TensorparError(problem)
    plans = search(cfg, cluster, options.seq_len, options.global_batch_size, options.precision,
                   flash_attention=options.flash_attention, levers=levers,
                   lora=LoraSpec.of_options(options), fit_offload=options.activation_offload_fit, **space)
    return cfg, cluster, plans


def run_layouts(options) -> int:
    cfg, cluster, plans = plan_layouts(options)
    feasible = [p for p in plans if p.feasible]
    infeasible = [p for p in plans if not p.feasible]
    top = options.top if options.top is not None else (None if options.json else 10)
    shown = feasible if top is None else feasible[:top]
    shown_bad = infeasible if top is None else infeasible[:top]
    pngs = []
    if options.png:
        pngs = write_pngs(plans, cluster, options.png, f"{options.model} on {options.gpus} x {cluster.gpu.name}, "
                          f"seq {options.seq_len}, batch {options.global_batch_size}", top or 10)
    if options.json:
        print(json.dumps([p.to_dict() for p in shown + shown_bad], indent=None))
        return 0
    print(render_text(cfg, cluster, plans, options, shown))
    for path in pngs:
        print(f"wrote {path}")
    return 0


def _reason_kind(reason: str) -> str:
    if reason.startswith("exceeds memory"):
        return "exceed the GPU memory"
    return re.sub(r"\d+", "N", reason.split(":")[0].split(" (")[0])


def render_text(cfg, cluster, plans, options, shown) -> str:
    feasible = [p for p in plans if p.feasible]
    infeasible = [p for p in plans if not p.feasible]
    lines = _summary_lines(cfg, cluster, plans, options)
    if shown:
        lines += _table_lines(shown, moe=cfg.is_moe, levers=MemoryLevers.of(options))
    else:
        lines.append("no layout fits: see the reasons below")
    if infeasible:
        lines.append("")
        lines += _infeasible_lines(infeasible, any_feasible=bool(feasible))
    return "\n".join(lines)


def _summary_lines(cfg, cluster, plans, options) -> list[str]:
    """The heading: the model and cluster, the batch, precision and compute model, and the search's counts."""
    num_feasible = sum(1 for p in plans if p.feasible)
    prec = get_precision(options.precision)
    tokens = options.global_batch_size * options.seq_len
    compute_model = (f"flat MFU ceiling {cluster.mfu_ceiling:.2f}" if cluster.mfu_ceiling is not None else
                     f"GEMMs by shape on the {cluster.curve.name} curve")
    n = cfg.num_parameters()
    size = f"{n / 1e9:.2f}B parameters" if n >= 1e9 else f"{n / 1e6:.2f}M parameters"
    if cfg.is_moe:
        size += (f", {cfg.num_parameters(active=True) / 1e9:.2f}B active: {cfg.num_experts} experts, "
                 f"top-{cfg.experts_per_token}")
    extra = []
    if cfg.is_mla:
        extra.append(f"latent attention (its KV cache: kv_lora_rank + qk_rope_head_dim = "
                     f"{cfg.kv_lora_rank + cfg.qk_rope_head_dim} values a token and layer)")
    if cfg.num_mtp_layers:
        extra.append(f"{cfg.num_mtp_layers} multi-token prediction module(s) on the last stage")
    lora = LoraSpec.of_options(options)
    if lora is not None:
        extra.append(f"LoRA rank {lora.rank} on {','.join(lora.targets)}: the base frozen, the adapters trained")
    return [
        f"plan: {options.model} ({size}) on {cluster.describe()}",
        *([f"      {', '.join(extra)}"] if extra else []),
        f"      seq {options.seq_len}, global batch {options.global_batch_size} ({tokens:,} tokens/step), "
        f"precision {prec.name}, peak {cluster.peak(prec.compute_dtype) / 1e12:.3g} TFLOP/s "
        f"({_peak_label(cluster.gpu, prec.compute_dtype)}), {compute_model}, DP overlap {cluster.overlap:.2f}",
        f"searched {len(plans)} layouts: {num_feasible} feasible, {len(plans) - num_feasible} infeasible",
        "",
    ]


def _peak_label(gpu, dtype: str) -> str:
    """The dtype of the header's peak, and the measured dtype whose rate it takes where the profile lacks it."""
    stand_in = gpu.peak_stand_ins.get(dtype)
    return f"{dtype}: {stand_in}'s measured rate, {dtype} not calibrated" if stand_in else dtype


def _table_lines(shown, moe: bool, levers: MemoryLevers = MemoryLevers()) -> list[str]:
    """The ranked table of the shown layouts (with the ep and all-to-all columns for a mixture-of-experts model, the
    exposed copies' column under --activation-offload) and its footnotes."""
    offload = levers.activation_offload
    ep_head = f" {'ep':>3}" if moe else ""
    exposed_head = (f" {'a2a':>5}" if moe else "") + (f" {'offl':>5}" if offload else "")
    head = (f"{'#':>3} {'tp':>3} {'cp':>3}{ep_head} {'pp':>3} {'dp':>4} {'v':>2} {'schedule':>11} {'mbs':>4} {'sp':>3} "
            f"{'recompute':>9} {'zero':>4} |"
            f" {'params':>6} {'grads':>6} {'optim':>6} {'activ':>6} {'copies':>6} {'other':>6} {'total':>6} GiB |"
            f" {'step s':>7} {'tokens/s':>10} {'MFU':>6} | {'tp+cp':>5} {'pp+bub':>6} {'dp':>5}"
            f"{exposed_head} exposed")
    lines = [head] + [_table_row(i, p, moe, offload) for i, p in enumerate(shown, 1)]
    lines.append("v: model chunks per pipeline rank (--virtual-stages; zbv runs 2); memory per GPU of the most loaded "
                 "pipeline stage; 'copies': bf16 weight copies kept by autocast (fp8: the fp8 weight caches); 'other': "
                 "recomputation/ZeRO-3 working set + 1.5 GiB + 5% margin")
    lines += _uneven_stage_lines(shown)
    if shown and shown[0].lora is not None:
        mem = shown[0].memory.gib()
        lines.append(f"LoRA: 'params' holds the frozen base ({mem['frozen']:.1f} GiB in layout 1) and the adapters "
                     f"({mem['parameters']:.2f} GiB), which alone have gradients and optimizer states")
    if moe:
        lines.append("MoE: ep expert-parallel ranks (expert-DP = tp x cp x dp / ep); 'a2a': the expert all-to-alls; "
                     "FLOPs and MFU count the active parameters (balanced routing assumed)")
    if shown and shown[0].memory.host_gib()["total"] > 0:
        host, t = shown[0].memory.host_gib(), shown[0].time
        costs = ([f"the optimizer's step on the host {t.optimizer_s:.2f} s"] if levers.optimizer_offload else []) + (
            [f"the activations' exposed copies {t.offload_s:.2f} s ('offl': the copies to and from host memory that "
             f"compute does not hide)"] if offload else [])
        lines.append(f"host memory per GPU of layout 1 (offloaded): optimizer {host['optimizer']:.1f} GiB, activations "
                     f"{host['activations']:.1f} GiB; of its {t.step_time_s:.2f} s step, {' and '.join(costs)}")
    lines += _offload_fit_lines(shown)
    return lines


def _offload_fit_lines(shown) -> list[str]:
    """Under --activation-offload-fit: the layers each shown layout moves, as `tensorpar train` takes them."""
    if not shown or shown[0].levers is None:
        return []
    moves = {}
    for i, p in enumerate(shown, 1):
        n = p.offloaded_layers
        flag = ("no --activation-offload" if n == 0 else "--activation-offload" if n is None
                else f"--activation-offload --activation-offload-layers {n}")
        moves.setdefault(flag, []).append(f"#{i}")
    return [f"fewest layers offloaded to fit: {', '.join(rows)} train with {flag}" for flag, rows in moves.items()]


def _uneven_stage_lines(shown) -> list[str]:
    """The layer counts of the shown layouts whose stages are uneven: `tensorpar train` needs them as
    --pipeline-layers (without it, a pp x v that does not divide the layers is refused)."""
    by_split: dict[tuple, list[str]] = {}
    for i, p in enumerate(shown, 1):
        if p.candidate.pipeline_layers is not None:
            by_split.setdefault(tuple(p.candidate.pipeline_layers), []).append(f"#{i}")
    return [f"uneven stages: {', '.join(rows)} train with --pipeline-layers {','.join(map(str, split))}"
            for split, rows in by_split.items()]


def _table_row(i: int, p, moe: bool, offload: bool = False) -> str:
    """Row `i` of the table: plan `p`'s layout, memory in GiB, step time and the exposed communication shares."""
    lay, mem, t = p.candidate, p.memory.gib(), p.time
    other = mem["transient"] + mem["overhead"]
    pct = lambda x: f"{100 * x / t.step_time_s:4.1f}%"  # noqa: E731
    return (
        f"{i:>3} {lay.tp:>3} {lay.cp:>3}{f' {lay.ep:>3}' if moe else ''} {lay.pp:>3} {lay.dp:>4} "
        f"{lay.chunks:>2} {(lay.schedule if lay.pp > 1 else '-'):>11} {lay.micro_batch_size:>4} "
        f"{'on' if lay.sequence_parallel else 'off':>3} {lay.recompute:>9} {_zero_label(lay):>4} |"
        f" {mem['parameters'] + mem['frozen']:6.1f} {mem['gradients']:6.1f} {mem['optimizer']:6.1f} {mem['activations']:6.1f}"
        f" {mem['weight_copies']:6.1f} {other:6.1f} {mem['total']:6.1f}     |"
        f" {t.step_time_s:7.2f} {t.tokens_per_s:10,.0f} {100 * t.mfu:5.1f}% |"
        f" {pct(t.tp_comm_s + t.cp_comm_s)} {pct(t.pp_comm_s + t.bubble_s):>6} {pct(t.dp_comm_s)}"
        + (f" {pct(t.ep_comm_s)}" if moe else "") + (f" {pct(t.offload_s)}" if offload else "")
    )


def _infeasible_lines(infeasible, any_feasible: bool) -> list[str]:
    """The infeasible layouts counted by kind of reason, one example each, and (when nothing fits) the three
    closest to fitting."""
    lines = [f"infeasible ({len(infeasible)}):"]
    kinds = Counter(_reason_kind(p.reason) for p in infeasible)
    examples = {}
    for p in infeasible:
        examples.setdefault(_reason_kind(p.reason), p)
    for kind, n in kinds.most_common():
        ex = examples[kind]
        # a kind is its reason with the numbers taken out: where that is all it says, the example says it better
        head = f"{kind}; e.g." if kind == "exceed the GPU memory" else "like"
        lines.append(f"  {n:>5} {head} {ex.candidate.label()}: {ex.reason}")
    close = [p for p in infeasible if p.memory is not None][:3]
    if close and not any_feasible:
        lines.append("  closest to fitting: " + "; ".join(
            f"{p.candidate.label()} needs {p.memory.total / GiB:.1f} GiB" for p in close))
    return lines


# --------------------------------------------------------------------------- pictures


_RC = {"none": "no recompute", "selective": "selective", "full": "full recompute"}


def write_pngs(plans, cluster, path: str, title: str, top: int = 10) -> list[str]:
    """The memory breakdown of the `top` best layouts (PATH) and the tp x pp heatmap (PATH-heatmap.png)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise TensorparError("--png needs matplotlib (pip install matplotlib)") from None
    directory = os.path.dirname(path)
    if directory:
        os.makedirs(directory, exist_ok=True)
    _write_memory_bars(plt, plans, cluster, path, title, top)
    root, ext = os.path.splitext(path)
    heat = f"{root}-heatmap{ext or '.png'}"
    _write_heatmap(plt, plans, heat, title)
    return [path, heat]


def _write_memory_bars(plt, plans, cluster, path: str, title: str, top: int) -> None:
    """Write to `path` the stacked per-GPU memory bars of the `top` best feasible layouts (20 at most), with the
    GPU's memory as a dashed line."""
    feasible = [p for p in plans if p.feasible][: max(1, min(top, 20))]
    fig, ax = plt.subplots(figsize=(max(6, 0.9 * len(feasible) + 3), 5))
    if feasible:
        labels = [f"#{i}\ntp{p.candidate.tp} pp{p.candidate.pp}\n"
                  f"dp{p.candidate.dp}{f' ep{p.candidate.ep}' if p.candidate.ep > 1 else ''} z{p.candidate.zero}\n"
                  f"{_RC[p.candidate.recompute]}{' sp' if p.candidate.sequence_parallel else ''} mb{p.candidate.micro_batch_size}"
                  for i, p in enumerate(feasible, 1)]
        bottom = [0.0] * len(feasible)
        for comp in MemoryBreakdown.COMPONENTS:
            vals = [getattr(p.memory, comp) / GiB for p in feasible]
            if any(vals):
                ax.bar(range(len(feasible)), vals, bottom=bottom, label=comp.replace("_", " "))
                bottom = [b + v for b, v in zip(bottom, vals)]
        ax.axhline(cluster.memory_bytes / GiB, color="k", ls="--", lw=1, label=f"{cluster.gpu.name} memory")
        ax.set_xticks(range(len(feasible)), labels, fontsize=7)
        ax.legend(fontsize=7, loc="upper right")
    else:
        ax.text(0.5, 0.5, "no feasible layout", ha="center", va="center", transform=ax.transAxes)
    ax.set_ylabel("GiB per GPU")
    ax.set_title(f"memory of the best layouts (ranked by tokens/s)\n{title}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _write_heatmap(plt, plans, path: str, title: str) -> None:
    """Write to `path` the Playbook-style tp x pp heatmap: each cell coloured by its best layout's tokens/s and
    labelled with it, or with why no layout of that mesh works."""
    best = best_by_mesh(plans)
    tps = sorted({p.candidate.tp for p in plans})
    pps = sorted({p.candidate.pp for p in plans})
    tried = {(p.candidate.tp, p.candidate.pp): p for p in plans}
    grid = [[best[(t, q)].time.tokens_per_s if (t, q) in best else float("nan") for q in pps] for t in tps]
    fig, ax = plt.subplots(figsize=(max(5, 1.3 * len(pps) + 2), max(3.5, 0.9 * len(tps) + 1.5)))
    im = ax.imshow(grid, cmap="viridis", aspect="auto", origin="lower")
    rates = [p.time.tokens_per_s for p in best.values()] or [0.0]
    lo, hi = min(rates), max(rates)
    for i, t in enumerate(tps):
        for j, q in enumerate(pps):
            p = best.get((t, q))
            bright = p is not None and p.time.tokens_per_s > lo + 0.6 * (hi - lo)
            colour = "w" if p is not None and not bright else "k"
            ax.text(j, i, _heatmap_cell(p, tried.get((t, q))), ha="center", va="center", fontsize=6, color=colour)
    ax.set_xticks(range(len(pps)), [str(q) for q in pps])
    ax.set_yticks(range(len(tps)), [str(t) for t in tps])
    ax.set_xlabel("pipeline parallel (pp)")
    ax.set_ylabel("tensor parallel (tp)")
    ax.set_title(f"best predicted tokens/s per (tp, pp)\n{title}", fontsize=9)
    fig.colorbar(im, ax=ax, label="tokens/s")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _heatmap_cell(best, tried) -> str:
    """A heatmap cell's text: the best plan's tokens/s, MFU and layout, or why the mesh failed ('-': not tried)."""
    if best is None:
        return "-" if tried is None else ("no fit" if tried.memory is not None else "cannot\nsplit")
    lay = best.candidate
    return (f"{best.time.tokens_per_s:,.0f}\nMFU {100 * best.time.mfu:.0f}%\ndp{lay.dp}"
            f"{f' ep{lay.ep}' if lay.ep > 1 else ''} "
            f"mb{lay.micro_batch_size} z{lay.zero}\n{_RC[lay.recompute]}"
            f"{' sp' if lay.sequence_parallel else ''}")


# --------------------------------------------------------------------------- schedule mode


def run_schedule_command(options) -> int:
    """`tensorpar plan --schedule NAME --pp P --microbatches M [--virtual-stages V] [--png PATH]
    [--json]`: simulate the schedule, print its picture and bubble (or one JSON object), and write
    the Gantt chart (default ``runs/schedule-NAME-ppP-mM.png``; with --json its path is the
    "png" key instead of a printed line).

    Times: a microbatch's forward through one rank's whole share of the model takes 1, its backward
    2; an interleaved chunk holds 1/v of that share, so its actions take 1/v and 2/v. Makespans of
    different schedules for the same model are then comparable."""
    name = str(options.schedule).lower()
    pp, m = options.pp, options.microbatches
    v = chunks_per_rank(name, getattr(options, "virtual_stages", None) or 1)  # zbv: always 2 (a V)
    schedule = build_schedule(name, pp, m, v)
    tl = simulate(schedule, forward_time=1.0 / v, backward_time=2.0 / v, name=name)
    theory = theoretical_bubble(name, pp, m, v)
    peaks = peak_in_flight(schedule)
    path = getattr(options, "png", None) or os.path.join("runs", f"schedule-{name}-pp{pp}-m{m}.png")
    title = f"{name} pipeline schedule, pp={pp}, microbatches={m}" + (f", virtual stages={v}" if v > 1 else "")
    try:
        png = render_png(tl, path, title)
    except TensorparError as e:  # no matplotlib: the text picture still stands
        png = None
        sys.stderr.write(f"tensorpar: note: no PNG written: {e}\n")
    if getattr(options, "json", False):
        print(json.dumps({
            "schedule": name, "pp": pp, "microbatches": m, "virtual_stages": v,
            "bubble_fraction": tl.bubble_fraction, "theoretical_bubble": theory,
            "peak_in_flight": peaks, "makespan": tl.makespan, "png": png,
        }))
        return 0
    print(render_schedule_text(tl))
    print(f"peak activations in flight per rank (microbatch x chunk): {peaks}")
    if png:
        print(f"wrote {png}")
    return 0
