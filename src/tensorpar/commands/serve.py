"""`tensorpar serve`: an OpenAI-compatible HTTP server over tensor-parallel ranks.

    tensorpar serve --checkpoint DIR|HF_FOLDER [--tp T] [--ep E] [--expert-tp X] [--dtype fp32|bf16|fp8]
                    [--host H --port P] [--max-running N --max-queue Q --token-budget B]
                    [--block-size S --kv-cache-tokens K] [--no-prefix-caching]

The ranks start as for `generate` (local processes, torchrun, or an srun step) and each builds its shard of the
model and a paged KV pool of its KV heads; rank 0 runs the HTTP server and the engine (tensorpar.serving), which
broadcasts each step's plan to every rank. SIGTERM (or Ctrl-C) drains: new requests get 503, those in flight finish,
then every rank stops. Needs the `serve` extra (FastAPI, uvicorn): pip install 'tensorpar[serve]'.
"""

from __future__ import annotations

import errno
import os
import signal
import socket
import sys

from tensorpar.checkpoints.sources import (check_adapter, load_config, load_model_source, tokenizer_unknown,
                                           unknown_tokenizer_note)
from tensorpar.commands.common import decoding_layout, launch
from tensorpar.commands.generate import eos_ids
from tensorpar.config import applicability
from tensorpar.config.fields import add_options, check_choices, options_from_args
from tensorpar.config.options import ServeOptions
from tensorpar.config.precision import Precision
from tensorpar.data import load_tokenizer
from tensorpar.data.chat_template import ChatTemplate
from tensorpar.distributed.mesh import build_mesh
from tensorpar.errors import TensorparError
from tensorpar.functional.autocast import autocast_dtype
from tensorpar.layout import ParallelLayout
from tensorpar.models.build import build_transformer
from tensorpar.serving.app import Handler, HttpServer, check_serve_extra, create_app
from tensorpar.serving.blocks import BlockAllocator, blocks_for
from tensorpar.serving.engine import Engine, follow
from tensorpar.serving.paged_cache import PagedKVPool
from tensorpar.serving.protocol import ModelInfo
from tensorpar.serving.scheduler import Scheduler
from tensorpar.tensor_parallel.fp8_scaling import check_fp8


def add_parser(sub) -> None:
    p = sub.add_parser("serve", help="serve a checkpoint over an OpenAI-compatible HTTP API with tensor parallelism")
    add_options(p, ServeOptions, config_file=True)
    p.set_defaults(run=run)


# -- the layout and the model: what `generate` checks and builds, in one place ---------------------------------------


def build_model(options: ServeOptions, cfg, layout: ParallelLayout):
    """(mesh, this rank's model in eval mode), as `generate` builds them."""
    mesh = build_mesh(layout, moe=cfg.is_moe, device=options.device, backend=options.backend, timeout=options.timeout)
    cfg, state = load_model_source(options.checkpoint, options.lora_adapter)
    model = build_transformer(cfg, mesh, layout, Precision.of(options, training=False), weights=state,
                              source=options.checkpoint)
    return mesh, model.eval()


# -- the server ------------------------------------------------------------------------------------------------------


def _check_numbers(options: ServeOptions, context_len: int) -> int:
    """The KV pool's size in tokens, after checking the server's numbers."""
    if not 0 <= options.port <= 65535:
        raise TensorparError(f"--port must be in [0, 65535], got {options.port}")
    for flag, value in (("--max-running", options.max_running), ("--token-budget", options.token_budget),
                        ("--block-size", options.block_size), ("--max-queue", options.max_queue)):
        if value < 1:  # a queue of 0 would answer every request 429
            raise TensorparError(f"{flag} must be at least 1, got {value}")
    tokens = options.kv_cache_tokens or options.max_running * context_len
    if tokens < context_len:
        raise TensorparError(f"--kv-cache-tokens {tokens} cannot hold one sequence of the model's context "
                             f"({context_len} tokens): give at least {context_len}")
    return tokens


def _check_port(host: str, port: int) -> None:
    """Refuse a port another process listens on, before the model loads on every rank (rank 0's host only: where
    tensorpar's launcher runs, or torchrun's rank 0)."""
    if port == 0 or int(os.environ.get("RANK", "0")) != 0:
        return
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds: a closing socket is no owner
        try:
            probe.bind((host, port))
        except OSError as e:
            why = "another process listens on it" if e.errno == errno.EADDRINUSE else e.strerror
            raise TensorparError(f"--host {host} --port {port}: cannot serve there ({why})") from None


def validate(options: ServeOptions):
    """Everything checked before a rank starts: (options, config, tokenizer, the model's API facts, KV tokens)."""
    check_serve_extra()
    check_choices(options)
    check_fp8(options.dtype, options.device)
    cfg = load_config(options.checkpoint)
    check_adapter(options.checkpoint, options.lora_adapter)
    options, layout = decoding_layout(options, cfg, "serve")
    applicability.check("serve", options, cfg=cfg)
    kv_tokens = _check_numbers(options, cfg.max_seq_len)
    _check_port(options.host, options.port)
    tokenizer = load_tokenizer(options.checkpoint)
    eos = eos_ids(options.checkpoint, tokenizer)
    eos = frozenset() if eos is None else frozenset([eos] if isinstance(eos, int) else eos)
    info = ModelInfo(options.served_model_name or options.checkpoint, cfg.max_seq_len, cfg.vocab_size, eos)
    ChatTemplate.of_folder(options.checkpoint)  # a broken template fails here, not at the first chat request
    return options, layout, cfg, tokenizer, info, kv_tokens


def _serve_rank0(options, engine: Engine, tokenizer, info: ModelInfo, pool) -> None:
    handler = Handler(engine, tokenizer, info, ChatTemplate.of_folder(options.checkpoint))
    http = HttpServer(create_app(handler), options.host, options.port)
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: engine.drain())
    http.start()
    if tokenizer_unknown(options.checkpoint):
        sys.stderr.write(f"tensorpar serve: warning: {unknown_tokenizer_note(options.checkpoint)}; send completion "
                         f"prompts as lists of token ids\n")
    sys.stderr.write(f"tensorpar serve: http://{options.host}:{options.port}/v1 serves {info.name} (tp {options.tp}, "
                     f"{f'ep {options.ep}, ' if options.ep > 1 else ''}"
                     f"{f'expert-tp {options.expert_tp}, ' if options.expert_tp > 1 else ''}"
                     f"KV pool {pool.num_blocks} blocks of {pool.block_size} tokens, "
                     f"{pool.memory_bytes() / 2**20:.1f} MiB per rank)\n")
    sys.stderr.flush()
    try:
        engine.serve_forever()
    finally:
        http.stop()


def serve_rank(options: ServeOptions, layout: ParallelLayout, cfg, tokenizer, info: ModelInfo, kv_tokens: int) -> int:
    mesh, model = build_model(options, cfg, layout)
    try:
        with Precision.of(options, training=False).autocast(mesh.device):
            dtype = autocast_dtype(next(model.parameters()))
            pool = PagedKVPool.for_model(model, blocks_for(kv_tokens, options.block_size), options.block_size,
                                         dtype=dtype)
            if mesh.world_group.rank != 0:
                for signum in (signal.SIGTERM, signal.SIGINT):  # rank 0 drains, then tells this rank to stop
                    signal.signal(signum, signal.SIG_IGN)
                follow(model, pool, mesh.world_group, mesh.device)
                return 0
            allocator = BlockAllocator(pool.num_blocks, pool.block_size, prefix_caching=options.prefix_caching)
            scheduler = Scheduler(allocator, token_budget=options.token_budget,
                                  max_running=options.max_running, max_waiting=options.max_queue,
                                  static=options.batching == "static", rope_switch=model.rope_switch_length())
            engine = Engine(model, pool, scheduler, tokenizer, mesh.world_group, context_len=info.context_len,
                            device=mesh.device)
            _serve_rank0(options, engine, tokenizer, info, pool)
        return 0
    finally:
        mesh.destroy()


def run(args, argv) -> int:
    options, layout, cfg, tokenizer, info, kv_tokens = validate(options_from_args(ServeOptions, args, "serve"))
    return launch(options, argv, lambda: serve_rank(options, layout, cfg, tokenizer, info, kv_tokens))
