"""Tokenize a document source once, into a memory-mapped cache that every later run opens at once.

The cache of a source is a Megatron indexed dataset (`KEY.bin` + `KEY.idx`, see `megatron_indexed`) whose
documents are each followed by the tokenizer's EOS id (as `preprocess_data.py --append-eod` writes), plus
`KEY.json` describing it, written last: a cache without its .json is incomplete and is rebuilt. The key
hashes the source's files (path, size, modification time), the text field and the tokenizer (its
tokenizer.json and EOS id). Processes that want the same cache at the same time (the ranks of a job) take a
file lock: one tokenizes, the others wait and then open what it wrote.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import queue
import threading
import time

import numpy as np
from tqdm import tqdm

from tensorpar.data.documents import document_files, read_documents
from tensorpar.data.megatron_indexed import IndexedDataset, IndexedWriter, token_dtype
from tensorpar.errors import TensorparError

CACHE_VERSION = 1


def default_cache_dir() -> str:
    """$TENSORPAR_CACHE, else ~/.cache/tensorpar; tokenized data goes to its tokens/ folder."""
    root = os.environ.get("TENSORPAR_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "tensorpar")
    return os.path.join(root, "tokens")


def _eos(tokenizer) -> int:
    eos = getattr(tokenizer, "eos_id", None)
    if eos is None:
        raise TensorparError(f"tokenizer {tokenizer!r} has no end-of-sequence token to put between documents; "
                             f"use a tokenizer.json that defines one (e.g. <|endoftext|> or </s>)")
    return int(eos)


def cache_key(files: list[tuple[str, str]], tokenizer, text_field: str) -> str:
    """The hex key of a source's cache: its files (path, size, mtime), the text field and the tokenizer."""
    described = [(kind, os.path.realpath(f), os.path.getsize(f), os.stat(f).st_mtime_ns) for kind, f in files]
    blob = json.dumps({"version": CACHE_VERSION, "files": described, "text_field": text_field,
                       "tokenizer": tokenizer.fingerprint, "eos": _eos(tokenizer)})
    return hashlib.sha256(blob.encode()).hexdigest()[:24]


def tokenize_source(path: str, tokenizer, text_field: str, prefix: str, progress: bool = True) -> dict:
    """Tokenize every document of `path` into the Megatron dataset `prefix` (.bin/.idx), an EOS after each
    document; returns {"documents", "tokens", "seconds", "files"}."""
    files = document_files(path)
    eos = _eos(tokenizer)
    dtype = token_dtype(tokenizer.vocab_size)
    total = sum(os.path.getsize(f) for _, f in files)
    writer = IndexedWriter(prefix, dtype)
    started = time.perf_counter()
    bar = tqdm(total=total, unit="B", unit_scale=True, dynamic_ncols=True, disable=not progress,
               desc=f"tokenize {os.path.basename(os.path.normpath(path))}")
    try:
        for texts, done in _prefetched(_all_documents(files, text_field)):
            _write_batch(writer, tokenizer.encode_batch(texts), eos)
            bar.update(done - bar.n)
            bar.set_postfix(tokens=f"{writer.tokens:,}", refresh=False)
        writer.finish()
    except BaseException:
        writer.abort()
        raise
    finally:
        bar.close()
    return {"documents": len(writer.lengths), "tokens": writer.tokens, "seconds": time.perf_counter() - started,
            "files": [f for _, f in files], "max_id": writer.max_id}


def _all_documents(files: list[tuple[str, str]], text_field: str):
    """Batches of texts of every file in order, with the bytes of all files read so far."""
    before = 0
    for kind, file in files:
        for texts, done in read_documents(kind, file, text_field):
            yield texts, before + done
        before += os.path.getsize(file)


def _prefetched(batches, depth: int = 2):
    """`batches`, produced by a reader thread up to `depth` ahead: reading and parsing the next batch overlaps
    the tokenizer's work on this one (which releases the GIL). An error of the reader is raised here."""
    out: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()
    done = object()

    def put(message) -> bool:
        while not stop.is_set():
            try:
                out.put(message, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def read():
        try:
            for item in batches:
                if not put(("item", item)):
                    return
            put(("end", done))
        except BaseException as e:  # noqa: BLE001 - handed to the consumer, which raises it
            put(("error", e))

    thread = threading.Thread(target=read, name="tensorpar-read-documents", daemon=True)
    thread.start()
    try:
        while True:
            kind, value = out.get()
            if kind == "error":
                raise value
            if kind == "end":
                return
            yield value
    finally:
        stop.set()
        thread.join(timeout=5)


def _write_batch(writer: IndexedWriter, batch: list[list[int]], eos: int) -> None:
    lengths = np.fromiter((len(ids) + 1 for ids in batch), dtype=np.int64, count=len(batch))
    flat = np.empty(int(lengths.sum()), dtype=writer.dtype)
    ends = np.cumsum(lengths)
    flat[ends - 1] = eos
    start = 0
    for ids, end in zip(batch, ends):
        flat[start:end - 1] = ids
        start = int(end)
    writer.write_flat(flat, lengths)


@contextlib.contextmanager
def _locked(path: str):
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def cached_tokens(path: str, tokenizer, text_field: str = "text", cache_dir: str | None = None,
                  progress: bool = True) -> tuple[IndexedDataset, dict]:
    """The tokenized documents of `path` (memory-mapped), tokenizing them first unless cached; and the cache's
    description (its .json, plus "cached": whether it was there already)."""
    files = document_files(path)
    folder = cache_dir or default_cache_dir()
    name = os.path.basename(os.path.normpath(path)).split(".")[0] or "data"
    prefix = os.path.join(folder, f"{name}-{cache_key(files, tokenizer, text_field)}")
    info_path = prefix + ".json"
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as e:
        raise TensorparError(f"cannot create the token cache folder '{folder}': {e} (set --data-cache)") from None
    with _locked(prefix + ".lock"):
        cached = os.path.isfile(info_path)
        if not cached:
            info = tokenize_source(path, tokenizer, text_field, prefix, progress)
            info.update(source=os.path.abspath(path), text_field=text_field, tokenizer=tokenizer.fingerprint,
                        prefix=prefix)
            with open(info_path + ".tmp", "w") as f:
                json.dump(info, f, indent=1)
            os.replace(info_path + ".tmp", info_path)
        with open(info_path) as f:
            info = json.load(f)
    info["cached"] = cached
    return IndexedDataset(prefix), info
