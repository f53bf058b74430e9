"""`tensorpar train`: train a preset (or a Hugging Face model) with tensor, sequence, pipeline and data parallelism.

Options: `tensorpar.config.options.TrainOptions` (flags, or ``--config run.toml`` with flags overriding
it). Outputs default to ``runs/MODEL-tpT/``: metrics.jsonl, loss.png, config.toml (the resolved
configuration), pipeline.png with --pp > 1.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys

from tensorpar.commands.common import launch
from tensorpar.commands.dry_run_report import planned_bytes, report
from tensorpar.config.fields import add_options, options_from_args
from tensorpar.config.options import TrainOptions
from tensorpar.distributed.launch import SPAWNED_ENV, under_launcher, world_size
from tensorpar.layout import ParallelLayout
from tensorpar.training import run_training, validate
from tensorpar.training.dry_run import dry_run
from tensorpar.training.stop import GracefulStop


def add_parser(sub) -> None:
    p = sub.add_parser("train", help="train a transformer (default: the tiny preset on the embedded corpus)")
    add_options(p, TrainOptions, config_file=True)
    p.set_defaults(run=run)


def with_output_defaults(options: TrainOptions) -> TrainOptions:
    """The command line writes its outputs by default: runs/MODEL-tpT/ and its metrics.jsonl (MODEL: the preset, or
    the last part of --model's or --init-from's path, a trailing slash ignored)."""
    name = os.path.basename(os.path.normpath(options.init_from or options.model))
    out_dir = options.out_dir or os.path.join("runs", f"{name}-tp{options.tp}")
    return dataclasses.replace(options, out_dir=out_dir, metrics=options.metrics or os.path.join(out_dir,
                                                                                                  "metrics.jsonl"))


def examples_line(e: dict) -> str:
    """What became of the instruction examples: how many trained, cut, left out, and how full the rows are."""
    return (f"examples: {e['examples']:,} {e['kind']}: {e['train_examples']:,} training and {e['val_examples']:,} "
            f"validation, {e['truncated']:,} truncated to --seq-len, {e['dropped_long']:,} left out as too long, "
            f"{e['dropped_empty']:,} with nothing to learn; {e['packing']} into {e['train_rows']:,} rows "
            f"({100 * e['fill']:.0f}% filled, {e['learned_tokens']:,} learned tokens)")


def print_summary(s: dict) -> None:
    resumed = f" (resumed at step {s['start_step']})" if s.get("start_step") else ""
    print(f"\ntrained{resumed} {s['model']} ({s['parameters'] / 1e6:.2f}M parameters) for {s['steps']} steps on "
          f"{s['tokens']:,} tokens: {ParallelLayout(**s['layout']).describe()}, recompute={s['recompute']}, "
          f"{s['dtype']}")
    val = f", validation {s['final_val_loss']:.4f}" if s.get("final_val_loss") is not None else ""
    print(f"loss {s['first_loss']:.4f} -> {s['final_loss']:.4f}{val}")
    if s.get("skipped_steps"):
        scale = f"; loss scale {s['final_loss_scale']:g} at the last step" if s.get("final_loss_scale") else ""
        print(f"skipped {s['skipped_steps']} of {len(s.get('history') or [])} steps (non-finite gradients: weights "
              f"left unchanged){scale}")
    print(f"{s['time_s']:.1f}s, {s['tokens_per_s']:,.0f} tokens/s, MFU {100 * s['mfu']:.1f}% "
          f"(of the {s['peak_flops_source']})")
    if s.get("lora"):
        a, share = s["lora"], s["lora"]["trainable_parameters"] / s["parameters"]
        print(f"LoRA: rank {a['rank']}, alpha {a['alpha']:g} on {','.join(a['targets'])}: "
              f"{a['trainable_parameters']:,} parameters trained ({100 * share:.2f}% of the model's), the rest frozen"
              + ("; a PEFT adapter in each checkpoint's adapter/ folder" if s.get("save") else ""))
    if s.get("examples"):
        print(examples_line(s["examples"]))
    if s.get("moe"):
        m = s["moe"]
        print(f"experts: aux loss {m['final_aux_loss']:.4f}, z-loss {m['final_z_loss']:.4f} (last step), load "
              f"imbalance {m['mean_load_imbalance']:.2f} (busiest / mean expert, mean over steps), "
              f"{m['dropped_tokens']:,} routing choices dropped")
    if s.get("mtp"):
        m = s["mtp"]
        print(f"multi-token prediction ({m['modules']} module(s), weight {m['weight']}): loss {m['first_loss']:.4f} "
              f"-> {m['final_loss']:.4f}")
    if s.get("memory_mib_per_rank") and s["memory_mib_per_rank"][0]:
        print(memory_line(s["memory_mib_per_rank"]))
    if s.get("async_save"):
        print(async_save_line(s["async_save"]))
    if s.get("loss_plot"):
        print(f"loss curve: {s['loss_plot']}")
    if s.get("config"):
        print(f"configuration: {s['config']} (tensorpar train --config takes it)")
    if s.get("pipeline_bubble") is not None:
        plot = f"; timeline: {s['pipeline_plot']}" if s.get("pipeline_plot") else ""
        print(f"pipeline bubble (measured, last step): {100 * s['pipeline_bubble']:.1f}%{plot}")
    if s.get("sample_note"):
        print(s["sample_note"])
    if s.get("sample") is not None:
        print(f"sample (greedy): {json.dumps(s['sample'])}")


def memory_line(per_rank: list[dict]) -> str:
    """Peak MiB by kind, of the rank that needs the most in all (its rank named)."""
    rank = max(range(len(per_rank)), key=lambda r: sum(v for k, v in per_rank[r].items() if k != "allocated"))
    parts = ", ".join(f"{k} {v:.1f}" for k, v in per_rank[rank].items())
    return f"peak memory of rank {rank} (MiB): {parts}"


def async_save_line(a: dict) -> str:
    """--async-save: the host memory staged, and how long the saves took in the background and in steps."""
    saves = a["saves"]
    if not saves:
        return f"async save: {a['staged_mib']:.1f} MiB staged (rank {a['staged_rank']}), no save"
    write = sum(x["write_s"] for x in saves) / len(saves)
    blocked = sum(x["stage_s"] + x["waited_s"] for x in saves) / len(saves)
    steps = sum(x["committed_after_step"] - x["step"] for x in saves) / len(saves)
    return (f"async save: {a['staged_mib']:.1f} MiB staged (rank {a['staged_rank']}); {len(saves)} saves, each "
            f"written in {write:.2f}s in the background ({steps:.1f} steps on average before its commit), "
            f"training blocked {blocked:.2f}s per save (copying, waiting)")


def report_stop(s: dict) -> None:
    saved = f"; checkpoint '{s['stop_checkpoint']}' (continue with --resume)" if s["stop_checkpoint"] else ""
    sys.stderr.write(f"tensorpar: stopped by {s['stopped_by']} after step {s['stopped_at_step']} of "
                     f"{s['steps']}{saved}\n")


def run(args, argv) -> int:
    options = with_output_defaults(options_from_args(TrainOptions, args, "train"))
    if options.dry_run:
        return _dry_run(options)
    world = world_size(options)
    if under_launcher() or world == 1:  # a rank: catch stop signals from the start (its launcher forwards them)
        with GracefulStop(escalate=SPAWNED_ENV not in os.environ, grace_s=options.grace_period) as stop:
            return _run(options, argv, world, stop)
    return _run(options, argv, world, None)


def _run(options: TrainOptions, argv, world: int, stop: GracefulStop | None) -> int:
    prepared = validate(options, world)  # in this process, before starting any rank
    is_first = int(os.environ.get("RANK", "0")) == 0
    if is_first and SPAWNED_ENV not in os.environ:  # the launching process, or rank 0 under torchrun
        for note in prepared.notes:
            sys.stderr.write(f"tensorpar: {note}\n")

    def run_rank() -> int:
        summary = run_training(prepared, stop)
        if "stopped_by" in summary:
            if is_first:
                report_stop(summary)
            return 128 + summary["stop_signal"]
        if is_first:
            print_summary(summary)
        return 0

    return launch(options, argv, run_rank)


def _dry_run(options: TrainOptions) -> int:
    """`--dry-run`: one rank of the world, on the meta device, in this process (no rank is started)."""
    prepared = validate(options, options.world_size or world_size(options))
    result = dry_run(prepared, options.rank)
    print(report(prepared, result, planned_bytes(prepared, result)))
    return 0

