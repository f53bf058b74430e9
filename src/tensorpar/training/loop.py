"""The step loop, run on every rank.

One optimizer step: the step's global batch (fixed by seed and global batch size alone), this
DP rank's rows cut into micro-batches, forward/backward on each (gradients accumulate locally,
or flow through the pipeline schedule; each micro-batch's loss weighted by its share of the step's
valid targets: training/loss_weights.py), gradients averaged (or reduce-scattered, ZeRO) over DP,
clipped by the dense global norm, AdamW (or Muon) with a cosine (or WSD) schedule. Rank 0 shows a progress bar and
writes each step's metrics record to its sinks (metrics.jsonl, TensorBoard, W&B: training/metric_sinks.py).
"""

from __future__ import annotations

import collections
import dataclasses
import math
import sys
import time

import torch
from tqdm import tqdm

from tensorpar.checkpoints.sharded import step_folder
from tensorpar.config.fields import to_dict
from tensorpar.data import micro_batches
from tensorpar.data.batch import Batch, as_batch
from tensorpar.errors import TensorparError
from tensorpar.functional.document_mask import PackedDocuments
from tensorpar.functional.dropout import mix_seed
from tensorpar.models.flops import train_flops_per_token
from tensorpar.optim.lr_schedule import run_lr, set_lr
from tensorpar.training.evaluate import evaluate
from tensorpar.training.loss_weights import micro_batch_weights
from tensorpar.training.memory_meter import step_memory
from tensorpar.training.memory_snapshot import MemorySnapshot
from tensorpar.training.metric_sinks import open_sinks
from tensorpar.training.moe_metrics import moe_step_metrics, moe_step_table, update_expert_biases
from tensorpar.training.mtp_metrics import mtp_step_metrics
from tensorpar.training.profiling import StepProfiler
from tensorpar.training.session import Session


def packed_documents(s: Session, batches: list[Batch]) -> list[PackedDocuments] | None:
    """The packed documents of each batch: its instruction examples (packed rows), or under --document-mask the
    documents the tokenizer's EOS ends; else None."""
    if batches and batches[0].example is not None:
        return [PackedDocuments.from_index(b.example) for b in batches]
    if not s.options.document_mask:
        return None
    return [PackedDocuments.from_tokens(b.inputs, s.tokenizer.eos_id) for b in batches]


def train_step(s: Session, step: int) -> dict:
    """Forward, backward and the optimizer step of 0-based step `step`; its record (loss, grad_norm, lr, ...)."""
    o, mesh, device = s.options, s.mesh, s.mesh.device
    t0 = time.perf_counter()
    lr = run_lr(o, step)  # warmup + cosine, or WSD
    set_lr(s.optimizer.optimizer, lr)
    rows = as_batch(s.dataset.global_batch(step, o.seed, o.global_batch_size))
    batches = micro_batches(rows, mesh.dp_rank, mesh.dp_size, o.micro_batch_size)
    weights = micro_batch_weights(batches, rows.valid_targets(), mesh.dp_size)  # sum of losses / all valid targets
    batches = [b.to(device) for b in batches]

    def seed_of(i: int) -> int:  # the dropout seed of micro-batch i: the same whatever the layout
        return mix_seed(o.seed, step, mesh.dp_rank * len(batches) + i)

    documents = packed_documents(s, batches)
    step_loss = torch.zeros((), device=device)
    s.optimizer.begin_step(len(batches))
    scale = s.scaler.scale if s.scaler is not None else 1.0
    with s.activations.measuring(s.model):
        if s.runner is not None:
            step_loss += s.runner.train_step(batches, seed_of, scale, documents, weights)
        else:
            for i, batch in enumerate(batches):  # bf16/fp16: the parameters themselves are cast, no autocast
                loss = s.model(batch.inputs, batch.targets, dropout_seed=seed_of(i), aux_scale=scale / len(batches),
                               documents=None if documents is None else documents[i])
                (loss * (scale * weights[i])).backward()
                step_loss += loss.detach().float() * weights[i]
    s.optimizer.finish_backward()
    grad_norm = s.optimizer.clip_and_step(o.grad_clip, s.scaler)
    mesh.dp_group.all_reduce(step_loss)
    loss = step_loss.item() / mesh.dp_size
    if s.scaler is None and not math.isfinite(grad_norm.item()):  # the same norm on every rank: all come here
        non_finite_gradients(s, step, loss, grad_norm.item())
    elif not math.isfinite(loss):
        s.finish_saves(step)  # every rank comes here (the loss is the same on every rank): commit a pending save
        raise TensorparError(f"loss became {loss} at step {step + 1}; try a lower --lr or --grad-clip")
    record = {"step": step + 1, "loss": loss, "grad_norm": grad_norm.item(), "lr": lr,
              "step_time_s": time.perf_counter() - t0,
              "memory_mib": step_memory(s.optimizer, s.activations, device, s.model)}
    if s.scaler is not None:  # the scale this step ran with, and whether its gradients overflowed
        record.update(loss_scale=scale)
    if s.scaler is not None or not math.isfinite(record["grad_norm"]):
        record["skipped"] = not math.isfinite(record["grad_norm"])
    cfg = s.run.cfg
    if cfg.is_moe:
        table = moe_step_table(s.model, cfg, mesh)
        record.update(moe_step_metrics(s.model, cfg, mesh, table))
        if cfg.bias_update_speed and not record.get("skipped"):
            update_expert_biases(s.model, cfg, table)
    if cfg.num_mtp_layers:
        record.update(mtp_step_metrics(s.model, cfg, mesh))
    if s.model.region.fp8 is not None:  # the largest amax of the fp8 inputs, weights and output gradients, world-wide
        record.update(s.model.region.fp8.stats.take(mesh.world_group, device))
    return record


def non_finite_gradients(s: Session, step: int, loss: float, norm: float) -> None:
    """A step whose gradient norm is NaN or Inf (it was not applied): say where, on every rank, and stop the run
    (--on-nan stop) or go on (skip). Collective: every rank's parameters with non-finite gradients are gathered."""
    names = {id(p): n for n, p in s.model.named_parameters()}
    found = s.mesh.world_group.all_gather_object([names.get(id(p), "?") for p in s.optimizer.nonfinite])
    where = "; ".join(f"rank {r}: {bad[0]}" + (f" and {len(bad) - 1} more" if len(bad) > 1 else "")
                      for r, bad in enumerate(found) if bad) or "no rank found one (an overflow in the norm itself)"
    what = (f"step {step + 1}: the gradient norm is {norm} (loss {loss:.4g}); first parameter whose gradient is not "
            f"finite, by rank: {where}. The step was not applied")
    if s.options.on_nan == "stop":
        s.finish_saves(step)  # an asynchronous save of an earlier step is as good as a blocking one: commit it
        raise TensorparError(f"{what}; no checkpoint is saved after step {step} (--on-nan skip skips such steps)")
    if s.is_main:
        sys.stderr.write(f"tensorpar: warning: {what} (--on-nan skip)\n")


SPIKE_WINDOW, SPIKE_MIN_STEPS = 20, 5  # --spike-factor: the mean of up to 20 previous steps, once there are 5


def loss_spike(s: Session, step: int, loss: float, recent: collections.deque) -> bool:
    """Whether 0-based step `step`'s loss is a spike (--spike-factor times the mean of the `recent` losses); rank 0
    then says so with the samples of the step. No collective: every rank has the same loss."""
    o = s.options
    if not o.spike_factor or len(recent) < SPIKE_MIN_STEPS or not math.isfinite(loss):
        return False
    mean = sum(recent) / len(recent)
    if loss <= o.spike_factor * mean:
        return False
    if s.is_main:
        samples = s.dataset.describe_samples(step, o.seed, o.global_batch_size)
        sys.stderr.write(f"tensorpar: loss spike at step {step + 1}: {loss:.4g} is {loss / mean:.2f}x the mean of "
                         f"the {len(recent)} steps before ({mean:.4g}); its samples: {samples}\n")
    return True


def validation_loss(s: Session) -> float:
    """The validation loss, with the training's document mask if any."""
    eos = s.tokenizer.eos_id if s.options.document_mask else None
    if s.runner is None:
        return evaluate(s.model, s.val_windows, s.options.micro_batch_size, s.mesh.device, s.run.precision,
                        eos_id=eos)
    s.model.eval()
    rows = as_batch(s.val_windows)
    batches = rows.split(s.options.micro_batch_size)  # the pipeline runs whole micro-batches: the last one padded
    batches[-1] = batches[-1].padded(s.options.micro_batch_size)  # with rows of no target, so every window counts
    weights = micro_batch_weights(batches, rows.valid_targets(), 1)
    batches = [b.to(s.mesh.device) for b in batches]
    loss = s.runner.forward_only(batches, packed_documents(s, batches), weights)
    s.model.train()
    return loss


def _due(step: int, every: int, last: bool) -> bool:
    """Whether periodic work (validation, a save) falls on 1-based `step`."""
    return last or bool(every and step % every == 0)


@dataclasses.dataclass
class LoopResult:
    records: list[dict]
    seconds: float
    stop_signal: int | None = None  # the signal that stopped the run before its last step
    stop_checkpoint: str | None = None  # what the stop saved
    peak_memory_mib: dict = dataclasses.field(default_factory=dict)  # this rank's, by kind, over the steps run


def step_loop(s: Session) -> LoopResult:
    """Run the steps from the start (or resumed) step to `steps` (or `stop_after`), or until a stop signal."""
    o, mesh = s.options, s.mesh
    sinks = open_sinks(o, to_dict(o), s.start_step) if s.is_main else []
    progress = None
    if s.is_main and o.progress:
        progress = tqdm(total=o.steps, initial=s.start_step, unit="step", dynamic_ncols=True,
                        desc=f"train {o.init_from or o.model} tp={mesh.tp_size} dp={mesh.dp_size}")
    mesh.stats.reset()
    started = time.perf_counter()
    result = LoopResult([], 0.0)
    profiler, snapshot = StepProfiler(o, mesh), MemorySnapshot(o, mesh)
    failed = True
    try:
        _run_steps(s, result, sinks, progress, profiler, snapshot)
        failed = False
    except torch.cuda.OutOfMemoryError:
        snapshot.out_of_memory()
        raise
    finally:
        profiler.close()
        snapshot.close()
        for sink in sinks:
            sink.close(failed)
    if progress is not None:
        progress.close()
    result.seconds = time.perf_counter() - started
    return result


def _run_steps(s: Session, result: LoopResult, sinks: list, progress, profiler: StepProfiler,
               snapshot: MemorySnapshot) -> None:
    o, mesh = s.options, s.mesh
    tokens_per_step = o.global_batch_size * o.seq_len
    flops_per_step = train_flops_per_token(s.run.cfg, o.seq_len) * tokens_per_step
    end = o.steps if o.stop_after is None else min(o.steps, o.stop_after)
    saved_step = s.start_step
    recent: collections.deque = collections.deque(maxlen=SPIKE_WINDOW)  # the losses of the last applied steps
    for step in range(s.start_step, end):
        if s.stop is not None and (signum := s.stop.agreed(mesh.world_group, mesh.device)):
            result.stop_signal = signum
            if o.save and step > s.start_step:  # the last completed step, saved unless it just was
                result.stop_checkpoint = s.save(step) if step > saved_step else step_folder(o.save, step)
            break  # a pending asynchronous save is committed below
        profiler.begin(step)
        record = train_step(s, step)
        profiler.end(step)
        if loss_spike(s, step, record["loss"], recent):
            record["loss_spike"] = True
        if not record.get("skipped"):
            recent.append(record["loss"])
        elapsed = record.pop("step_time_s")
        record.update(tokens_per_s=tokens_per_step / elapsed,
                      mfu=flops_per_step / elapsed / (s.peak_flops[0] * mesh.world_size), step_time_s=elapsed)
        last = step == end - 1
        if s.val_windows is not None and _due(step + 1, o.val_every, last):
            record["val_loss"] = validation_loss(s)
        for kind, mib in record["memory_mib"].items():
            result.peak_memory_mib[kind] = max(mib, result.peak_memory_mib.get(kind, 0.0))
        snapshot.after_step(record["memory_mib"])
        result.records.append(record)
        for sink in sinks:
            sink.write(record)
        s.poll_saves(step + 1)
        if o.save and _due(step + 1, o.save_every, last):
            s.save(step + 1)
            saved_step = step + 1
        if progress is not None:
            progress.set_postfix(loss=f"{record['loss']:.3f}", tok_s=f"{record['tokens_per_s']:.0f}",
                                 mfu=f"{100 * record['mfu']:.1f}%")
            progress.update(1)
    s.finish_saves(s.start_step + len(result.records))  # the run never ends with a save uncommitted
