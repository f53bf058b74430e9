"""Tiny corpora written in every format train --data reads, from the same documents."""

import gzip
import json
import os

import numpy as np

# Documents with non-ASCII text, an empty one, and enough bytes for a few windows of 16 + 1 tokens.
DOCS = [f"Document {i}: the quick brown fox jumps over the lazy dog {i * i} times. Ünïcödé ✓ {'z' * (i % 7)}"
        for i in range(40)] + [""] + ["last document\nwith a newline"]


def write_jsonl(path, docs=DOCS, field="text", gz=False):
    lines = "".join(json.dumps({"id": i, field: d}) + "\n" for i, d in enumerate(docs)).encode()
    with (gzip.open(path, "wb") if gz else open(path, "wb")) as f:
        f.write(lines)
    return str(path)


def write_jsonl_folder(folder, docs=DOCS, shards=3):
    os.makedirs(folder, exist_ok=True)
    step = -(-len(docs) // shards)
    for s in range(shards):
        write_jsonl(os.path.join(folder, f"part-{s:02d}.jsonl"), docs[s * step:(s + 1) * step])
    return str(folder)


def write_parquet_folder(folder, docs=DOCS, shards=2, row_group_size=7):
    import pyarrow as pa
    import pyarrow.parquet as pq

    os.makedirs(folder, exist_ok=True)
    step = -(-len(docs) // shards)
    for s in range(shards):
        part = docs[s * step:(s + 1) * step]
        table = pa.table({"text": part, "n": list(range(len(part)))})
        pq.write_table(table, os.path.join(folder, f"shard-{s}.parquet"), row_group_size=row_group_size)
    return str(folder)


def write_hf_dataset(folder, docs=DOCS):
    import datasets

    datasets.Dataset.from_dict({"text": docs}).save_to_disk(str(folder))
    return str(folder)


def byte_stream(docs=DOCS, eos=256):
    """The token stream every document format must give with the byte tokenizer: each document, then EOS."""
    out = []
    for d in docs:
        out.extend(d.encode("utf-8"))
        out.append(eos)
    return np.array(out, dtype=np.int64)
