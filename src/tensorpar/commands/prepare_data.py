"""`tensorpar prepare-data`: tokenize document sources ahead of time, so that `train` starts at once.

Each source (.jsonl / .jsonl.gz / .parquet file or folder, a `datasets` save_to_disk folder; or each source of
a mixture) is tokenized into the token cache that `tensorpar train --data` reads, batched and on every core
the tokenizer library uses, with a progress bar. `--output PREFIX` also writes it as a Megatron indexed
dataset (PREFIX.bin + PREFIX.idx) that Megatron-LM and `--data PREFIX` read.
"""

from __future__ import annotations

import json
import os
import shutil

from tensorpar.config.fields import add_options, options_from_args
from tensorpar.config.options import PrepareDataOptions
from tensorpar.config.command_line import check_output_file
from tensorpar.data import cached_tokens, indexed_prefix, parse_data_spec, tokenizer_from
from tensorpar.data.documents import document_kind
from tensorpar.errors import TensorparError


def add_parser(sub) -> None:
    p = sub.add_parser("prepare-data", help="tokenize JSONL / Parquet / datasets sources into the token cache "
                                            "(and optionally Megatron .bin/.idx)")
    add_options(p, PrepareDataOptions)
    p.set_defaults(run=run)


def prepare(options: PrepareDataOptions) -> list[dict]:
    """Tokenize (or find cached) every source of `options.data`; one record per source."""
    tokenizer = tokenizer_from(options.tokenizer)
    pairs = parse_data_spec(options.data)
    if options.output and len(pairs) > 1:
        raise TensorparError("--output writes one Megatron dataset: give one source, not a mixture")
    records = []
    for weight, path in pairs:
        if indexed_prefix(path) is not None:
            raise TensorparError(f"'{path}' is a Megatron dataset already: train reads it as it is")
        if not os.path.exists(path):
            raise TensorparError(f"data file '{path}' does not exist")
        if document_kind(path) is None:
            raise TensorparError(f"'{path}' is not a document source: prepare-data reads .jsonl, .jsonl.gz and "
                                 f".parquet files or folders and datasets save_to_disk folders")
        data, info = cached_tokens(path, tokenizer, options.text_field, options.data_cache, options.progress)
        record = {"source": path, "weight": weight, "documents": data.num_documents, "tokens": int(data.tokens.size),
                  "cache": info["prefix"], "cached": info["cached"], "tokenize_seconds": info["seconds"],
                  "tokens_per_s": int(data.tokens.size) / info["seconds"] if info["seconds"] else None}
        if options.output:  # the .json says which tokenizer made the ids (`data.streams.foreign_ids` reads it)
            for ext in (".bin", ".idx", ".json"):
                shutil.copyfile(info["prefix"] + ext, options.output + ext + ".tmp")
            for ext in (".bin", ".idx", ".json"):
                os.replace(options.output + ext + ".tmp", options.output + ext)
            record["megatron_prefix"] = options.output
        records.append(record)
    return records


def run(args, argv) -> int:
    options = options_from_args(PrepareDataOptions, args, "prepare-data")
    if options.output:
        check_output_file(options.output + ".bin", "--output")
        os.makedirs(os.path.dirname(os.path.abspath(options.output)), exist_ok=True)
    for r in prepare(options):
        if options.json:
            print(json.dumps(r))
            continue
        how = ("found in the cache" if r["cached"] else
               f"tokenized in {r['tokenize_seconds']:.1f}s ({r['tokens_per_s']:,.0f} tokens/s)")
        print(f"{r['source']}: {r['documents']:,} documents, {r['tokens']:,} tokens, {how}: {r['cache']}.bin/.idx"
              + (f"; Megatron dataset {r['megatron_prefix']}.bin/.idx" if r.get("megatron_prefix") else ""))
    return 0
