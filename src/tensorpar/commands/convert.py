"""`tensorpar convert SRC DST`: between tensorpar checkpoints and Hugging Face folders, both ways.

A tensorpar checkpoint (of any layout) becomes a Hugging Face folder (config.json + model.safetensors
that transformers loads); a Hugging Face folder becomes a one-shard tensorpar checkpoint that any
layout can load or resume from. Weights are copied bit for bit; DST must not exist or be empty.
"""

from __future__ import annotations

import os

from tensorpar.errors import TensorparError


def add_parser(sub) -> None:
    p = sub.add_parser("convert", help="convert between tensorpar checkpoints and Hugging Face folders")
    p.add_argument("source", help="a tensorpar checkpoint or a Hugging Face model folder")
    p.add_argument("dest", help="the folder to write (must not exist, or be empty)")
    p.add_argument("--to", choices=["hf", "tensorpar"], default=None,
                   help="output format (default: the other one)")
    p.set_defaults(run=run)


def run(args, argv) -> int:
    from tensorpar.models.checkpoint_io import load_model_source
    from tensorpar.models.hf import is_hf_folder, save_hf_folder
    from tensorpar.training.checkpoint import is_checkpoint, write_dense_checkpoint

    source_is_hf = is_hf_folder(args.source)
    if not source_is_hf and not (os.path.isdir(args.source) and is_checkpoint(args.source)):
        if not os.path.exists(args.source):
            raise TensorparError(f"'{args.source}' does not exist")
        raise TensorparError(f"'{args.source}' is neither a tensorpar checkpoint nor a Hugging Face model folder")
    to = args.to or ("tensorpar" if source_is_hf else "hf")
    if os.path.exists(args.dest) and os.listdir(args.dest):
        raise TensorparError(f"'{args.dest}' exists and is not empty: refusing to overwrite it")
    cfg, state = load_model_source(args.source)
    if to == "hf":
        save_hf_folder(args.dest, cfg, state)
    else:
        write_dense_checkpoint(args.dest, cfg, state)
    print(f"wrote {to} {'folder' if to == 'hf' else 'checkpoint'} {args.dest} ({sum(t.numel() for t in state.values()):,} "
          f"parameters, {cfg.family})")
    return 0
