"""The training loop, run on every rank.

One optimizer step: the step's global batch (fixed by seed and global batch size alone), this
DP rank's rows cut into micro-batches, forward/backward on each (gradients accumulate locally),
gradients averaged over DP (one all-reduce per parameter, fp32), clipped by the dense global
norm, AdamW with a cosine schedule. Rank 0 shows a progress bar and writes the metrics.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import time

import torch

from tensorpar.data import TokenDataset, check_batch_layout, check_vocab, load_tokenizer, load_tokens, micro_batches
from tensorpar.distributed.mesh import init_mesh
from tensorpar.errors import TensorparError
from tensorpar.layers.dropout import mix_seed
from tensorpar.models import Transformer, get_config, load_full_state_dict
from tensorpar.models.layout import check_model_layout
from tensorpar.training.flops import peak_flops, train_flops_per_token
from tensorpar.parallel.data_parallel import DistributedOptimizer
from tensorpar.training.metrics import MetricsWriter, plot_loss_curve
from tensorpar.training.schedule import lr_at, set_lr


@dataclasses.dataclass
class TrainArgs:
    model: str = "tiny"
    tp: int = 1
    pp: int = 1
    dp: int | None = None
    sequence_parallel: bool = False
    zero: int = 0
    schedule: str = "1f1b"
    virtual_stages: int = 1
    recompute: str = "none"
    steps: int = 300
    seed: int = 0
    global_batch_size: int = 16
    micro_batch_size: int | None = None  # default: the global batch divided by DP (no accumulation)
    seq_len: int = 128
    lr: float = 3e-3
    min_lr: float | None = None  # default lr / 10
    warmup_steps: int | None = None  # default min(100, steps // 10)
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    dropout: float = 0.0
    dtype: str = "fp32"
    data: str | None = None
    bin_dtype: str = "uint16"
    val_fraction: float = 0.05
    val_every: int = 50
    val_windows: int = 32
    metrics: str | None = None
    out_dir: str | None = None
    init_from: str | None = None
    sample_prompt: str = "The "
    sample_tokens: int = 0
    progress: bool = True
    device: str | None = None
    return_state: bool = False  # put the final dense weights in the summary (tests, small models)
    save: str | None = None
    save_every: int = 0
    keep_last: int = 3
    resume: str | None = None
    stop_after: int | None = None  # stop at this step (the schedule still spans `steps`): an interrupted run


def model_config(args: TrainArgs):
    """The model's config alone (cheap): a preset, a config file, the `--init-from` folder's config, or the
    config of the checkpoint being resumed."""
    if args.resume:
        from tensorpar.training.checkpoint import read_meta
        from tensorpar.models import ModelConfig

        return ModelConfig(**read_meta(args.resume, verify=False)[1]["model"]).replace(dropout=args.dropout)
    if args.init_from:
        from tensorpar.models.checkpoint_io import load_config

        return load_config(args.init_from).replace(dropout=args.dropout)
    return get_config(args.model).replace(dropout=args.dropout)


def resolve_model(args: TrainArgs):
    """(config, dense initial weights or None, tokenizer) from a preset or `--init-from` folder."""
    if args.init_from:
        from tensorpar.models.checkpoint_io import load_model_source

        cfg, state = load_model_source(args.init_from)
        tokenizer = load_tokenizer(args.init_from)
    else:
        cfg, state, tokenizer = get_config(args.model), None, load_tokenizer(None)
    return cfg.replace(dropout=args.dropout), state, tokenizer


def validate(args: TrainArgs, cfg) -> None:
    """Everything that can be checked before starting processes."""
    if args.dtype not in ("fp32", "bf16"):
        raise TensorparError(f"--dtype must be fp32 or bf16, got {args.dtype!r}")
    if args.steps < 1:
        raise TensorparError(f"--steps must be at least 1, got {args.steps}")
    if args.resume:
        from tensorpar.training.checkpoint import read_meta

        _, meta = read_meta(args.resume)  # every shard present, complete and unchanged
        if meta["step"] >= args.steps:
            raise TensorparError(f"checkpoint '{args.resume}' is at step {meta['step']} and --steps is {args.steps}: "
                                 f"nothing left to train (--steps is the total step count)")
        if args.init_from:
            raise TensorparError("--resume and --init-from exclude each other")
    if args.save_every and not args.save:
        raise TensorparError("--save-every needs --save DIR")
    if args.warmup_steps is not None and not 0 <= args.warmup_steps <= args.steps:
        raise TensorparError(f"--warmup-steps must be between 0 and --steps ({args.steps}), got {args.warmup_steps}")
    if args.data and not os.path.exists(args.data):
        raise TensorparError(f"data file '{args.data}' does not exist")
    check_model_layout(cfg, args.tp, args.sequence_parallel, args.seq_len)
    if args.dp is not None:
        micro = args.micro_batch_size or max(1, args.global_batch_size // args.dp)
        check_batch_layout(args.global_batch_size, args.dp, micro)
    if args.pp > 1 or args.virtual_stages > 1:
        from tensorpar.parallel.pipeline import stage_layers
        from tensorpar.parallel.schedules import build_schedule

        stage_layers(cfg.num_layers, args.pp, args.virtual_stages)
        if args.dp is not None:
            micro = args.micro_batch_size or args.global_batch_size // args.dp
            if micro and args.global_batch_size % (args.dp * micro) == 0:
                build_schedule(args.schedule, args.pp, args.global_batch_size // (args.dp * micro),
                               args.virtual_stages)


def _autocast(device: torch.device, dtype: str):
    if dtype == "bf16":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


@torch.no_grad()
def evaluate(model, windows: torch.Tensor, batch_size: int, device, dtype: str) -> float:
    """Mean next-token loss over `windows` [N, L+1] (every rank gets the same value)."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for start in range(0, windows.shape[0], batch_size):
        batch = windows[start : start + batch_size].to(device)
        with _autocast(device, dtype):
            loss = model(batch[:, :-1], batch[:, 1:])
        total += loss.item() * batch[:, 1:].numel()
        count += batch[:, 1:].numel()
    model.train(was_training)
    return total / max(count, 1)


def dense_weights(model, mesh) -> dict:
    """The whole dense model's weights on every rank: gathered over TP, then merged over pipeline stages."""
    from tensorpar.models import full_state_dict

    params = dict(model.named_parameters())
    state = {k: v for k, v in full_state_dict(model).items() if not getattr(params[k], "pipeline_duplicate", False)}
    merged = {}
    for part in mesh.pp_group.all_gather_object(state):
        merged.update(part)
    return merged


def train(args: TrainArgs) -> dict:
    """Train on every rank of the running world; returns the summary (rank 0 also prints and plots)."""
    cfg, init_state, tokenizer = resolve_model(args)
    validate(args, cfg)
    mesh = init_mesh(tp=args.tp, pp=args.pp, dp=args.dp, device=args.device)
    is_main = mesh.rank == 0
    device = mesh.device

    tokens = load_tokens(args.data, tokenizer, args.bin_dtype)
    check_vocab(tokens, cfg.vocab_size, args.data or "the default corpus")
    dataset = TokenDataset(tokens, args.seq_len, args.val_fraction)
    micro = args.micro_batch_size or args.global_batch_size // mesh.dp_size
    check_batch_layout(args.global_batch_size, mesh.dp_size, micro)

    torch.manual_seed(args.seed)
    pipeline = mesh.pp_size > 1
    stage = {}
    if pipeline:
        from tensorpar.parallel.pipeline import rank_layers

        chunks = rank_layers(cfg.num_layers, mesh.pp_size, mesh.pp_rank, args.virtual_stages)
        stage = dict(layers=[i for chunk in chunks for i in chunk], first_stage=mesh.pp_rank == 0,
                     last_stage=mesh.pp_rank == mesh.pp_size - 1)
    model = Transformer(cfg, mesh, sequence_parallel=args.sequence_parallel, recompute=args.recompute,
                        seed=args.seed, init=init_state is None, **stage)
    if init_state is not None:
        names = dict(model.named_parameters())
        load_full_state_dict(model, {k: v for k, v in init_state.items() if k in names}, source=args.init_from)
    model.train()
    optimizer = DistributedOptimizer(model, mesh, lr=args.lr, weight_decay=args.weight_decay, zero=args.zero)
    start_step = 0
    if args.resume:
        from tensorpar.training.checkpoint import load_checkpoint

        meta = load_checkpoint(args.resume, model, optimizer, cfg, verify=False)  # validate() hashed the shards
        start_step = meta["step"]
        changed = [f"{k} {meta['train'].get(k)} -> {getattr(args, k)}" for k in ("seed", "global_batch_size", "seq_len")
                   if meta.get("train", {}).get(k) not in (None, getattr(args, k))]
        if changed and is_main:
            import sys

            sys.stderr.write(f"tensorpar: warning: resuming with {', '.join(changed)}: the samples (and the "
                             f"continued losses) will differ from the original run's\n")
    checkpoint_info = dict(
        cfg=cfg,
        layout={"tp": mesh.tp_size, "pp": mesh.pp_size, "dp": mesh.dp_size, "zero": args.zero,
                "virtual_stages": args.virtual_stages, "schedule": args.schedule,
                "sequence_parallel": model.sequence_parallel},
        train={"seed": args.seed, "global_batch_size": args.global_batch_size, "seq_len": args.seq_len,
               "lr": args.lr, "min_lr": args.min_lr, "warmup_steps": args.warmup_steps, "steps": args.steps,
               "weight_decay": args.weight_decay, "grad_clip": args.grad_clip, "data": args.data},
        keep_last=args.keep_last,
    )
    min_lr = args.lr / 10 if args.min_lr is None else args.min_lr
    warmup = min(100, args.steps // 10) if args.warmup_steps is None else args.warmup_steps

    tokens_per_step = args.global_batch_size * args.seq_len
    flops_per_step = train_flops_per_token(cfg, args.seq_len) * tokens_per_step
    peak, peak_source = peak_flops(device, args.dtype)
    metrics = MetricsWriter(args.metrics if is_main else None)
    records: list[dict] = []
    val_windows = dataset.val_windows(args.val_windows) if dataset.num_val_windows else None
    runner = None
    if pipeline:
        from tensorpar.parallel.pipeline import PipelineRunner

        num_micro = args.global_batch_size // (mesh.dp_size * micro)
        seq_shard = args.seq_len // (mesh.tp_size if model.sequence_parallel else 1)
        runner = PipelineRunner(model, mesh, args.schedule, args.virtual_stages, num_micro,
                                (micro, seq_shard, cfg.hidden_size),
                                autocast=lambda: _autocast(device, args.dtype))
        if val_windows is not None:
            val_windows = val_windows[: (len(val_windows) // micro) * micro]

    progress = None
    if is_main and args.progress:
        from tqdm import tqdm

        progress = tqdm(total=args.steps, initial=start_step, desc=f"train {args.model} tp={mesh.tp_size} dp={mesh.dp_size}",
                        unit="step", dynamic_ncols=True)
    mesh.stats.reset()
    started = time.perf_counter()
    end_step = args.steps if args.stop_after is None else min(args.steps, args.stop_after)
    for step in range(start_step, end_step):
        t0 = time.perf_counter()
        lr = lr_at(step, max_lr=args.lr, min_lr=min_lr, warmup_steps=warmup, total_steps=args.steps)
        set_lr(optimizer.optimizer, lr)
        batches = micro_batches(dataset.global_batch(step, args.seed, args.global_batch_size),
                                mesh.dp_rank, mesh.dp_size, micro)
        step_loss = torch.zeros((), device=device)
        optimizer.begin_step(len(batches))
        if runner is not None:
            batches = [b.to(device) for b in batches]
            step_loss += runner.train_step(
                batches, lambda i, step=step: mix_seed(args.seed, step, mesh.dp_rank * len(batches) + i))
        else:
            for i, batch in enumerate(batches):
                batch = batch.to(device)
                seed = mix_seed(args.seed, step, mesh.dp_rank * len(batches) + i)
                with _autocast(device, args.dtype):
                    loss = model(batch[:, :-1], batch[:, 1:], dropout_seed=seed)
                (loss / len(batches)).backward()
                step_loss += loss.detach().float() / len(batches)
        optimizer.finish_backward()
        grad_norm = optimizer.clip_and_step(args.grad_clip)
        mesh.dp_group.all_reduce(step_loss)
        step_loss = step_loss.item() / mesh.dp_size
        if not math.isfinite(step_loss):
            raise TensorparError(f"loss became {step_loss} at step {step + 1}; try a lower --lr or --grad-clip")
        elapsed = time.perf_counter() - t0
        record = {
            "step": step + 1,
            "loss": step_loss,
            "grad_norm": grad_norm.item(),
            "lr": lr,
            "tokens_per_s": tokens_per_step / elapsed,
            "mfu": flops_per_step / elapsed / (peak * mesh.world_size),
            "step_time_s": elapsed,
        }
        last = step == end_step - 1
        if val_windows is not None and (last or (args.val_every and (step + 1) % args.val_every == 0)):
            if runner is not None:
                model.eval()
                record["val_loss"] = runner.forward_only([w.to(device) for w in val_windows.split(micro)])
                model.train()
            else:
                record["val_loss"] = evaluate(model, val_windows, micro, device, args.dtype)
        records.append(record)
        metrics.write(record)
        if args.save and (last or (args.save_every and (step + 1) % args.save_every == 0)):
            from tensorpar.training.checkpoint import save_checkpoint

            save_checkpoint(args.save, step + 1, model, optimizer, mesh, **checkpoint_info)
        if progress is not None:
            progress.set_postfix(loss=f"{step_loss:.3f}", tok_s=f"{record['tokens_per_s']:.0f}",
                                 mfu=f"{100 * record['mfu']:.1f}%")
            progress.update(1)
    if progress is not None:
        progress.close()
    total_time = time.perf_counter() - started
    metrics.close()
    comm = {f"{op}/{group}": (c.calls, c.bytes) for (op, group), c in mesh.stats.snapshot().items()}

    summary = {
        "model": args.model if not args.init_from else args.init_from,
        "parameters": cfg.num_parameters(),
        "layout": {"tp": mesh.tp_size, "pp": mesh.pp_size, "dp": mesh.dp_size, "zero": args.zero,
                   "schedule": args.schedule if pipeline else None, "virtual_stages": args.virtual_stages,
                   "sequence_parallel": model.sequence_parallel, "recompute": args.recompute, "dtype": args.dtype},
        "steps": args.steps,
        "start_step": start_step,
        "tokens": tokens_per_step * (args.steps - start_step),
        "first_loss": records[0]["loss"],
        "final_loss": records[-1]["loss"],
        "final_val_loss": records[-1].get("val_loss"),
        "time_s": total_time,
        "tokens_per_s": tokens_per_step * (args.steps - start_step) / total_time,
        "mfu": sum(r["mfu"] for r in records) / len(records),
        "peak_flops_source": peak_source,
        "history": records,
        "comm": comm,
        "optimizer_state_bytes": optimizer.state_bytes(),
        "pipeline_timeline": runner.timeline if runner is not None else None,
        "pipeline_peak_in_flight": runner.peak_in_flight if runner is not None else None,
    }
    if runner is not None:
        # The last step's measured timeline of every stage (perf_counter: comparable across processes of one
        # machine; across machines the clocks' offsets shift the rows).
        from tensorpar.parallel.schedule_view import measured_bubble, render_measured

        timelines = mesh.pp_group.all_gather_object(runner.timeline)
        summary["pipeline_bubble"] = measured_bubble(timelines)
        if is_main and args.out_dir:
            summary["pipeline_plot"] = render_measured(
                timelines, os.path.join(args.out_dir, "pipeline.png"),
                f"measured {args.schedule} timeline, last step: pp={mesh.pp_size}, "
                f"{len(timelines[0]) // 2 // args.virtual_stages} micro-batches")
    if args.return_state:
        summary["state"] = dense_weights(model, mesh)
    if args.sample_tokens and pipeline:
        summary["sample"] = None
        summary["sample_note"] = "no sample: generation runs with tensor parallelism only (use --pp 1)"
    elif args.sample_tokens:
        from tensorpar.inference import greedy_generate

        prompt = tokenizer.encode(args.sample_prompt)
        new = greedy_generate(model, prompt, args.sample_tokens, eos_id=getattr(tokenizer, "eos_id", None))
        summary["sample"] = args.sample_prompt + tokenizer.decode(new)
    if is_main and args.out_dir:
        summary["loss_plot"] = plot_loss_curve(
            records, os.path.join(args.out_dir, "loss.png"),
            f"{args.model}: tp={mesh.tp_size} dp={mesh.dp_size}{' +SP' if model.sequence_parallel else ''}, "
            f"{args.dtype}, {args.steps} steps",
        )
    mesh.destroy()
    return summary
