"""The data pipeline: tokenizers, the default corpus, document sources (JSONL, Parquet, saved Hugging Face
datasets, Megatron indexed datasets), the token cache, mixtures, windows and per-step batches."""

from tensorpar.data.corpus import default_corpus_text
from tensorpar.data.dataset import TokenDataset, check_batch_layout, check_vocab, eval_windows, load_tokens, micro_batches
from tensorpar.data.megatron_indexed import IndexedDataset, IndexedWriter, indexed_prefix
from tensorpar.data.mixture import Blend, MixtureDataset, parse_data_spec
from tensorpar.data.streams import (
    TokenStream,
    build_dataset,
    describe_corpus,
    open_corpus,
    open_stream,
    prepare_sources,
    source_kinds,
    validation_windows,
)
from tensorpar.data.token_cache import cached_tokens, default_cache_dir, tokenize_source
from tensorpar.data.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer, tokenizer_from

__all__ = [
    "ByteTokenizer",
    "HFTokenizer",
    "load_tokenizer",
    "tokenizer_from",
    "IndexedDataset",
    "IndexedWriter",
    "indexed_prefix",
    "Blend",
    "MixtureDataset",
    "parse_data_spec",
    "TokenStream",
    "open_stream",
    "open_corpus",
    "prepare_sources",
    "source_kinds",
    "validation_windows",
    "build_dataset",
    "describe_corpus",
    "cached_tokens",
    "default_cache_dir",
    "tokenize_source",
    "default_corpus_text",
    "load_tokens",
    "check_vocab",
    "eval_windows",
    "TokenDataset",
    "micro_batches",
    "check_batch_layout",
]
