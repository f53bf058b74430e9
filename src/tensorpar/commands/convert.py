"""`tensorpar convert SRC DST`: between tensorpar checkpoints and Hugging Face folders, both ways.

A tensorpar checkpoint (of any layout) becomes a Hugging Face folder (config.json + model.safetensors
that transformers loads, with the tokenizer the run used: its files, or the byte-level default written as a
tokenizer.json, and generation_config.json); a Hugging Face folder becomes a one-shard tensorpar checkpoint that any
layout can load or resume from, carrying the folder's tokenizer files. Weights are copied bit for bit; DST must not
exist or be empty.

LoRA: `--merge-lora` folds adapters into their weights as PEFT's merge_and_unload does (W + (B @ A) * alpha / r):
those of a LoRA run's checkpoint, or a PEFT adapter folder given with `--lora-adapter` beside the model. Without it,
a LoRA run's checkpoint becomes the Hugging Face folder of its base model with the adapter in DST/adapter (PEFT's
folder), as transformers and PEFT load them.
"""

from __future__ import annotations

import os

from tensorpar.checkpoints.dense_checkpoint import write_dense_checkpoint
from tensorpar.checkpoints.hf import is_hf_folder, save_hf_folder
from tensorpar.checkpoints.hf_config import config_to_hf
from tensorpar.checkpoints.peft_adapter import ADAPTER_FOLDER, merge_adapters, write_adapter
from tensorpar.checkpoints.sharded import is_checkpoint
from tensorpar.checkpoints.sources import checkpoint_tokenizer, load_unmerged
from tensorpar.config.fields import add_options, options_from_args
from tensorpar.config.options import ConvertOptions
from tensorpar.config.command_line import check_output_folder
from tensorpar.data.tokenizer import ByteTokenizer
from tensorpar.data.tokenizer_files import source_files
from tensorpar.errors import TensorparError


def add_parser(sub) -> None:
    p = sub.add_parser("convert", help="convert between tensorpar checkpoints and Hugging Face folders")
    add_options(p, ConvertOptions)
    p.set_defaults(run=run)


def _model(options: ConvertOptions, to: str):
    """(config, the weights to write, the LoRA spec or None, the adapters' weights): a LoRA run's checkpoint or
    --lora-adapter's adapters merged with --merge-lora, else kept apart (for DST/adapter)."""
    if options.lora_adapter and not options.merge_lora:
        raise TensorparError("--lora-adapter is merged into the model by --merge-lora (the adapter alone is a PEFT "
                             "folder already): add --merge-lora")
    cfg, state, lora, adapters = load_unmerged(options.source, options.lora_adapter)
    if options.merge_lora and lora is None:
        raise TensorparError(f"--merge-lora: '{options.source}' holds no LoRA adapters (it is not a LoRA run's "
                             f"checkpoint): give the adapter with --lora-adapter DIR")
    if lora is not None and not options.merge_lora and to == "tensorpar":
        raise TensorparError(f"'{options.source}' is a LoRA run's checkpoint already: --merge-lora writes its merged "
                             f"model as a one-shard checkpoint")
    if options.merge_lora:
        state = merge_adapters({**state, **adapters}, lora)
    return cfg, state, lora, adapters


def run(args, argv) -> int:
    options = options_from_args(ConvertOptions, args, "convert")
    source_is_hf = is_hf_folder(options.source)
    if not source_is_hf and not (os.path.isdir(options.source) and is_checkpoint(options.source)):
        if not os.path.exists(options.source):
            raise TensorparError(f"'{options.source}' does not exist")
        raise TensorparError(f"'{options.source}' is neither a tensorpar checkpoint nor a Hugging Face model folder")
    to = options.to or ("tensorpar" if source_is_hf else "hf")
    check_output_folder(options.dest, "destination")
    if os.path.exists(options.dest) and os.listdir(options.dest):
        raise TensorparError(f"'{options.dest}' exists and is not empty: refusing to overwrite it")
    cfg, state, lora, adapters = _model(options, to)
    if to == "hf":
        tokenizer = checkpoint_tokenizer(options.source, cfg)
        save_hf_folder(options.dest, cfg, state, tokenizer)
        carried = f"tokenizer {tokenizer.name}" if tokenizer is not None else \
            "no tokenizer: the checkpoint does not say which it was trained with" \
            if cfg.vocab_size >= ByteTokenizer.vocab_size else \
            f"no tokenizer: the byte tokenizer's {ByteTokenizer.vocab_size} ids do not fit its vocabulary of " \
            f"{cfg.vocab_size}"
        if lora is not None and not options.merge_lora:
            write_adapter(os.path.join(options.dest, ADAPTER_FOLDER), cfg, lora, adapters)
            carried += f"; its LoRA adapter in {os.path.join(options.dest, ADAPTER_FOLDER)} (PEFT)"
    else:
        tokenizer = checkpoint_tokenizer(options.source, cfg)  # None: the source does not say which
        files = {} if tokenizer is None else source_files(tokenizer)
        write_dense_checkpoint(options.dest, cfg, state, tokenizer_files=files, tokenizer_unknown=tokenizer is None)
        carried = (f"tokenizer files {', '.join(sorted(files))}" if files else "no tokenizer files" if tokenizer is None
                   else "the byte tokenizer")
    merged = ", LoRA merged" if options.merge_lora else ""
    kind = config_to_hf(cfg)["architectures"][0] if to == "hf" else cfg.family  # Mixtral, not its family "llama"
    print(f"wrote {to} {'folder' if to == 'hf' else 'checkpoint'} {options.dest} ({sum(t.numel() for t in state.values()):,} "
          f"parameters, {kind}{merged}; {carried})")
    return 0
