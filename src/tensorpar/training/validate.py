"""Everything a training run can check before any process group exists: done once per process.

`validate` turns `TrainOptions` into a `PreparedRun`: the options with every default the program
works out filled in (dp, micro-batch size, warmup, final learning rate), the run's `ParallelLayout` (checked
against the model, the sequence and the batch: `ParallelLayout.problems`), the model's config, and the metadata
of the checkpoint being resumed (its shards hashed once, here).
"""

from __future__ import annotations

import dataclasses
import math
import os

import torch

from tensorpar.checkpoints.hf import is_hf_folder
from tensorpar.checkpoints.sharded import is_checkpoint, newest_checkpoint, read_meta
from tensorpar.checkpoints.sources import load_config, tokenizer_unknown, unknown_tokenizer_note
from tensorpar.config import applicability
from tensorpar.config.applicability import DataFacts
from tensorpar.config.fields import check_choices
from tensorpar.config.memory_levers import MemoryLevers
from tensorpar.config.options import TrainOptions
from tensorpar.config.command_line import check_output_file, check_output_folder, check_text
from tensorpar.config.precision import Precision
from tensorpar.data import prepare_sources, source_kinds, tokenizer_from
from tensorpar.data.streams import TOKEN_ID_KINDS, foreign_ids
from tensorpar.distributed.launch import world_size as launched_world_size
from tensorpar.distributed.mesh import check_backend
from tensorpar.errors import TensorparError
from tensorpar.functional.varlen_attention import check_document_attention
from tensorpar.layout import ParallelLayout
from tensorpar.models import ModelConfig, get_config
from tensorpar.optim.lr_schedule import check_wsd
from tensorpar.optim.muon import check_muon
from tensorpar.tensor_parallel.fp8_scaling import check_fp8
from tensorpar.tensor_parallel.lora import LoraSpec
from tensorpar.training.adapters import lora_spec
from tensorpar.training.instruction_data import check_instruction_data
from tensorpar.training.metric_sinks import check_sink_packages
from tensorpar.training.profiling import parse_profile_ranks, parse_profile_steps, resumed_past_profile_note


@dataclasses.dataclass(frozen=True)
class PreparedRun:
    """A validated training run: what every rank builds its part from."""

    options: TrainOptions  # resolved: dp, micro_batch_size, min_lr and warmup_steps are never None
    requested: TrainOptions  # as given (flags, --config, defaults): what running the same command again gives
    layout: ParallelLayout  # checked against the model, the sequence and the batch
    precision: Precision  # --dtype, --fp8-recipe and --grad-reduce-dtype as one value
    cfg: ModelConfig  # the model to train (dropout from the options)
    resume_meta: dict | None  # the metadata of the checkpoint resumed from, if any
    world_size: int
    notes: tuple[str, ...] = ()  # what the user should hear once (e.g. "no checkpoint yet: starting from scratch")
    lora: LoraSpec | None = None  # LoRA adapters on the linears, every other weight frozen (None: all weights train)
    tokenizer_unknown: bool = False  # --data is token ids the run lacks the tokenizer of (`foreign_ids`): its
    # checkpoints say so, and carry no tokenizer

    @property
    def num_micro_batches(self) -> int:
        return self.layout.num_micro_batches(self.options.global_batch_size, self.options.micro_batch_size)


def model_config(options: TrainOptions) -> ModelConfig:
    """The model's config alone (cheap): the checkpoint being resumed, the `init_from` folder, or the preset or
    config file `model` names; dropout from the options."""
    if options.resume:
        cfg = ModelConfig(**read_meta(options.resume, verify=False)[1]["model"])
    elif options.init_from:
        cfg = load_config(options.init_from)
    else:
        cfg = get_config(options.model)
    return cfg.replace(dropout=options.dropout)


def _first_start(o: TrainOptions) -> bool:
    """Whether a `--resume` folder without a checkpoint is the first start of its run (which starts from scratch):
    the folder exists (empty, or a save was killed before its first checkpoint) or the run saves there.
    A path that exists nowhere else is a typo, refused as before."""
    return os.path.isdir(o.resume) or bool(o.save and os.path.realpath(o.save) == os.path.realpath(o.resume))


def _first_start_note(o: TrainOptions) -> str:
    """What a first start from a `--resume` folder without a checkpoint says; a run that saves nowhere would start
    from step 0 again at every restart, so it is told how to make the same command continue."""
    note = f"--resume {o.resume}: no checkpoint there yet; starting from step 0"
    if not o.save:
        note += (f" (warning: without --save this run writes no checkpoint, so the same command starts from step 0 "
                 f"again: add --save {o.resume})")
    return note


def _check_save_folder(o: TrainOptions) -> None:
    """A run saves into a folder of its own: one that holds no checkpoint, or the one it resumes from."""
    if o.async_save and not o.save:
        raise TensorparError("--async-save needs --save DIR")
    check_output_folder(o.save, "--save folder")
    if not o.save or not is_checkpoint(o.save):
        return
    if o.resume:
        resumed = os.path.realpath(o.resume)
        if os.path.realpath(o.save) in (resumed, os.path.dirname(resumed)):
            return
    newest = newest_checkpoint(o.save) or o.save
    raise TensorparError(f"--save folder '{o.save}' already holds checkpoints of a run (newest: '{newest}'): "
                         f"continue that run with --resume {o.save}, or save to another folder")


def _check_observability(o: TrainOptions) -> None:
    """--profile-steps A:B within the run, written to OUT_DIR (the ranks are checked once the world is known); a
    --spike-factor that is not negative; --memory-snapshot on a CUDA device, written to OUT_DIR; the packages of
    --tensorboard and --wandb installed."""
    check_output_folder(o.out_dir, "--out-dir")
    check_output_folder(o.tensorboard, "--tensorboard folder")
    check_output_file(o.metrics, "--metrics file")
    check_text(o.sample_prompt, "--sample-prompt")
    check_sink_packages(o)
    if o.memory_snapshot:
        device = torch.device(o.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if device.type != "cuda":
            raise TensorparError(f"--memory-snapshot records the CUDA caching allocator: it needs a CUDA device, and "
                                 f"this run's is {device.type}")
        if o.out_dir is None:
            raise TensorparError("--memory-snapshot writes to OUT_DIR/memory: give --out-dir")
    if o.spike_factor < 0:
        raise TensorparError(f"--spike-factor must be 0 (off) or positive, got {o.spike_factor}")
    if parse_profile_steps(o.profile_steps, o.steps) is not None and o.out_dir is None:
        raise TensorparError("--profile-steps writes its traces to OUT_DIR/profile: give --out-dir")
    if o.profile_ranks is not None and o.profile_steps is None:
        raise TensorparError("--profile-ranks needs --profile-steps A:B")


def _check_optimization(o: TrainOptions, cfg: ModelConfig) -> None:
    """The learning rates, weight decay and clipping within their ranges (a NaN, an infinity or a negative would
    fail only once a rank steps, or train on NaN); WSD's warmup and decay fit in the run; Muon's momentum, and a
    model it trains; the loss scale; the memory levers apply."""
    for flag, value in (("--lr", o.lr), ("--min-lr", o.min_lr), ("--weight-decay", o.weight_decay),
                        ("--grad-clip", o.grad_clip)):
        if value is not None and not 0 <= value < math.inf:
            raise TensorparError(f"{flag} must be a number >= 0, got {value}"
                                 + (" (0: no clipping)" if flag == "--grad-clip" else ""))
    if o.min_lr is not None and o.min_lr > o.lr:
        raise TensorparError(f"--min-lr {o.min_lr} must not exceed --lr {o.lr}")
    if o.lr_schedule == "wsd":
        check_wsd(o.steps, min(100, o.steps // 10) if o.warmup_steps is None else o.warmup_steps, o.decay_fraction)
    check_muon(o.optimizer, o.muon_momentum, cfg.is_moe)
    if not (math.isfinite(o.loss_scale) and o.loss_scale > 0):
        raise TensorparError(f"--loss-scale must be a positive number, got {o.loss_scale}")
    if o.loss_scale_window < 1:
        raise TensorparError(f"--loss-scale-window must be at least 1 step, got {o.loss_scale_window}")
    for problem in MemoryLevers.of(o).problems(o.optimizer, o.recompute, cfg.num_layers):
        raise TensorparError(problem)


def _prepare_data(o: TrainOptions, tokenizer, cfg: ModelConfig) -> bool:
    """Instruction rows are checked, the options that act on some data only checked against it, and document sources
    tokenized here, once (the ranks then open the cache). Returns whether --data is token ids the run lacks the
    tokenizer of (`foreign_ids`), decided here once: a save never looks at the data again."""
    kinds = source_kinds(o.data) | (source_kinds(o.val_data) if o.val_data else frozenset())  # a missing one: refused
    examples = check_instruction_data(o, tokenizer, cfg.vocab_size)
    applicability.check("train", o, cfg=cfg, data=DataFacts(examples, kinds))
    # A checkpoint that says so (a Hugging Face folder without tokenizer.json may be a fresh model to train on bytes)
    model = o.init_from or o.resume
    if (not o.tokenizer and model and not is_hf_folder(model) and tokenizer_unknown(model)
            and not kinds <= TOKEN_ID_KINDS):
        raise TensorparError(f"{unknown_tokenizer_note(model)}: give {_data(o)} as token ids made by its tokenizer, "
                             f"or that tokenizer with --tokenizer")
    foreign = foreign_ids(o.data, tokenizer, cfg.vocab_size)
    if foreign:
        for flag, given, why in (
                (f"--sample-tokens {o.sample_tokens}", o.sample_tokens > 0,
                 "to turn the prompt into such ids and the sample back into text"),
                ("--document-mask", o.document_mask,
                 f"its EOS id ends the documents; the byte tokenizer's {tokenizer.eos_id} means nothing in a "
                 f"vocabulary of {cfg.vocab_size}")):
            if given:
                raise TensorparError(f"{flag} needs the tokenizer that made the token ids of {_data(o)} ({why}): "
                                     f"give it with --tokenizer (a tokenizer.json, or a folder holding one)")
    if examples is None:
        prepare_sources(o.data, o.val_data, tokenizer=tokenizer, text_field=o.text_field,
                        cache_dir=o.data_cache, progress=o.progress and os.environ.get("RANK", "0") == "0")
    return foreign


def run_tokenizer(o: TrainOptions):
    """The run's tokenizer: --tokenizer's, else the one --init-from's model (or the checkpoint a run resumes from)
    carries, else the byte tokenizer."""
    return tokenizer_from(o.tokenizer, o.init_from or o.resume)


def _data(o: TrainOptions) -> str:
    return f"--data '{o.data}'" + (f" and --val-data '{o.val_data}'" if o.val_data else "")


def _check_document_mask(o: TrainOptions, tokenizer, cfg: ModelConfig) -> None:
    """The kernel of attention within documents runs here; --document-mask finds the documents by the tokenizer's EOS
    id: one there must be, inside the vocabulary."""
    check_document_attention(o.document_attention, o.device, o.dropout)
    if cfg.is_mla and o.document_mask and o.document_attention not in ("auto", "dense"):
        raise TensorparError(f"--document-attention {o.document_attention}: latent attention masks documents with "
                             f"the dense kernel only (its values are narrower than its keys); use auto or dense")
    if not o.document_mask:
        return
    eos = getattr(tokenizer, "eos_id", None)
    if eos is None:
        raise TensorparError(f"--document-mask ends each document at the tokenizer's EOS token, and the tokenizer "
                             f"{tokenizer.name!r} names none: give a --tokenizer whose "
                             f"tokenizer_config.json names its eos_token, or drop --document-mask")
    if not 0 <= eos < cfg.vocab_size:
        raise TensorparError(f"--document-mask: the tokenizer's EOS id {eos} is outside the model's vocabulary of "
                             f"{cfg.vocab_size}, so no document would ever end: use the model's own tokenizer")


def _check_numbers(o: TrainOptions) -> None:
    """Sizes and counts within their ranges; --save-every with a folder to save in."""
    if o.bucket_mb <= 0:
        raise TensorparError(f"--bucket-mb must be positive, got {o.bucket_mb}")
    if o.loss_chunk_tokens < 0:
        raise TensorparError(f"--loss-chunk-tokens must be 0 (off) or a number of tokens, "
                             f"got {o.loss_chunk_tokens}")
    if o.save_every and not o.save:
        raise TensorparError("--save-every needs --save DIR")
    if o.val_windows < 1:  # none evaluated would report a validation loss of 0
        raise TensorparError(f"--val-windows must be at least 1, got {o.val_windows} (a run without validation: "
                             f"--val-fraction 0 and no --val-data)")
    if o.warmup_steps is not None and not 0 <= o.warmup_steps <= o.steps:
        raise TensorparError(f"--warmup-steps must be between 0 and --steps ({o.steps}), got {o.warmup_steps}")


def _positions_note(o: TrainOptions, cfg: ModelConfig) -> list[str]:
    """What a user should hear when training a rotary model past its max_position_embeddings (learned positions
    are refused by the layout check): the positions beyond it were never trained, and transformers (like the
    model's own config) will still say the model takes only max_seq_len."""
    if cfg.position == "learned" or o.seq_len <= cfg.max_seq_len:
        return []
    return [f"warning: --seq-len {o.seq_len} is past the model's {cfg.max_seq_len} positions: rotary positions "
            f"beyond {cfg.max_seq_len} extrapolate; to extend the context, raise its max_position_embeddings "
            f"(max_seq_len in a tensorpar config) and its rope scaling"]


def _resume_meta(o: TrainOptions) -> dict:
    """The metadata of the checkpoint --resume names (every shard present, complete and unchanged), refused where it
    cannot continue the run."""
    _, meta = read_meta(o.resume)
    if meta.get("weights_only"):
        raise TensorparError(f"checkpoint '{o.resume}' holds weights only (saved without an optimizer): start "
                             f"from them with --init-from {o.resume}")
    if meta["step"] >= o.steps:
        raise TensorparError(f"checkpoint '{o.resume}' is at step {meta['step']} and --steps is {o.steps}: nothing "
                             f"left to train (--steps is the total step count)")
    return meta


def validate(options: TrainOptions, world_size: int | None = None) -> PreparedRun:
    """Check `options` against the model and a world of `world_size` processes (default: the launcher's, else
    nproc or tp x cp x pp x dp); raise TensorparError naming what is wrong, or return the PreparedRun."""
    o = options
    check_choices(o)
    if not o.dry_run:  # a device this machine has, before anything reads it (a dry run builds on the meta device)
        check_backend(o.device, o.backend)
    if o.steps < 1:
        raise TensorparError(f"--steps must be at least 1, got {o.steps}")
    if o.micro_batch_size is not None and o.micro_batch_size < 1:
        raise TensorparError(f"--micro-batch-size must be at least 1 (or left out: the global batch / dp, 1 with "
                             f"--pp > 1), got {o.micro_batch_size}")
    notes = []
    if o.resume and o.init_from:
        raise TensorparError("--resume and --init-from exclude each other")
    if o.resume and not is_checkpoint(o.resume) and _first_start(o):
        # One command serves the first start and every restart of a crash-restart loop.
        notes.append(_first_start_note(o))
        o = dataclasses.replace(o, resume=None)
    if o.resume and not os.path.exists(o.resume):  # a typo, unless it is where the run saves (above)
        raise TensorparError(f"checkpoint '{o.resume}' does not exist (a --resume folder not made yet starts the run "
                             f"only when it is also the --save folder: add --save {o.resume})")
    resume_meta = None
    if o.resume:
        resume_meta = _resume_meta(o)
        saved_model = (resume_meta.get("options") or {}).get("model")
        if saved_model and saved_model != o.model:  # the checkpoint's model trains on, whatever --model says
            notes.append(f"--resume {o.resume}: continuing the checkpoint's model '{saved_model}'; --model "
                         f"'{o.model}' is not used")
            o = dataclasses.replace(o, model=saved_model)
    _check_save_folder(o)
    _check_numbers(o)
    _check_observability(o)
    cfg = model_config(o)
    _check_optimization(o, cfg)
    lora = lora_spec(o, cfg, resume_meta)
    world = world_size if world_size is not None else launched_world_size(o)
    parse_profile_ranks(o.profile_ranks, world)
    layout = ParallelLayout.from_options(o, world)
    # a pipeline needs micro-batches to overlap its stages: one sequence each by default, as torchtitan's
    micro = o.micro_batch_size or (1 if layout.pp > 1 else o.global_batch_size // layout.dp)
    precision = Precision.of(o)
    layout.check(cfg, seq_len=o.seq_len, global_batch=o.global_batch_size, micro_batch_size=micro,
                 fp8=precision.fp8)
    check_fp8(o.dtype, o.device)
    notes += _positions_note(o, cfg) + resumed_past_profile_note(o, resume_meta)
    applicability.check("train", o, cfg=cfg)  # the options that act beside others, or on some models only
    tokenizer = run_tokenizer(o)
    _check_document_mask(o, tokenizer, cfg)
    foreign = _prepare_data(o, tokenizer, cfg)
    resolved = dataclasses.replace(
        o, dp=layout.dp, micro_batch_size=micro, min_lr=o.lr / 10 if o.min_lr is None else o.min_lr,
        val_every=o.val_every if o.eval_every is None else o.eval_every,
        warmup_steps=min(100, o.steps // 10) if o.warmup_steps is None else o.warmup_steps)
    return PreparedRun(resolved, options, layout, precision, cfg, resume_meta, world, tuple(notes), lora, foreign)
