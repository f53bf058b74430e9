"""`tensorpar generate`: continue prompts with a checkpoint at any TP size, with a KV cache sharded by heads.

    tensorpar generate --checkpoint DIR [--tp T] [--ep E] (--prompt TEXT ... | --prompt-ids 1,2,3 ...)
                       --max-new-tokens N [--greedy | --temperature T --top-k K --top-p P --seed S] [--json]

Greedy unless a sampling option is given. Several --prompt (or --prompt-ids) flags make one batch.
Prints each prompt's continuation, or with --json one line per prompt:
{"ids": [new token ids], "text": "their text", "tokens_per_s": new tokens of the batch per second}. A model whose
tokenizer is unknown (`tensorpar.checkpoints.sources.tokenizer_unknown`) takes --prompt-ids only and prints ids
(comma-separated; "text" null).
Generation stops at the checkpoint's EOS token (generation_config.json / config.json, else the
tokenizer's) unless --ignore-eos. No sequence or pipeline parallelism: the TP group holds the model. A
mixture-of-experts model takes --ep N (and --expert-tp X): its experts spread over N ranks (each expert's MLP split
over X) folded onto replicas of the TP group (fold / gcd(tp, fold) of them, fold = ep x expert-tp, unless --dp
says), which all generate the same tokens.
"""

from __future__ import annotations

import json
import os
import sys

from tensorpar.checkpoints.sources import (check_adapter, load_config, load_model_source, tokenizer_unknown,
                                           unknown_tokenizer_note)
from tensorpar.commands.common import decoding_layout, launch
from tensorpar.config import applicability
from tensorpar.config.fields import add_options, check_choices, options_from_args
from tensorpar.config.options import GenerateOptions
from tensorpar.config.command_line import check_text
from tensorpar.data import load_tokenizer
from tensorpar.data.tokenizer import HFTokenizer, text_after, tokenizer_folder
from tensorpar.distributed.mesh import build_mesh, world_from_env
from tensorpar.errors import TensorparError
from tensorpar.layout import ParallelLayout
from tensorpar.inference.generation import check_generate_args, generate
from tensorpar.models.build import build_transformer
from tensorpar.config.precision import Precision
from tensorpar.tensor_parallel.fp8_scaling import check_fp8


def add_parser(sub) -> None:
    p = sub.add_parser("generate", help="generate text from a checkpoint with tensor parallelism and a KV cache")
    add_options(p, GenerateOptions, config_file=True)
    p.set_defaults(run=run)


def _sampling(options) -> dict:
    flags = {"--temperature": options.temperature, "--top-k": options.top_k, "--top-p": options.top_p,
             "--seed": options.seed, "--min-p": options.min_p}
    given = [name for name, value in flags.items() if value is not None]
    if options.greedy and given:
        raise TensorparError(f"--greedy takes no sampling options (got {', '.join(given)})")
    return dict(greedy=not given, temperature=1.0 if options.temperature is None else options.temperature,
                top_k=options.top_k or 0, top_p=1.0 if options.top_p is None else options.top_p, seed=options.seed or 0,
                min_p=options.min_p or 0.0, repetition_penalty=options.repetition_penalty,
                presence_penalty=options.presence_penalty, frequency_penalty=options.frequency_penalty)


def _prompts(options, tokenizer) -> list[list[int]]:
    if (options.prompt is None) == (options.prompt_ids is None):
        raise TensorparError("give either --prompt or --prompt-ids (one of them, repeatable)")
    if options.prompt is not None:
        for i, text in enumerate(options.prompt):
            check_text(text, f"--prompt {i}")
        return [tokenizer.encode(text) for text in options.prompt]
    prompts = []
    for text in options.prompt_ids:
        items = [t.strip() for t in text.split(",")] if text.strip() else []  # "": an empty prompt, refused later
        if "" in items:
            raise TensorparError(f"--prompt-ids '{text}' has an empty item (item {items.index('') + 1}): give "
                                 f"comma-separated token ids such as 1,2,3")
        try:
            prompts.append([int(t) for t in items])
        except ValueError:
            raise TensorparError(f"--prompt-ids '{text}' is not a comma-separated list of integers") from None
    return prompts


def _eos_ids(options, tokenizer):
    return None if options.ignore_eos else eos_ids(options.checkpoint, tokenizer)


def eos_ids(checkpoint: str, tokenizer):
    """The EOS id(s) transformers' generate would stop at: generation_config.json, config.json, the tokenizer (a
    tensorpar checkpoint's files are in the step folder its `latest` names)."""
    folder = tokenizer_folder(checkpoint)
    for name in ("generation_config.json", "config.json"):
        path = os.path.join(folder, name)
        if os.path.isfile(path):
            try:
                with open(path) as f:
                    eos = json.load(f).get("eos_token_id")
            except (OSError, ValueError, AttributeError):
                eos = None
            if eos is not None:
                return eos
    return tokenizer.eos_id if isinstance(tokenizer, HFTokenizer) else None  # the byte tokenizer's EOS means nothing here


def validate(options: GenerateOptions):
    """Everything that can be checked before a rank starts: (options with --ep folded onto the ranks, their layout,
    config, tokenizer, prompts, sampling, eos)."""
    check_choices(options)
    check_fp8(options.dtype, options.device)
    cfg = load_config(options.checkpoint)
    check_adapter(options.checkpoint, options.lora_adapter)
    options, layout = decoding_layout(options, cfg, "generate")
    applicability.check("generate", options, cfg=cfg)
    if options.max_new_tokens < 1:
        raise TensorparError(f"--max-new-tokens must be at least 1, got {options.max_new_tokens}")
    sampling = _sampling(options)
    tokenizer = load_tokenizer(options.checkpoint)
    prompts = _prompts(options, tokenizer)
    check_generate_args(prompts, options.max_new_tokens, cfg.vocab_size,
                        cfg.max_seq_len if cfg.position == "learned" else None,
                        **{k: v for k, v in sampling.items() if k not in ("greedy", "seed")})
    if options.prompt is not None and tokenizer_unknown(options.checkpoint):
        raise TensorparError(f"{unknown_tokenizer_note(options.checkpoint)}: give --prompt-ids instead of --prompt")
    return options, layout, cfg, tokenizer, prompts, sampling, _eos_ids(options, tokenizer)


def generate_text(options: GenerateOptions, tokenizer, prompts, sampling, eos,
                  layout: ParallelLayout | None = None) -> tuple[list[list[int]], dict]:
    """(new token ids per prompt, timing stats) on every rank of the running world; `layout`: the one `validate`
    checked (None: the options' on the running world)."""
    cfg = load_config(options.checkpoint)
    layout = layout or ParallelLayout.from_options(options, world_from_env()[0])
    mesh = build_mesh(layout, moe=cfg.is_moe, device=options.device, backend=options.backend, timeout=options.timeout)
    try:
        cfg, state = load_model_source(options.checkpoint, options.lora_adapter)
        model = build_transformer(cfg, mesh, layout, Precision.of(options, training=False), weights=state,
                                  source=options.checkpoint).eval()
        del state
        stats: dict = {}
        with Precision.of(options, training=False).autocast(mesh.device):
            new = generate(model, prompts, options.max_new_tokens, eos_id=eos, stats=stats,
                           replica_group=mesh.dp_group, **sampling)
        return new, stats
    finally:
        mesh.destroy()


def run(args, argv) -> int:
    options, layout, _, tokenizer, prompts, sampling, eos = validate(options_from_args(GenerateOptions, args,
                                                                                       "generate"))

    textless = tokenizer_unknown(options.checkpoint)  # its ids have no text: printed as ids, "text" null

    def run_rank() -> int:
        new, stats = generate_text(options, tokenizer, prompts, sampling, eos, layout)
        if int(os.environ.get("RANK", "0")) != 0:
            return 0
        for prompt, ids in zip(prompts, new):
            text = None if textless else text_after(tokenizer, prompt, ids)
            if options.json:
                print(json.dumps({"ids": ids, "text": text, "tokens_per_s": round(stats["tokens_per_s"], 2)}))
            else:
                print(",".join(map(str, ids)) if textless else text)
        sys.stdout.flush()
        if not options.json:
            sys.stderr.write(f"{stats['new_tokens']} new tokens in {stats['seconds']:.2f} s "
                             f"({stats['tokens_per_s']:.1f} tokens/s, tp={options.tp})\n")
        return 0

    return launch(options, argv, run_rank)
