"""What a training run builds on each rank, in order: the model (this rank's shard of this rank's stage), the
data, the optimizer, the state of a resumed checkpoint, and the pipeline executor."""

from __future__ import annotations

import dataclasses
import os
import sys
import uuid

import torch

from tensorpar.checkpoints.async_save import AsyncCheckpointer
from tensorpar.checkpoints.peft_adapter import read_adapter
from tensorpar.checkpoints.sharded import load_checkpoint, save_checkpoint
from tensorpar.checkpoints.sources import load_model_source
from tensorpar.config.fields import changed_options, to_dict, to_toml
from tensorpar.config.memory_levers import MemoryLevers
from tensorpar.data import build_dataset, describe_corpus, open_corpus, validation_windows
from tensorpar.data.tokenizer_files import source_files
from tensorpar.data_parallel import BucketedOptimizer, FullyShardedOptimizer, data_parallel_optimizer
from tensorpar.data_parallel.host_masters import host_step_threads_warning
from tensorpar.distributed.launch import usable_cpus
from tensorpar.distributed.mesh import Mesh
from tensorpar.models import Transformer
from tensorpar.models.build import Execution, build_transformer
from tensorpar.optim.loss_scaler import DynamicLossScaler
from tensorpar.layout import ParallelLayout
from tensorpar.pipeline_parallel.runner import PipelineRunner
from tensorpar.training.instruction_data import build_instruction_data
from tensorpar.training.activation_offload import HostActivations
from tensorpar.training.memory_meter import ActivationMeter
from tensorpar.training.mfu import peak_flops
from tensorpar.training.stop import GracefulStop
from tensorpar.training.validate import PreparedRun, run_tokenizer

# Options that say how this invocation runs, not what it computes: a resumed run is expected to differ in them.
_INVOCATION_OPTIONS = ("resume", "nproc", "device", "timeout", "grace_period", "progress", "stop_after",
                       "return_state", "tensorboard", "wandb", "wandb_run", "memory_snapshot", "async_save")
# Options whose change makes the continued samples (and losses) differ from the original run's: val_fraction decides
# which windows of --data are trained on (none is held out beside --val-data).
_DATA_ORDER_OPTIONS = ("seed", "global_batch_size", "seq_len", "val_fraction")


@dataclasses.dataclass
class Session:
    """One rank's share of a training run."""

    run: PreparedRun
    mesh: Mesh
    model: Transformer
    optimizer: BucketedOptimizer | FullyShardedOptimizer
    tokenizer: object
    dataset: object  # a TokenDataset, or a MixtureDataset for a weighted mixture of sources
    val_windows: torch.Tensor | None
    runner: PipelineRunner | None
    start_step: int
    peak_flops: tuple[float, str]  # one rank's peak FLOP/s for MFU, and where the figure comes from
    stop: GracefulStop | None = None  # stop signals, when the caller handles them (the command line does)
    run_id: str = ""  # the run's checkpoints carry it: rotation deletes only this run's
    activations: ActivationMeter = dataclasses.field(default_factory=ActivationMeter)
    scaler: DynamicLossScaler | None = None  # fp16's dynamic loss scale
    corpus: list | None = None  # [(weight, TokenStream)] of --data: recorded in every checkpoint
    async_saves: AsyncCheckpointer | None = None  # --async-save: saves written by a background thread

    @property
    def options(self):
        return self.run.options

    @property
    def layout(self) -> ParallelLayout:
        """The run's layout: what its checkpoints record and its summary reports."""
        return self.run.layout

    @property
    def is_main(self) -> bool:
        return self.mesh.rank == 0

    def save(self, step: int) -> str:
        """Save step `step`'s checkpoint (a collective: every rank calls it); its folder. With --async-save the
        save is only started (a pending one committed first): `poll_saves` and `finish_saves` commit it."""
        o = self.options
        train = {k: getattr(o, k) for k in ("seed", "global_batch_size", "seq_len", "lr", "min_lr", "warmup_steps",
                                            "steps", "weight_decay", "grad_clip", "data", "lr_schedule",
                                            "decay_fraction", "decay_shape", "optimizer")}
        if self.scaler is not None:
            train["loss_scaler"] = self.scaler.state_dict()
        if self.corpus is not None:
            train["data_sources"] = describe_corpus(o.data, self.corpus, self.dataset, step, o.global_batch_size)
        lora = self.run.lora.as_dict() if self.run.lora is not None else None
        if self.async_saves is not None:
            facts = dict(model=self.run.cfg.to_dict(), run_id=self.run_id, layout=self.layout.as_dict(), train=train,
                         options=to_dict(o), tokenizer_files=source_files(self.tokenizer),
                         tokenizer_unknown=self.run.tokenizer_unknown, lora=lora)
            return self.async_saves.save(o.save, step, self.model, self.optimizer, facts, o.keep_last)
        return save_checkpoint(o.save, step, self.model, self.optimizer, self.mesh, cfg=self.run.cfg,
                               layout=self.layout.as_dict(), train=train, options=to_dict(o), run_id=self.run_id,
                               keep_last=o.keep_last, tokenizer_files=source_files(self.tokenizer),
                               tokenizer_unknown=self.run.tokenizer_unknown, lora=lora)

    def poll_saves(self, steps_done: int) -> None:
        """After a step: commit the pending asynchronous save if every rank has written it (a collective while
        one is pending)."""
        if self.async_saves is not None:
            self.async_saves.poll(steps_done)

    def finish_saves(self, steps_done: int) -> None:
        """Wait for the pending asynchronous save and commit it (a collective)."""
        if self.async_saves is not None:
            self.async_saves.wait(steps_done)


def build_model(run: PreparedRun, mesh: Mesh, meta: bool = False) -> tuple[Transformer, object]:
    """(this rank's part of the model, the tokenizer): seeded initial weights, or those of `init_from`. Under a
    pipeline schedule that splits the backward (zb-h1, zbv) the model's layers leave their weight gradients in
    its `region.weight_grads` queue, which the pipeline runner empties. `meta`: on the meta device, no values
    (`--dry-run`). With LoRA (`run.lora`) every weight but the adapters' is frozen; the adapters start as PEFT's, or
    from --lora-adapter's folder."""
    o = run.options
    weights = load_model_source(o.init_from)[1] if o.init_from and not meta else None
    if o.lora_adapter and not meta:
        weights = {**weights, **read_adapter(o.lora_adapter, run.cfg)[1]}
    model = build_transformer(run.cfg, mesh, run.layout, run.precision, Execution.of(o), seed=o.seed,
                              weights=weights, source=o.init_from or "state dict", meta=meta, lora=run.lora)
    model.train()
    return model, run_tokenizer(o)


def build_data(run: PreparedRun, tokenizer) -> tuple[object, torch.Tensor | None, list]:
    """(the training dataset, the validation windows or None, the sources [(weight, TokenStream)] of --data).
    With --val-data the validation windows come from it and --data is all training."""
    o = run.options
    examples = build_instruction_data(o, tokenizer, run.cfg.vocab_size)  # conversations, prompt/completion rows
    if examples is not None:
        return (*examples, None)
    kw = dict(text_field=o.text_field, bin_dtype=o.bin_dtype, cache_dir=o.data_cache, progress=False)
    corpus = open_corpus(o.data, tokenizer, run.cfg.vocab_size, **kw)
    dataset = build_dataset(corpus, o.seq_len, 0.0 if o.val_data else o.val_fraction)
    if o.val_data:
        val = validation_windows(open_corpus(o.val_data, tokenizer, run.cfg.vocab_size, **kw), o.seq_len,
                                 o.val_windows)
        return dataset, val, corpus
    return dataset, dataset.val_windows(o.val_windows) if dataset.num_val_windows else None, corpus


def build_optimizer(model, mesh: Mesh, run: PreparedRun) -> BucketedOptimizer | FullyShardedOptimizer:
    """AdamW across the DP (x CP) group: gradients averaged (ZeRO-0), or states, gradients and (ZeRO-3) parameters
    sharded; the masters and states on the host with --optimizer-offload, the moments in --optimizer-state-dtype."""
    o, zero = run.options, run.layout.zero
    stage = ({"reshard_after_forward": o.zero3_reshard_after_forward} if zero == 3
             else {"bucket_bytes": int(o.bucket_mb * 2**20)})
    levers = MemoryLevers.of(o)
    warning = levers.optimizer_offload and host_step_threads_warning(
        mesh.device.type, torch.get_num_threads(), usable_cpus(),
        int(os.environ.get("LOCAL_WORLD_SIZE", mesh.world_size)))
    if warning and mesh.rank == 0:
        sys.stderr.write(f"tensorpar: warning: {warning}\n")
    return data_parallel_optimizer(model, mesh, zero=zero, lr=o.lr, weight_decay=o.weight_decay,
                                   reduce_dtype=run.precision.reduce_dtype, optimizer=o.optimizer,
                                   muon_momentum=o.muon_momentum, offload=levers.optimizer_offload,
                                   state_dtype=levers.state_dtype, **stage)


def warn_if_data_changed(saved: dict | None, corpus: list, spec: str | None) -> None:
    """A warning when the data differs in content from the checkpoint's (the samples will then differ)."""
    if not saved:
        return
    now = describe_corpus(spec, corpus)
    if saved.get("fingerprint") != now["fingerprint"]:
        was = ", ".join(f"{x['weight']:.3g} {x['path']} ({x['tokens']:,} tokens)" for x in saved.get("sources", []))
        new = ", ".join(f"{x['weight']:.3g} {x['path']} ({x['tokens']:,} tokens)" for x in now["sources"])
        sys.stderr.write(f"tensorpar: warning: the training data differs from the checkpoint's (was: {was}; now: "
                         f"{new}): the samples (and the continued losses) will differ from the original run's\n")


def resume(run: PreparedRun, model, optimizer, mesh: Mesh, corpus: list) -> int:
    """Load the checkpoint being resumed into this rank's shards; say what changed since it was saved; its step."""
    o, meta = run.options, run.resume_meta
    load_checkpoint(o.resume, model, optimizer, run.cfg, verify=False)  # validate() hashed the shards
    if mesh.rank == 0:
        saved = meta.get("options") or meta.get("train", {})
        was, now = ({**opts, "val_fraction": 0.0 if opts.get("val_data") else opts.get("val_fraction")}
                    for opts in (saved, to_dict(o)))
        data_order = [f"{k} {was[k]} -> {now[k]}" for k in _DATA_ORDER_OPTIONS if was.get(k) not in (None, now[k])]
        if data_order:
            sys.stderr.write(f"tensorpar: warning: resuming with {', '.join(data_order)}: the samples (and the "
                             f"continued losses) will differ from the original run's\n")
        warn_if_data_changed(meta.get("train", {}).get("data_sources"), corpus, o.data)
        changed = changed_options(saved, o, ignore=_INVOCATION_OPTIONS + _DATA_ORDER_OPTIONS)
        changes = f"; changed since it was saved: {', '.join(changed)}" if changed else ""
        sys.stderr.write(f"tensorpar: resuming '{o.resume}' at step {meta['step']}{changes}\n")
    return meta["step"]


def build_session(run: PreparedRun, mesh: Mesh, stop: GracefulStop | None = None) -> Session:
    o = run.options
    model, tokenizer = build_model(run, mesh)
    dataset, val_windows, corpus = build_data(run, tokenizer)
    optimizer = build_optimizer(model, mesh, run)
    start_step = resume(run, model, optimizer, mesh, corpus) if o.resume else 0
    runner = None
    if mesh.pp_size > 1:
        runner = PipelineRunner(model, mesh, run.layout, run.num_micro_batches,
                                (o.micro_batch_size, run.layout.seq_shard(o.seq_len), run.cfg.hidden_size),
                                activation_dtype=run.precision.param_dtype, weight_grads=model.region.weight_grads)
    if mesh.rank == 0 and o.out_dir:
        write_resolved_config(run, os.path.join(o.out_dir, "config.toml"))
    # One id for the run's checkpoints: a resumed run keeps its checkpoint's, a new one takes rank 0's.
    run_id = mesh.world_group.all_gather_object((run.resume_meta or {}).get("run_id") or uuid.uuid4().hex)[0]
    scaler = None
    if run.precision.loss_scaling:
        scaler = DynamicLossScaler(o.loss_scale, growth_interval=o.loss_scale_window)
        saved = ((run.resume_meta or {}).get("train") or {}).get("loss_scaler")
        if saved:
            scaler.load_state_dict(saved)  # the scale survives a resume
    offload = (HostActivations.of_model(mesh.device, model, o.activation_offload_layers) if o.activation_offload
               else None)
    return Session(run, mesh, model, optimizer, tokenizer, dataset, val_windows, runner, start_step,
                   peak_flops(mesh.device, run.precision.dtype), stop, run_id,
                   activations=ActivationMeter(offload, compiled=o.compile), scaler=scaler, corpus=corpus,
                   async_saves=AsyncCheckpointer(mesh) if o.async_save else None)


_DERIVED = ("dp", "micro_batch_size", "min_lr", "warmup_steps")  # worked out by validate() when not given


def write_resolved_config(run: PreparedRun, path: str) -> str:
    """The run's configuration as a file `tensorpar train --config` reads back: the options as given, and the
    values the run worked out for the ones left to it (as comments, so that the file stays right when the
    world size or the learning rate is changed on the command line)."""
    worked_out = [f"{name} = {getattr(run.options, name)!r}" for name in _DERIVED
                  if getattr(run.requested, name) is None]
    header = (f"tensorpar train: the configuration of this run ({run.world_size} processes).\n"
              f"Run it again with: tensorpar train --config {path}   (a run that saved checkpoints: add "
              f"--resume to continue it, or change --save)" + (f"\nworked out: {', '.join(worked_out)}"
                                                               if worked_out else ""))
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        f.write(to_toml(run.requested, header))
    return path
