"""The end of a training run: the summary every rank returns, and what rank 0 draws and samples."""

from __future__ import annotations

import math
import os

from tensorpar.checkpoints.peft_adapter import adapter_shapes
from tensorpar.data.tokenizer import text_after
from tensorpar.distributed.launch import signal_name
from tensorpar.distributed.sharding import shard_spec
from tensorpar.inference import greedy_generate
from tensorpar.models import full_state_dict
from tensorpar.models.state import model_state
from tensorpar.pipeline_parallel.schedule_view import measured_bubble, render_measured
from tensorpar.training.loop import LoopResult
from tensorpar.training.metrics import draw_or_warn, plot_loss_curve, read_records
from tensorpar.training.session import Session


def dense_weights(model, mesh) -> dict:
    """The whole dense model's weights on every rank: gathered over TP, then merged over pipeline stages."""
    params = model_state(model)  # the persistent buffers (routers' balancing biases) too
    state = {k: v for k, v in full_state_dict(model).items() if not shard_spec(params[k]).pipeline_duplicate}
    merged = {}
    for part in mesh.pp_group.all_gather_object(state):
        merged.update(part)
    return merged


def _model_metrics(cfg, records: list[dict]) -> dict:
    """What the run's MoE layers (routing) and multi-token prediction modules (their loss) did over its steps."""
    out = {}
    if cfg.is_moe and records:
        out["moe"] = {"final_aux_loss": records[-1]["moe_aux_loss"], "final_z_loss": records[-1]["moe_z_loss"],
                      "mean_load_imbalance": sum(r["moe_load_imbalance"] for r in records) / len(records),
                      "dropped_tokens": sum(r["moe_dropped_tokens"] for r in records)}
    if cfg.num_mtp_layers and records:
        out["mtp"] = {"first_loss": records[0]["mtp_loss"], "final_loss": records[-1]["mtp_loss"],
                      "modules": cfg.num_mtp_layers, "weight": cfg.mtp_loss_weight}
    return out


def _pipeline(s: Session, summary: dict) -> None:
    """The last step's measured timeline of every stage: its bubble, and (rank 0) its picture.

    Times are perf_counter's: comparable across processes of one machine; across machines the clocks'
    offsets shift the rows."""
    o, mesh = s.options, s.mesh
    timelines = mesh.pp_group.all_gather_object(s.runner.timeline)
    summary["pipeline_bubble"] = measured_bubble(timelines)
    if s.is_main and o.out_dir:
        title = (f"measured {o.schedule} timeline, last step: pp={mesh.pp_size}, "
                 f"{1 + max(mb for _, mb, _, _, _ in timelines[0])} micro-batches")
        summary["pipeline_plot"] = draw_or_warn("the pipeline timeline", render_measured, timelines,
                                                os.path.join(o.out_dir, "pipeline.png"), title)


def _sample(s: Session, summary: dict) -> None:
    o = s.options
    if s.runner is not None or s.mesh.cp_size > 1:
        summary["sample"] = None
        summary["sample_note"] = "no sample: generation runs with tensor parallelism only (use --pp 1 --cp 1)"
        return
    text = s.dataset.prompt(o.sample_prompt) if hasattr(s.dataset, "prompt") else o.sample_prompt  # chat: rendered
    eos = getattr(s.tokenizer, "eos_id", None)
    prompt = s.tokenizer.encode(text)
    new = greedy_generate(s.model, prompt, o.sample_tokens, eos_id=eos)
    summary["sample"] = text + text_after(s.tokenizer, prompt, new)


def lora_summary(run) -> dict | None:
    """A LoRA run's adapters: rank, alpha, targets, dropout, and how many parameters they hold (None: no adapters)."""
    if run.lora is None:
        return None
    trained = sum(math.prod(shape) for shape in adapter_shapes(run.cfg, run.lora).values())
    return {**run.lora.as_dict(), "trainable_parameters": trained}


def _whole_run(s: Session, records: list[dict]) -> list[dict]:
    """The records of every step so far: a resumed run's earlier ones from the metrics file it continues."""
    if not s.start_step or not s.options.metrics:
        return records
    return [r for r in read_records(s.options.metrics) if r["step"] <= s.start_step] + records


def summarize(s: Session, result: LoopResult) -> dict:
    """The run's summary (the same on every rank but for the paths of what rank 0 wrote)."""
    o, mesh, runner = s.options, s.mesh, s.runner
    records, seconds = result.records, result.seconds
    tokens = o.global_batch_size * o.seq_len * len(records)
    comm = {f"{op}/{group}": (c.calls, c.bytes) for (op, group), c in mesh.stats.snapshot().items()}
    summary = {
        "model": o.init_from or o.model,
        "save": o.save,
        "parameters": s.run.cfg.num_parameters(),
        "layout": s.layout.as_dict(),
        "recompute": o.recompute,
        "dtype": o.dtype,
        "steps": o.steps,
        "start_step": s.start_step,
        "tokens": tokens,
        "first_loss": records[0]["loss"] if records else None,
        "final_loss": records[-1]["loss"] if records else None,
        "final_val_loss": records[-1].get("val_loss") if records else None,
        "skipped_steps": sum(bool(r.get("skipped")) for r in records),
        "final_loss_scale": records[-1].get("loss_scale") if records else None,
        "time_s": seconds,
        "tokens_per_s": tokens / seconds if seconds else 0.0,
        "mfu": sum(r["mfu"] for r in records) / len(records) if records else 0.0,
        "peak_flops_source": s.peak_flops[1],
        "history": records,
        "comm": comm,
        "optimizer_state_bytes": s.optimizer.state_bytes(),
        "memory_mib_per_rank": mesh.world_group.all_gather_object(result.peak_memory_mib),
        "pipeline_timeline": runner.timeline if runner is not None else None,
        "pipeline_peak_in_flight": runner.peak_in_flight if runner is not None else None,
    }
    summary["lora"] = lora_summary(s.run)
    if getattr(s.dataset, "stats", None):  # instruction data: examples truncated or left out, rows, fill
        summary["examples"] = {"kind": s.dataset.kind, "packing": s.dataset.packing, **s.dataset.stats}
    summary.update(_model_metrics(s.run.cfg, records))
    if s.async_saves is not None:  # the host memory its copies took on the rank that needs the most, and each save
        staged = mesh.world_group.all_gather_object(s.async_saves.staged_bytes)
        summary["async_save"] = {**s.async_saves.summary(), "staged_mib": max(staged) / 2**20,
                                 "staged_rank": staged.index(max(staged))}
    if result.stop_signal is not None:
        summary.update(stopped_by=signal_name(result.stop_signal), stop_signal=result.stop_signal,
                       stopped_at_step=s.start_step + len(records), stop_checkpoint=result.stop_checkpoint)
    if runner is not None and records:
        _pipeline(s, summary)
    with s.optimizer.gathered():  # ZeRO-3 holds 1/dp of each parameter between uses
        if o.return_state:
            summary["state"] = dense_weights(s.model, mesh)
        if o.sample_tokens and result.stop_signal is None:
            _sample(s, summary)
    if s.is_main and o.out_dir and records:
        title = (f"{o.init_from or o.model}: tp={mesh.tp_size} dp={mesh.dp_size}{' +SP' if s.model.sequence_parallel else ''}, "
                 f"{o.dtype}, {o.steps} steps")
        summary["loss_plot"] = draw_or_warn("the loss curve", plot_loss_curve, _whole_run(s, records),
                                            os.path.join(o.out_dir, "loss.png"), title)
        summary["config"] = os.path.join(o.out_dir, "config.toml")
    return summary
