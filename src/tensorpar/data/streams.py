"""Any `--data` value as token streams, and the training dataset built from them.

One path becomes one token stream, whatever its format:

    (none)                   the default corpus, tokenized in memory
    PREFIX (.bin + .idx)     a Megatron indexed dataset, memory-mapped as it is
    .jsonl / .jsonl.gz / .parquet, a folder of them, a `save_to_disk` folder
                             documents, tokenized once into the token cache (an EOS after each document)
    .npy / .bin              token ids, as they are
    anything else            UTF-8 text, tokenized in memory as one piece (no EOS added)

A mixture (`mixture.parse_data_spec`) is several streams with weights. Documents are packed back to back
into the windows of seq_len + 1 tokens (a window may span a document boundary; the EOS between documents
marks it; training masks attention there under --document-mask: tensorpar.functional.document_mask).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os

import numpy as np
import torch

from tensorpar.data.dataset import TokenDataset, check_vocab, load_tokens
from tensorpar.data.documents import document_files, document_kind
from tensorpar.data.megatron_indexed import IndexedDataset, indexed_prefix
from tensorpar.data.mixture import Blend, MixtureDataset, parse_data_spec
from tensorpar.data.token_cache import cached_tokens
from tensorpar.data.tokenizer import ByteTokenizer
from tensorpar.errors import TensorparError


@dataclasses.dataclass
class TokenStream:
    """One source's tokens (a memory map where the format allows) and what they came from."""

    path: str | None
    kind: str
    tokens: np.ndarray
    documents: int | None = None
    max_id: int | None = None  # the largest id, when known without a scan (the token cache records it)

    @property
    def name(self) -> str:
        return self.path or "the default corpus"

    def fingerprint(self) -> str:
        return stream_fingerprint(self.tokens)


def stream_fingerprint(tokens: np.ndarray) -> str:
    """A content hash of a token stream that is cheap for any size: its length and 3 x 4096 of its ids (the
    first, the last and evenly spaced ones), as int64 whatever the stored dtype."""
    n = int(tokens.size)
    picks = [tokens[:4096], tokens[-4096:], tokens[np.linspace(0, max(n - 1, 0), 4096).astype(np.int64)] if n
             else tokens[:0]]
    h = hashlib.sha256(str(n).encode())
    for part in picks:
        h.update(np.asarray(part, dtype=np.int64).tobytes())
    return h.hexdigest()[:16]


def open_stream(path: str | None, tokenizer, *, text_field: str = "text", bin_dtype: str = "uint16",
                cache_dir: str | None = None, progress: bool = True) -> TokenStream:
    """The token stream of one source (see the module's table of formats)."""
    if path is not None:
        prefix = indexed_prefix(path)
        if prefix is not None:
            data = IndexedDataset(prefix)
            if data.tokens.size == 0:
                raise TensorparError(f"Megatron dataset '{prefix}' holds no tokens")
            return TokenStream(path, "megatron", data.tokens, data.num_documents)
        if not os.path.exists(path):
            raise TensorparError(f"data file '{path}' does not exist")
        kind = document_kind(path)
        if kind is not None:
            data, info = cached_tokens(path, tokenizer, text_field, cache_dir, progress)
            if kind == "folder":  # say what it holds: "parquet folder", "jsonl folder", "jsonl+parquet folder"
                kind = "+".join(sorted({"parquet" if k == "parquet" else "jsonl" for k, _ in document_files(path)}))
                kind += " folder"
            return TokenStream(path, kind, data.tokens, data.num_documents, info.get("max_id"))
    tokens = load_tokens(path, tokenizer, bin_dtype)
    kind = "default" if path is None else os.path.splitext(path)[1].lstrip(".").lower() or "text"
    return TokenStream(path, kind if kind in ("npy", "bin", "default") else "text", tokens)


def prepare_sources(*specs: str | None, tokenizer, text_field: str = "text", cache_dir: str | None = None,
                    progress: bool = True) -> None:
    """Check that every source of the `--data` values `specs` exists, and tokenize the document sources into
    the cache now (each at most once: a cached one is skipped at once)."""
    for spec in specs:
        if spec is None:
            continue
        for _, path in parse_data_spec(spec):
            if indexed_prefix(path) is not None:
                continue
            if not os.path.exists(path):
                raise TensorparError(f"data file '{path}' does not exist")
            if document_kind(path) is not None:
                cached_tokens(path, tokenizer, text_field, cache_dir, progress)


def source_kinds(spec: str | None) -> frozenset[str]:
    """How the sources of a `--data` value are read (see the module's table), without reading them: "default",
    "megatron", "documents" (tokenized from their --text-field), "npy", "bin" (raw ids of --bin-dtype) or "text".
    A source that does not exist is refused here, before any option is judged by what the data holds."""
    return frozenset(_source_kind(path) for _, path in parse_data_spec(spec))


def _source_kind(path: str | None) -> str:
    if path is None:
        return "default"
    if indexed_prefix(path) is not None:
        return "megatron"
    if not os.path.exists(path):
        raise TensorparError(f"data file '{path}' does not exist")
    if document_kind(path) is not None:
        return "documents"
    return {".npy": "npy", ".bin": "bin"}.get(os.path.splitext(path)[1].lower(), "text")


TOKEN_ID_KINDS = frozenset({"npy", "bin", "megatron"})  # sources of token ids, which no tokenizer reads


def foreign_ids(spec: str | None, tokenizer, vocab_size: int) -> bool:
    """True when every source of the `--data` value `spec` is token ids (.npy, .bin, a Megatron dataset) read with
    the byte tokenizer (no other given) for a model whose vocabulary is not the byte tokenizer's, none of them a
    Megatron dataset that `prepare-data` made with it (its PREFIX.json says): the ids were made by a tokenizer the
    run lacks, so no text (a prompt, a sample) and no special id (EOS) of the byte tokenizer means anything in them."""
    if not isinstance(tokenizer, ByteTokenizer) or vocab_size == ByteTokenizer.vocab_size:
        return False
    paths = [path for _, path in parse_data_spec(spec)]
    return all(_source_kind(p) in TOKEN_ID_KINDS and not _made_by(p, tokenizer) for p in paths)


def _made_by(path: str, tokenizer) -> bool:
    """Whether `path` is a Megatron dataset whose description (PREFIX.json, written by the token cache and copied by
    `prepare-data --output`) names `tokenizer`."""
    prefix = indexed_prefix(path)
    if prefix is None or not os.path.isfile(prefix + ".json"):
        return False
    try:
        with open(prefix + ".json") as f:
            return json.load(f).get("tokenizer") == tokenizer.fingerprint
    except (OSError, ValueError, AttributeError):
        return False


def open_corpus(spec: str | None, tokenizer, vocab_size: int | None = None, **kw) -> list[tuple[float, TokenStream]]:
    """[(weight, stream)] of a `--data` value; with `vocab_size`, every id is checked to fit it."""
    pairs = [(w, open_stream(p, tokenizer, **kw)) for w, p in parse_data_spec(spec)]
    if vocab_size is not None:
        for _, stream in pairs:
            if stream.max_id is not None and 0 <= stream.max_id < vocab_size:
                continue  # the cache's ids are known to fit: no scan of a large memory map
            check_vocab(stream.tokens, vocab_size, stream.name)
    return pairs


def build_dataset(pairs: list[tuple[float, TokenStream]], seq_len: int, val_fraction: float):
    """A `TokenDataset` for one stream (the sample order of earlier versions), else a `MixtureDataset`."""
    if len(pairs) == 1:
        return TokenDataset(pairs[0][1].tokens, seq_len, val_fraction)
    datasets = []
    for i, (_, stream) in enumerate(pairs):
        try:
            datasets.append(TokenDataset(stream.tokens, seq_len, val_fraction, stream_id=i))
        except TensorparError as e:
            raise TensorparError(f"{stream.name}: {e}") from None
    return MixtureDataset(datasets, [w for w, _ in pairs], [s.name for _, s in pairs])


def validation_windows(pairs: list[tuple[float, TokenStream]], seq_len: int, max_windows: int) -> torch.Tensor:
    """Up to `max_windows` windows of seq_len + 1 tokens from the start of the streams, in stream order (a
    mixture: blended by weight): the whole of `--val-data` is validation data."""
    width = seq_len + 1
    sources, ordinals = Blend([w for w, _ in pairs]).assign(0, max(max_windows, 0))
    rows = []
    for i, k in zip(sources, ordinals):
        tokens = pairs[i][1].tokens
        if (k + 1) * width <= tokens.size:
            rows.append(np.asarray(tokens[k * width:(k + 1) * width], dtype=np.int64))
    if not rows:
        raise TensorparError(f"validation data {', '.join(s.name for _, s in pairs)}: fewer than seq_len + 1 = "
                             f"{width} tokens, not one validation window")
    return torch.from_numpy(np.stack(rows))


def describe_corpus(spec: str | None, pairs: list[tuple[float, TokenStream]], dataset=None, step: int = 0,
                    global_batch_size: int = 0) -> dict:
    """What a checkpoint records about its data: the `--data` value, a fingerprint of the whole corpus, and per
    source its weight, format, size, content fingerprint and (with a dataset) the samples drawn from it by
    `step` steps: the position a resumed run continues from."""
    if isinstance(dataset, MixtureDataset):
        consumed = dataset.consumed(step, global_batch_size)
    else:
        consumed = [step * global_batch_size] * len(pairs)
    sources = [{"path": s.path, "weight": round(w, 12), "format": s.kind, "tokens": int(s.tokens.size),
                "documents": s.documents, "fingerprint": s.fingerprint(), "samples_drawn": c}
               for (w, s), c in zip(pairs, consumed)]
    whole = hashlib.sha256(repr([(x["weight"], x["fingerprint"]) for x in sources]).encode()).hexdigest()[:16]
    return {"spec": spec, "fingerprint": whole, "sources": sources}
