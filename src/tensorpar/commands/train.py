"""`tensorpar train`: train a preset (or a Hugging Face model) with tensor/sequence/data parallelism."""

from __future__ import annotations

import json
import os

from tensorpar.commands.common import add_layout_args, launch
from tensorpar.training.trainer import TrainArgs


def add_parser(sub) -> None:
    p = sub.add_parser("train", help="train a transformer (default: the tiny preset on the embedded corpus)")
    p.add_argument("--model", default="tiny", help="preset name or config .json (default %(default)s)")
    add_layout_args(p)
    p.add_argument("--sequence-parallel", action="store_true", help="shard norms/dropout/residuals along the sequence")
    p.add_argument("--zero", type=int, choices=[0, 1, 2], default=0,
                   help="ZeRO stage over the DP group: 1 shards optimizer states, 2 also gradients")
    p.add_argument("--schedule", choices=["afab", "1f1b", "interleaved"], default="1f1b",
                   help="pipeline schedule when --pp > 1 (default %(default)s)")
    p.add_argument("--virtual-stages", type=int, default=1, help="model chunks per pipeline rank (interleaved)")
    p.add_argument("--recompute", choices=["none", "selective", "full"], default="none")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--global-batch-size", type=int, default=16)
    p.add_argument("--micro-batch-size", type=int, default=None, help="default: global batch / dp")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--min-lr", type=float, default=None, help="default lr / 10")
    p.add_argument("--warmup-steps", type=int, default=None, help="default min(100, steps / 10)")
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--dropout", type=float, default=0.0)
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--data", default=None, help="text, .npy or .bin token file (default: the embedded corpus)")
    p.add_argument("--bin-dtype", choices=["uint16", "int32"], default="uint16")
    p.add_argument("--val-every", type=int, default=50)
    p.add_argument("--metrics", default=None, help="JSONL file, one object per step (default OUT_DIR/metrics.jsonl)")
    p.add_argument("--out-dir", default=None, help="for the metrics and loss plot (default runs/MODEL-tpT)")
    p.add_argument("--init-from", default=None, help="start from a Hugging Face folder or a tensorpar checkpoint")
    p.add_argument("--save", default=None, help="checkpoint folder (written at the end and every --save-every steps)")
    p.add_argument("--save-every", type=int, default=0)
    p.add_argument("--keep-last", type=int, default=3, help="checkpoints to keep (default %(default)s)")
    p.add_argument("--resume", default=None, help="continue from a checkpoint up to --steps, at any layout")
    p.add_argument("--sample-tokens", type=int, default=0, help="greedy sample this many tokens at the end")
    p.add_argument("--sample-prompt", default="The ")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--device", default=None, help="default: this rank's GPU if any, else cpu")
    p.set_defaults(run=run)


def _train_args(args) -> TrainArgs:
    out_dir = args.out_dir or os.path.join("runs", f"{os.path.basename(args.init_from or args.model)}-tp{args.tp}")
    return TrainArgs(
        model=args.model, tp=args.tp, pp=args.pp, dp=args.dp, sequence_parallel=args.sequence_parallel,
        zero=args.zero, schedule=args.schedule, virtual_stages=args.virtual_stages,
        recompute=args.recompute, steps=args.steps, seed=args.seed, global_batch_size=args.global_batch_size,
        micro_batch_size=args.micro_batch_size, seq_len=args.seq_len, lr=args.lr, min_lr=args.min_lr,
        warmup_steps=args.warmup_steps, weight_decay=args.weight_decay, grad_clip=args.grad_clip,
        dropout=args.dropout, dtype=args.dtype, data=args.data, bin_dtype=args.bin_dtype, val_every=args.val_every,
        metrics=args.metrics or os.path.join(out_dir, "metrics.jsonl"), out_dir=out_dir, init_from=args.init_from,
        sample_prompt=args.sample_prompt, sample_tokens=args.sample_tokens, progress=not args.no_progress,
        device=args.device, save=args.save, save_every=args.save_every, keep_last=args.keep_last, resume=args.resume,
    )


def _print_summary(s: dict) -> None:
    lay = s["layout"]
    resumed = f" (resumed at step {s['start_step']})" if s.get("start_step") else ""
    print(f"\ntrained{resumed} {s['model']} ({s['parameters'] / 1e6:.2f}M parameters) for {s['steps']} steps on "
          f"{s['tokens']:,} tokens: tp={lay['tp']} pp={lay['pp']} dp={lay['dp']}"
          f"{' zero-' + str(lay['zero']) if lay['zero'] else ''}"
          f"{' ' + lay['schedule'] + (' v=' + str(lay['virtual_stages']) if lay['virtual_stages'] > 1 else '') if lay['schedule'] else ''}"
          f"{' +sequence-parallel' if lay['sequence_parallel'] else ''}, recompute={lay['recompute']}, {lay['dtype']}")
    val = f", validation {s['final_val_loss']:.4f}" if s.get("final_val_loss") is not None else ""
    print(f"loss {s['first_loss']:.4f} -> {s['final_loss']:.4f}{val}")
    print(f"{s['time_s']:.1f}s, {s['tokens_per_s']:,.0f} tokens/s, MFU {100 * s['mfu']:.1f}% "
          f"(of the {s['peak_flops_source']})")
    if s.get("loss_plot"):
        print(f"loss curve: {s['loss_plot']}")
    if s.get("pipeline_bubble") is not None:
        plot = f"; timeline: {s['pipeline_plot']}" if s.get("pipeline_plot") else ""
        print(f"pipeline bubble (measured, last step): {100 * s['pipeline_bubble']:.1f}%{plot}")
    if s.get("sample_note"):
        print(s["sample_note"])
    if s.get("sample") is not None:
        print(f"sample (greedy): {json.dumps(s['sample'])}")


def run_rank(args) -> int:
    from tensorpar.training.trainer import train

    summary = train(_train_args(args))
    if int(os.environ.get("RANK", "0")) == 0:
        _print_summary(summary)
    return 0


def run(args, argv) -> int:
    from tensorpar.training.trainer import model_config, validate

    from tensorpar.commands.common import world_size
    from tensorpar.distributed.mesh import resolve_layout

    train_args = _train_args(args)
    _, _, train_args.dp = resolve_layout(world_size(args), args.tp, args.pp, args.dp)
    validate(train_args, model_config(train_args))  # fail in this process, before starting any rank
    return launch(args, argv, run_rank)
