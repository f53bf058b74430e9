"""`tensorpar generate`: continue prompts with a checkpoint at any TP size, with a KV cache sharded by heads.

    tensorpar generate --checkpoint DIR [--tp T] (--prompt TEXT ... | --prompt-ids 1,2,3 ...) --max-new-tokens N
                       [--greedy | --temperature T --top-k K --top-p P --seed S] [--json]

Greedy unless a sampling option is given. Several --prompt (or --prompt-ids) flags make one batch.
Prints each prompt's continuation, or with --json one line per prompt:
{"ids": [new token ids], "text": "their text", "tokens_per_s": new tokens of the batch per second}.
Generation stops at the checkpoint's EOS token (generation_config.json / config.json, else the
tokenizer's) unless --ignore-eos. No sequence or pipeline parallelism: the TP group holds the model.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from tensorpar.commands.common import add_layout_args, launch, world_size


def add_parser(sub) -> None:
    p = sub.add_parser("generate", help="generate text from a checkpoint with tensor parallelism and a KV cache")
    p.add_argument("--checkpoint", required=True, help="a Hugging Face model folder (config.json + safetensors)")
    add_layout_args(p)
    p.add_argument("--prompt", action="append", default=None, help="text, tokenised with the checkpoint's tokenizer "
                   "(tokenizer.json, else bytes); repeat for a batch")
    p.add_argument("--prompt-ids", action="append", default=None, help="comma-separated token ids; repeat for a batch")
    p.add_argument("--max-new-tokens", type=int, required=True)
    p.add_argument("--greedy", action="store_true", help="greedy decoding (the default without sampling options)")
    p.add_argument("--temperature", type=float, default=None, help="sample with this temperature (default 1)")
    p.add_argument("--top-k", type=int, default=None, help="sample among the k most likely tokens (0: all)")
    p.add_argument("--top-p", type=float, default=None, help="sample from the nucleus of this probability mass")
    p.add_argument("--seed", type=int, default=None, help="sampling seed (default 0): same seed, same tokens")
    p.add_argument("--ignore-eos", action="store_true", help="always generate --max-new-tokens tokens")
    p.add_argument("--json", action="store_true", help="one JSON line per prompt: ids, text, tokens_per_s")
    p.add_argument("--sequence-parallel", action="store_true", help=argparse.SUPPRESS)  # only to refuse it clearly
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--device", default=None, help="default: this rank's GPU if any, else cpu")
    p.set_defaults(run=run)


def _sampling(args) -> dict:
    from tensorpar.errors import TensorparError

    options = {"--temperature": args.temperature, "--top-k": args.top_k, "--top-p": args.top_p, "--seed": args.seed}
    given = [name for name, value in options.items() if value is not None]
    if args.greedy and given:
        raise TensorparError(f"--greedy takes no sampling options (got {', '.join(given)})")
    return dict(greedy=not given, temperature=1.0 if args.temperature is None else args.temperature,
                top_k=args.top_k or 0, top_p=1.0 if args.top_p is None else args.top_p, seed=args.seed or 0)


def _prompts(args, tokenizer) -> list[list[int]]:
    from tensorpar.errors import TensorparError

    if (args.prompt is None) == (args.prompt_ids is None):
        raise TensorparError("give either --prompt or --prompt-ids (one of them, repeatable)")
    if args.prompt is not None:
        return [tokenizer.encode(text) for text in args.prompt]
    prompts = []
    for text in args.prompt_ids:
        try:
            prompts.append([int(t) for t in text.replace(" ", "").split(",") if t != ""])
        except ValueError:
            raise TensorparError(f"--prompt-ids '{text}' is not a comma-separated list of integers") from None
    return prompts


def _eos_ids(args, tokenizer):
    """The EOS id(s) transformers' generate would stop at: generation_config.json, config.json, the tokenizer."""
    if args.ignore_eos:
        return None
    for name in ("generation_config.json", "config.json"):
        path = os.path.join(args.checkpoint, name)
        if os.path.isfile(path):
            try:
                with open(path) as f:
                    eos = json.load(f).get("eos_token_id")
            except (OSError, ValueError, AttributeError):
                eos = None
            if eos is not None:
                return eos
    from tensorpar.data.tokenizer import HFTokenizer

    return tokenizer.eos_id if isinstance(tokenizer, HFTokenizer) else None  # the byte tokenizer's EOS means nothing here


def _check(args):
    """Everything that can be checked before a rank starts: (config, tokenizer, prompts, sampling, eos)."""
    from tensorpar.data import load_tokenizer
    from tensorpar.errors import LayoutError, TensorparError
    from tensorpar.inference.generate import check_generate_args
    from tensorpar.models.checkpoint_io import load_config
    from tensorpar.models.layout import check_model_layout

    cfg = load_config(args.checkpoint)
    if args.sequence_parallel:
        raise LayoutError("generate runs without sequence parallelism (decoding one token a step has nothing to "
                          "split along the sequence): drop --sequence-parallel")
    if args.pp != 1:
        raise LayoutError(f"generate runs without pipeline parallelism: --pp must be 1, got {args.pp}")
    check_model_layout(cfg, args.tp)
    if world_size(args) != args.tp:
        raise LayoutError(f"generate runs on exactly --tp processes (one tensor-parallel group, no data "
                          f"parallelism): {world_size(args)} processes for --tp {args.tp}")
    if args.max_new_tokens < 1:
        raise TensorparError(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")
    sampling = _sampling(args)
    tokenizer = load_tokenizer(args.checkpoint)
    prompts = _prompts(args, tokenizer)
    check_generate_args(prompts, args.max_new_tokens, cfg.vocab_size,
                        cfg.max_seq_len if cfg.position == "learned" else None,
                        temperature=sampling["temperature"], top_k=sampling["top_k"], top_p=sampling["top_p"])
    return cfg, tokenizer, prompts, sampling, _eos_ids(args, tokenizer)


def run_rank(args) -> int:
    import tensorpar
    from tensorpar.inference.generate import generate
    from tensorpar.models import Transformer, load_full_state_dict
    from tensorpar.models.checkpoint_io import load_model_source
    from tensorpar.training.trainer import _autocast

    _, tokenizer, prompts, sampling, eos = _check(args)
    mesh = tensorpar.init_mesh(tp=args.tp, pp=1, dp=1, device=args.device)
    cfg, state = load_model_source(args.checkpoint)
    model = Transformer(cfg, mesh, init=False)
    load_full_state_dict(model, state, source=args.checkpoint)
    del state
    stats: dict = {}
    with _autocast(mesh.device, args.dtype):
        new = generate(model, prompts, args.max_new_tokens, eos_id=eos, stats=stats, **sampling)
    if mesh.rank == 0:
        for ids in new:
            text = tokenizer.decode(ids)
            if args.json:
                print(json.dumps({"ids": ids, "text": text, "tokens_per_s": round(stats["tokens_per_s"], 2)}))
            else:
                print(text)
        sys.stdout.flush()
        if not args.json:
            sys.stderr.write(f"{stats['new_tokens']} new tokens in {stats['seconds']:.2f} s "
                             f"({stats['tokens_per_s']:.1f} tokens/s, tp={args.tp})\n")
    mesh.destroy()
    return 0


def run(args, argv) -> int:
    _check(args)
    return launch(args, argv, run_rank)
