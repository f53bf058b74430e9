"""The data pipeline: tokenizers, the default corpus, token files, windows and per-step batches."""

from tensorpar.data.corpus import default_corpus_text
from tensorpar.data.dataset import TokenDataset, check_batch_layout, check_vocab, eval_windows, load_tokens, micro_batches
from tensorpar.data.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer

__all__ = [
    "ByteTokenizer",
    "HFTokenizer",
    "load_tokenizer",
    "default_corpus_text",
    "load_tokens",
    "check_vocab",
    "eval_windows",
    "TokenDataset",
    "micro_batches",
    "check_batch_layout",
]
