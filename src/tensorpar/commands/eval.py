"""`tensorpar eval`: mean next-token loss of a checkpoint on a token stream, at any TP, CP and (MoE) EP size.

The stream is cut into consecutive non-overlapping windows of L+1 tokens (inputs the first L,
targets the last L), the remainder dropped; `loss` is the mean cross-entropy over all targets.
Prints one JSON line: {"loss", "perplexity", "tokens"}.
"""

from __future__ import annotations

import json
import math
import os

from tensorpar.checkpoints.sources import (check_adapter, load_config, load_model_source, tokenizer_unknown,
                                           unknown_tokenizer_note)
from tensorpar.commands.common import inference_layout, launch
from tensorpar.config import applicability
from tensorpar.config.applicability import DataFacts
from tensorpar.config.fields import add_options, check_choices, options_from_args
from tensorpar.config.options import EvalOptions
from tensorpar.data import (check_vocab, eval_windows, load_tokenizer, open_stream, parse_data_spec, prepare_sources,
                            source_kinds)
from tensorpar.data.streams import TOKEN_ID_KINDS
from tensorpar.distributed.mesh import build_mesh, world_from_env
from tensorpar.errors import LayoutError, TensorparError
from tensorpar.layout import ParallelLayout
from tensorpar.models.build import Execution, build_transformer
from tensorpar.config.precision import Precision
from tensorpar.tensor_parallel.fp8_scaling import check_fp8
from tensorpar.training.evaluate import evaluate


def add_parser(sub) -> None:
    p = sub.add_parser("eval", help="evaluate a checkpoint's loss on a token stream")
    add_options(p, EvalOptions, config_file=True)
    p.set_defaults(run=run)


def validate(options: EvalOptions):
    """Check everything that can be checked before a rank starts: (the options with --ep folded onto the ranks,
    their layout)."""
    check_choices(options)
    check_fp8(options.dtype, options.device)
    if options.batch_size < 1:
        raise TensorparError(f"--batch-size must be at least 1 window, got {options.batch_size}")
    if options.pp != 1:
        raise LayoutError(f"eval runs without pipeline parallelism (each rank runs every layer of its TP shard): "
                          f"--pp must be 1, got {options.pp}")
    if len(parse_data_spec(options.data)) > 1:
        raise TensorparError(f"tensorpar eval takes one data source, not the mixture '{options.data}'")
    cfg = load_config(options.checkpoint)
    kinds = source_kinds(options.data)
    applicability.check("eval", options, cfg=cfg, data=DataFacts(kinds=kinds))
    if not kinds <= TOKEN_ID_KINDS and tokenizer_unknown(options.checkpoint):
        raise TensorparError(f"{unknown_tokenizer_note(options.checkpoint)}: give --data token ids (.npy, .bin, a "
                             f"Megatron dataset) made by its tokenizer")
    check_adapter(options.checkpoint, options.lora_adapter)
    layout = inference_layout(options, cfg, seq_len=options.seq_len)
    prepare_sources(options.data, tokenizer=load_tokenizer(options.checkpoint), text_field=options.text_field,
                    cache_dir=options.data_cache, progress=os.environ.get("RANK", "0") == "0")
    return layout


def evaluate_checkpoint(options: EvalOptions, layout: ParallelLayout | None = None) -> dict:
    """{"loss", "perplexity", "tokens"} of the checkpoint on the data (every rank of the running world); `layout`:
    the one `validate` checked (None: the options' on the running world)."""
    cfg = load_config(options.checkpoint)
    layout = layout or ParallelLayout.from_options(options, world_from_env()[0])
    precision = Precision.of(options, training=False)
    mesh = build_mesh(layout, moe=cfg.is_moe, device=options.device, backend=options.backend, timeout=options.timeout)
    try:
        cfg, state = load_model_source(options.checkpoint, options.lora_adapter)
        source = parse_data_spec(options.data)[0][1]  # --data's one source: a mix.toml's (or "1 PATH"'s) path
        tokens = open_stream(source, load_tokenizer(options.checkpoint), text_field=options.text_field,
                             bin_dtype=options.bin_dtype, cache_dir=options.data_cache, progress=False).tokens
        check_vocab(tokens, cfg.vocab_size, options.data or "the default corpus")
        windows = eval_windows(tokens, options.seq_len)
        model = build_transformer(cfg, mesh, layout, precision, Execution.of(options), weights=state,
                                  source=options.checkpoint)
        loss = evaluate(model, windows, options.batch_size, mesh.device, precision, dp_group=mesh.dp_group)
        return {"loss": loss, "perplexity": math.exp(loss), "tokens": int(windows[:, 1:].numel())}
    finally:
        mesh.destroy()


def run(args, argv) -> int:
    options, layout = validate(options_from_args(EvalOptions, args, "eval"))

    def run_rank() -> int:
        result = evaluate_checkpoint(options, layout)
        if int(os.environ.get("RANK", "0")) == 0:
            print(json.dumps(result))
        return 0

    return launch(options, argv, run_rank)
