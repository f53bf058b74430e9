"""Megatron-LM indexed datasets: the .idx we write is the MMIDIDX layout byte for byte; bad pairs are refused."""

import struct

import numpy as np
import pytest

from tensorpar.data import IndexedDataset, IndexedWriter, indexed_prefix
from tensorpar.data.megatron_indexed import index_bytes
from tensorpar.errors import TensorparError


def expected_idx(lengths, code, itemsize):
    """The .idx as Megatron-LM's _IndexWriter lays it out, built by hand from its documentation."""
    out = b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + struct.pack("<B", code)
    out += struct.pack("<Q", len(lengths)) + struct.pack("<Q", len(lengths) + 1)
    out += b"".join(struct.pack("<i", n) for n in lengths)
    pointer = 0
    for n in lengths:
        out += struct.pack("<q", pointer)
        pointer += n * itemsize
    out += b"".join(struct.pack("<q", i) for i in range(len(lengths) + 1))
    return out


@pytest.mark.parametrize("dtype,code", [(np.uint16, 8), (np.int32, 4)])
def test_written_files_match_the_documented_layout_byte_for_byte(tmp_path, dtype, code):
    docs = [[5, 6, 7], [], [65535 if dtype == np.uint16 else 100000, 1], [9]]
    writer = IndexedWriter(str(tmp_path / "corpus"), dtype)
    for d in docs[:2]:
        writer.add_document(d)
    writer.write_flat(np.array(docs[2] + docs[3]), [2, 1])
    assert writer.finish() == str(tmp_path / "corpus")
    lengths = [len(d) for d in docs]
    assert (tmp_path / "corpus.idx").read_bytes() == expected_idx(lengths, code, np.dtype(dtype).itemsize)
    assert (tmp_path / "corpus.bin").read_bytes() == b"".join(
        struct.pack("<H" if dtype == np.uint16 else "<i", t) for d in docs for t in d)
    data = IndexedDataset(str(tmp_path / "corpus"))
    assert data.dtype == np.dtype(dtype) and data.num_documents == 4
    assert data.doc_lengths.tolist() == lengths and data.document(2).tolist() == docs[2]
    assert np.asarray(data.tokens).tolist() == [t for d in docs for t in d]
    for name in ("corpus", "corpus.bin", "corpus.idx"):
        assert indexed_prefix(str(tmp_path / name)) == str(tmp_path / "corpus")
    assert not list(tmp_path.glob("*.tmp"))


def test_a_document_index_of_several_sequences_per_document_is_read(tmp_path):
    """Megatron with sentence splitting: documents of 2 and 1 sequences (document index 0, 2, 3)."""
    lengths, doc_index = [2, 3, 4], [0, 2, 3]
    idx = bytearray(expected_idx(lengths, 8, 2))
    idx[-8 * 4:] = b"".join(struct.pack("<q", i) for i in doc_index)
    idx[26:34] = struct.pack("<Q", 3)  # document count
    idx = bytes(idx)
    (tmp_path / "m.idx").write_bytes(idx)
    np.arange(9, dtype=np.uint16).tofile(tmp_path / "m.bin")
    data = IndexedDataset(str(tmp_path / "m"))
    assert data.doc_lengths.tolist() == [5, 4] and data.document(1).tolist() == [5, 6, 7, 8]


def test_index_that_does_not_match_its_bin_is_refused(tmp_path):
    prefix = str(tmp_path / "c")
    (tmp_path / "c.idx").write_bytes(index_bytes([3, 4], np.uint16))
    np.arange(6, dtype=np.uint16).tofile(prefix + ".bin")  # one token short
    with pytest.raises(TensorparError, match=r"c\.idx' describes 14 bytes.*c\.bin' has 12 bytes"):
        IndexedDataset(prefix)
    (tmp_path / "c.idx").write_bytes(b"NOTANIDX" + bytes(40))
    with pytest.raises(TensorparError, match=r"c\.idx' is not a Megatron MMIDIDX index"):
        IndexedDataset(prefix)
    (tmp_path / "c.idx").write_bytes(index_bytes([3, 4], np.uint16)[:40])
    with pytest.raises(TensorparError, match=r"c\.idx' has 40 bytes.*truncated"):
        IndexedDataset(prefix)
    bad = bytearray(index_bytes([3, 4], np.uint16))
    bad[34 + 8 + 8:34 + 8 + 16] = struct.pack("<q", 2)  # the second pointer is off
    (tmp_path / "c.idx").write_bytes(bytes(bad))
    np.arange(7, dtype=np.uint16).tofile(prefix + ".bin")
    with pytest.raises(TensorparError, match=r"sequence 1 starts at byte 2 .*expected 6"):
        IndexedDataset(prefix)
    (tmp_path / "c.bin").unlink()
    with pytest.raises(TensorparError, match=r"c\.bin' does not exist"):
        IndexedDataset(prefix)
