"""`tensorpar convert SRC DST`: between tensorpar checkpoints and Hugging Face folders, both ways.

A tensorpar checkpoint (of any layout) becomes a Hugging Face folder (config.json + model.safetensors
that transformers loads, with the tokenizer the run used: its files, or the byte-level default written as a
tokenizer.json, and generation_config.json); a Hugging Face folder becomes a one-shard tensorpar checkpoint that any
layout can load or resume from, carrying the folder's tokenizer files. Weights are copied bit for bit; DST must not
exist or be empty.
"""

from __future__ import annotations

import os

from tensorpar.checkpoints.hf import is_hf_folder, save_hf_folder
from tensorpar.checkpoints.sharded import is_checkpoint, write_dense_checkpoint
from tensorpar.checkpoints.sources import checkpoint_tokenizer, load_model_source, tokenizer_files
from tensorpar.config.fields import add_options, options_from_args
from tensorpar.config.options import ConvertOptions
from tensorpar.errors import TensorparError


def add_parser(sub) -> None:
    p = sub.add_parser("convert", help="convert between tensorpar checkpoints and Hugging Face folders")
    add_options(p, ConvertOptions)
    p.set_defaults(run=run)


def run(args, argv) -> int:
    options = options_from_args(ConvertOptions, args, "convert")
    source_is_hf = is_hf_folder(options.source)
    if not source_is_hf and not (os.path.isdir(options.source) and is_checkpoint(options.source)):
        if not os.path.exists(options.source):
            raise TensorparError(f"'{options.source}' does not exist")
        raise TensorparError(f"'{options.source}' is neither a tensorpar checkpoint nor a Hugging Face model folder")
    to = options.to or ("tensorpar" if source_is_hf else "hf")
    if os.path.exists(options.dest) and os.listdir(options.dest):
        raise TensorparError(f"'{options.dest}' exists and is not empty: refusing to overwrite it")
    cfg, state = load_model_source(options.source)
    if to == "hf":
        tokenizer = checkpoint_tokenizer(options.source, cfg)
        save_hf_folder(options.dest, cfg, state, tokenizer)
        carried = "no tokenizer: the checkpoint does not say which it was trained with" if tokenizer is None else \
            f"tokenizer {tokenizer.name}"
    else:
        files = tokenizer_files(options.source)
        write_dense_checkpoint(options.dest, cfg, state, tokenizer_files=files)
        carried = f"tokenizer files {', '.join(sorted(files))}" if files else "no tokenizer files"
    print(f"wrote {to} {'folder' if to == 'hf' else 'checkpoint'} {options.dest} ({sum(t.numel() for t in state.values()):,} "
          f"parameters, {cfg.family}; {carried})")
    return 0
