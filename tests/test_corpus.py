"""The embedded default corpus."""

import numpy as np

from tensorpar.data import ByteTokenizer, default_corpus_text, load_tokens


def test_default_corpus():
    text = default_corpus_text()
    assert len(text.encode("utf-8")) > 100_000
    assert text == default_corpus_text()
    tokens = load_tokens(None, ByteTokenizer())
    assert tokens.dtype == np.int64 and tokens.ndim == 1 and tokens.size == len(text.encode("utf-8"))
