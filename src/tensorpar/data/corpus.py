"""The default training text: the Python language reference that ships with CPython (no download)."""

from __future__ import annotations

from tensorpar.errors import TensorparError


def default_corpus_text() -> str:
    """Every topic of `pydoc_data.topics` (about 465 KB of English), sorted by name, joined by blank lines."""
    try:
        from pydoc_data.topics import topics
    except ImportError as e:
        raise TensorparError(
            "the default corpus needs the standard-library module 'pydoc_data', which this Python "
            "lacks; pass a data file instead"
        ) from e
    if not topics:
        raise TensorparError("the default corpus 'pydoc_data.topics' is empty; pass a data file instead")
    return "\n\n".join(topics[k] for k in sorted(topics))
