"""Megatron-LM indexed datasets: `PREFIX.bin` (the tokens of every document, back to back) and `PREFIX.idx`.

The `.idx` layout is the MMIDIDX one that Megatron-LM's `tools/preprocess_data.py` writes
(`megatron/core/datasets/indexed_dataset.py`), all little-endian:

    magic            9 bytes   b"MMIDIDX\\x00\\x00"
    version          uint64    1
    dtype code       uint8     1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 6 float64, 7 float32, 8 uint16
    sequence count   uint64    S
    document count   uint64    D (the length of the document index below: documents + 1)
    sequence lengths int32[S]  tokens per sequence
    sequence ptrs    int64[S]  byte offset of each sequence in the .bin
    document index   int64[D]  0, then the sequence index one past each document's last sequence

We write one sequence per document (as `preprocess_data.py` does without sentence splitting), so the
document index is 0, 1, ..., S. Reading maps both files into memory; nothing is copied.
"""

from __future__ import annotations

import os
import struct

import numpy as np

from tensorpar.errors import TensorparError

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
DTYPE_CODES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32,
               8: np.uint16}
_CODE_OF = {np.dtype(v): k for k, v in DTYPE_CODES.items()}
_HEADER = len(MAGIC) + 8 + 1 + 8 + 8


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id fits (as Megatron chooses for vocabularies under 65,500), else int32."""
    return np.dtype(np.uint16 if vocab_size <= 65535 else np.int32)


def index_bytes(lengths, dtype) -> bytes:
    """The whole `.idx` file for documents of `lengths` tokens of `dtype` (one sequence per document)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    dtype = np.dtype(dtype)
    if dtype not in _CODE_OF:
        raise TensorparError(f"Megatron indexed datasets cannot hold {dtype} tokens")
    pointers = np.zeros(len(lengths), dtype=np.int64)
    np.cumsum(lengths[:-1] * dtype.itemsize, out=pointers[1:])
    doc_index = np.arange(len(lengths) + 1, dtype=np.int64)
    return b"".join([MAGIC, struct.pack("<Q", VERSION), struct.pack("<B", _CODE_OF[dtype]),
                     struct.pack("<Q", len(lengths)), struct.pack("<Q", len(doc_index)),
                     lengths.astype("<i4").tobytes(), pointers.astype("<i8").tobytes(),
                     doc_index.astype("<i8").tobytes()])


class IndexedWriter:
    """Writes `PREFIX.bin` and `PREFIX.idx` document by document; `finish()` writes the index.

    The files appear under their final names only when complete (written as `.tmp`, then renamed)."""

    def __init__(self, prefix: str, dtype):
        self.prefix, self.dtype = prefix, np.dtype(dtype)
        if self.dtype not in _CODE_OF:
            raise TensorparError(f"Megatron indexed datasets cannot hold {self.dtype} tokens")
        os.makedirs(os.path.dirname(os.path.abspath(prefix)), exist_ok=True)
        self._bin = open(prefix + ".bin.tmp", "wb")
        self.lengths: list[int] = []
        self.tokens = 0
        self.max_id = -1  # the largest token id written (a run checks it against the vocabulary without a scan)

    def add_document(self, ids) -> None:
        """Append one document's token ids."""
        array = np.asarray(ids, dtype=self.dtype)
        self._bin.write(array.tobytes())
        self.lengths.append(int(array.size))
        self.tokens += int(array.size)
        self.max_id = max(self.max_id, int(array.max())) if array.size else self.max_id

    def write_flat(self, flat: np.ndarray, lengths) -> None:
        """Append several documents at once: their ids back to back in `flat`, and each one's length."""
        self._bin.write(np.ascontiguousarray(flat, dtype=self.dtype).tobytes())
        self.lengths.extend(int(n) for n in lengths)
        self.tokens += int(flat.size)
        self.max_id = max(self.max_id, int(flat.max())) if flat.size else self.max_id

    def finish(self) -> str:
        """Close the `.bin`, write the `.idx`; returns the prefix."""
        self._bin.close()
        with open(self.prefix + ".idx.tmp", "wb") as f:
            f.write(index_bytes(self.lengths, self.dtype))
        os.replace(self.prefix + ".bin.tmp", self.prefix + ".bin")
        os.replace(self.prefix + ".idx.tmp", self.prefix + ".idx")
        return self.prefix

    def abort(self) -> None:
        """Close and delete the partial files."""
        self._bin.close()
        for path in (self.prefix + ".bin.tmp", self.prefix + ".idx.tmp"):
            if os.path.exists(path):
                os.remove(path)


class IndexedDataset:
    """A Megatron indexed dataset, memory-mapped: `tokens` (all documents back to back) and `doc_lengths`."""

    def __init__(self, prefix: str):
        self.prefix = prefix
        idx, bin_path = prefix + ".idx", prefix + ".bin"
        for path in (idx, bin_path):
            if not os.path.isfile(path):
                raise TensorparError(f"Megatron dataset '{prefix}': '{path}' does not exist")
        size = os.path.getsize(idx)
        with open(idx, "rb") as f:
            head = f.read(_HEADER)
        if len(head) < _HEADER or head[:len(MAGIC)] != MAGIC:
            raise TensorparError(f"'{idx}' is not a Megatron MMIDIDX index (bad magic bytes or truncated header)")
        version, = struct.unpack("<Q", head[9:17])
        code = head[17]
        seq_count, doc_count = struct.unpack("<QQ", head[18:34])
        if version != VERSION:
            raise TensorparError(f"'{idx}': index version {version} is not supported (only {VERSION})")
        if code not in DTYPE_CODES or np.dtype(DTYPE_CODES[code]).kind not in "iu":
            raise TensorparError(f"'{idx}': dtype code {code} is not an integer token type")
        need = _HEADER + seq_count * 12 + doc_count * 8
        if size < need:
            raise TensorparError(f"'{idx}' has {size} bytes but its header announces {seq_count} sequences and "
                                 f"{doc_count} document indices ({need} bytes): the index is truncated")
        self.dtype = np.dtype(DTYPE_CODES[code])
        index = np.memmap(idx, mode="r", dtype=np.uint8)
        lengths = index[_HEADER:_HEADER + 4 * seq_count].view("<i4")
        pointers = index[_HEADER + 4 * seq_count:_HEADER + 12 * seq_count].view("<i8")
        self.doc_index = index[_HEADER + 12 * seq_count:need].view("<i8")
        bin_size = os.path.getsize(bin_path)
        self._check(idx, bin_path, lengths, pointers, bin_size)
        self.sequence_lengths = np.asarray(lengths, dtype=np.int64)
        total = int(self.sequence_lengths.sum())
        self.tokens = (np.memmap(bin_path, mode="r", dtype=self.dtype, shape=(total,)) if total
                       else np.zeros(0, dtype=self.dtype))
        docs = np.asarray(self.doc_index, dtype=np.int64)
        ends = np.concatenate([[0], np.cumsum(self.sequence_lengths)])
        self.doc_lengths = ends[docs[1:]] - ends[docs[:-1]] if len(docs) > 1 else np.zeros(0, dtype=np.int64)

    def _check(self, idx, bin_path, lengths, pointers, bin_size) -> None:
        item = self.dtype.itemsize
        if len(lengths) and (lengths.min() < 0):
            raise TensorparError(f"'{idx}': sequence {int(np.argmin(lengths))} has a negative length")
        expected = np.zeros(len(lengths), dtype=np.int64)
        np.cumsum(np.asarray(lengths[:-1], dtype=np.int64) * item, out=expected[1:])
        bad = np.flatnonzero(np.asarray(pointers) != expected)
        if bad.size:
            i = int(bad[0])
            raise TensorparError(f"'{idx}': sequence {i} starts at byte {int(pointers[i])} of '{bin_path}', "
                                 f"expected {int(expected[i])} (the index does not describe this .bin)")
        total = int(np.asarray(lengths, dtype=np.int64).sum()) * item
        if total != bin_size:
            raise TensorparError(f"'{idx}' describes {total} bytes of {self.dtype} tokens but '{bin_path}' has "
                                 f"{bin_size} bytes: the .idx does not match its .bin")
        docs = np.asarray(self.doc_index)
        if len(docs) == 0 or docs[0] != 0 or docs[-1] != len(lengths) or np.any(np.diff(docs) < 0):
            raise TensorparError(f"'{idx}': the document index must run from 0 up to the sequence count "
                                 f"{len(lengths)}")

    @property
    def num_documents(self) -> int:
        return len(self.doc_lengths)

    def document(self, i: int) -> np.ndarray:
        """The token ids of document `i`."""
        start = int(self.doc_lengths[:i].sum())
        return np.asarray(self.tokens[start:start + int(self.doc_lengths[i])])


def is_indexed_prefix(path: str) -> bool:
    """Whether `path` is a Megatron prefix (PATH.bin and PATH.idx exist), or names one's .bin / .idx."""
    return indexed_prefix(path) is not None


def indexed_prefix(path: str) -> str | None:
    """The Megatron prefix that `path` names (PREFIX, PREFIX.bin or PREFIX.idx with both files present)."""
    for prefix in (path, path[:-4] if path.endswith((".bin", ".idx")) else None):
        if prefix and os.path.isfile(prefix + ".bin") and os.path.isfile(prefix + ".idx"):
            return prefix
    return None
