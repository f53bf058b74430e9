"""`tensorpar eval`: mean next-token loss of a checkpoint on a token stream, at any TP size.

The stream is cut into consecutive non-overlapping windows of L+1 tokens (inputs the first L,
targets the last L), the remainder dropped; `loss` is the mean cross-entropy over all targets.
Prints one JSON line: {"loss", "perplexity", "tokens"}.
"""

from __future__ import annotations

import json
import math
import os

from tensorpar.commands.common import add_layout_args, launch


def add_parser(sub) -> None:
    p = sub.add_parser("eval", help="evaluate a checkpoint's loss on a token stream")
    p.add_argument("--checkpoint", required=True, help="a tensorpar checkpoint or a Hugging Face model folder")
    add_layout_args(p)
    p.add_argument("--data", default=None, help="text, .npy or .bin token file (default: the embedded corpus)")
    p.add_argument("--bin-dtype", choices=["uint16", "int32"], default="uint16")
    p.add_argument("--seq-len", type=int, required=True)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--sequence-parallel", action="store_true")
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--device", default=None)
    p.set_defaults(run=run)


def _check(args):
    from tensorpar.errors import TensorparError
    from tensorpar.models.checkpoint_io import load_config
    from tensorpar.models.layout import check_model_layout

    if args.data and not os.path.exists(args.data):
        raise TensorparError(f"data file '{args.data}' does not exist")
    cfg = load_config(args.checkpoint)
    check_model_layout(cfg, args.tp, args.sequence_parallel, args.seq_len)
    return cfg


def run_rank(args) -> int:
    import tensorpar
    from tensorpar.data import check_vocab, eval_windows, load_tokenizer, load_tokens
    from tensorpar.models import Transformer, load_full_state_dict
    from tensorpar.models.checkpoint_io import load_model_source
    from tensorpar.training.trainer import evaluate

    _check(args)
    mesh = tensorpar.init_mesh(tp=args.tp, pp=args.pp, dp=args.dp, device=args.device)
    cfg, state = load_model_source(args.checkpoint)
    tokens = load_tokens(args.data, load_tokenizer(args.checkpoint), args.bin_dtype)
    check_vocab(tokens, cfg.vocab_size, args.data or "the default corpus")
    windows = eval_windows(tokens, args.seq_len)
    model = Transformer(cfg, mesh, sequence_parallel=args.sequence_parallel, init=False)
    load_full_state_dict(model, state, source=args.checkpoint)
    loss = evaluate(model, windows, args.batch_size, mesh.device, args.dtype)
    if mesh.rank == 0:
        print(json.dumps({"loss": loss, "perplexity": math.exp(loss), "tokens": int(windows[:, 1:].numel())}))
    mesh.destroy()
    return 0


def run(args, argv) -> int:
    _check(args)
    return launch(args, argv, run_rank)
