"""Token files, the train/validation split, per-step batches and their layout independence."""

import numpy as np
import pytest
import torch

from tensorpar.data import (
    ByteTokenizer,
    TokenDataset,
    check_vocab,
    eval_windows,
    load_tokens,
    micro_batches,
)
from tensorpar.errors import LayoutError, TensorparError

from test_tokenizer import TEXT


def test_file_formats_give_identical_ids(tmp_path):
    tok = ByteTokenizer()
    expected = np.array(tok.encode(TEXT), dtype=np.int64)
    (tmp_path / "a.txt").write_text(TEXT, encoding="utf-8")
    np.save(tmp_path / "a.npy", expected.astype(np.int32).reshape(-1, 1))   # any int dtype, flattened
    expected.astype(np.uint16).tofile(tmp_path / "a16.bin")
    expected.astype(np.int32).tofile(tmp_path / "a32.bin")
    loaded = [
        load_tokens(str(tmp_path / "a.txt"), tok),
        load_tokens(str(tmp_path / "a.npy"), tok),
        load_tokens(str(tmp_path / "a16.bin"), tok, bin_dtype="uint16"),
        load_tokens(str(tmp_path / "a32.bin"), tok, bin_dtype="int32"),
    ]
    for tokens in loaded:
        assert tokens.dtype == np.int64 and tokens.ndim == 1
        np.testing.assert_array_equal(tokens, expected)


def test_load_errors(tmp_path):
    tok = ByteTokenizer()
    with pytest.raises(TensorparError, match="data file '.*nope.txt' does not exist"):
        load_tokens(str(tmp_path / "nope.txt"), tok)
    (tmp_path / "odd.bin").write_bytes(b"\x01\x00\x02")
    with pytest.raises(TensorparError, match=r"odd\.bin.* 3 bytes.*multiple of 2"):
        load_tokens(str(tmp_path / "odd.bin"), tok)
    (tmp_path / "six.bin").write_bytes(b"\x01\x00\x02\x00\x03\x00")
    with pytest.raises(TensorparError, match=r"six\.bin.* 6 bytes.*multiple of 4"):
        load_tokens(str(tmp_path / "six.bin"), tok, bin_dtype="int32")
    with pytest.raises(TensorparError, match="bin dtype 'float32'.*int32.*uint16"):
        load_tokens(str(tmp_path / "six.bin"), tok, bin_dtype="float32")
    np.save(tmp_path / "f.npy", np.ones(4, dtype=np.float32))
    with pytest.raises(TensorparError, match=r"f\.npy.*float32.*integers"):
        load_tokens(str(tmp_path / "f.npy"), tok)
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(TensorparError, match=r"empty\.txt.*no tokens"):
        load_tokens(str(tmp_path / "empty.txt"), tok)
    (tmp_path / "empty.bin").write_bytes(b"")
    with pytest.raises(TensorparError, match=r"empty\.bin.*no tokens"):
        load_tokens(str(tmp_path / "empty.bin"), tok)
    (tmp_path / "latin1.txt").write_bytes(b"caf\xe9")
    with pytest.raises(TensorparError, match=r"latin1\.txt.*not UTF-8"):
        load_tokens(str(tmp_path / "latin1.txt"), tok)


def test_check_vocab():
    check_vocab(np.array([0, 5, 256]), 257, "x.bin")
    with pytest.raises(TensorparError, match=r"x\.bin.*token id 300.*size 257"):
        check_vocab(np.array([0, 300, 5]), 257, "x.bin")
    with pytest.raises(TensorparError, match=r"x\.bin.*token id -1"):
        check_vocab(np.array([0, -1]), 257, "x.bin")


def test_eval_windows_hand_computed():
    w = eval_windows(np.arange(11), seq_len=2)               # windows of 3, remainder [9, 10] dropped
    assert w.dtype == torch.long
    assert w.tolist() == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
    assert eval_windows(torch.arange(3), 2).tolist() == [[0, 1, 2]]
    with pytest.raises(TensorparError, match="2 tokens.*3 tokens"):
        eval_windows(np.arange(2), seq_len=2)


def test_split_is_disjoint_and_covers_stream():
    tokens = np.arange(1000)                                  # token value == its position
    ds = TokenDataset(tokens, seq_len=9, val_fraction=0.1)   # windows of 10
    assert (ds.num_train_windows, ds.num_val_windows) == (90, 10)
    val = ds.val_windows()
    assert val.tolist() == np.arange(900, 1000).reshape(10, 10).tolist()
    assert ds.val_windows(3).tolist() == val[:3].tolist()
    train = torch.cat([ds.global_batch(s, seed=0, global_batch_size=9) for s in range(10)])
    assert sorted(train[:, 0].tolist()) == list(range(0, 900, 10))   # each window once, stride 10
    assert set(train.flatten().tolist()).isdisjoint(set(val.flatten().tolist()))
    assert (train[:, 1:] - train[:, :-1] == 1).all()                # contiguous windows

    small = TokenDataset(np.arange(25), seq_len=9, val_fraction=0.01)  # rounds to 0: still one val window
    assert (small.num_train_windows, small.num_val_windows) == (1, 1)
    assert small.val_windows().tolist() == [list(range(15, 25))]
    assert TokenDataset(np.arange(25), seq_len=9, val_fraction=0.0).num_val_windows == 0
    only = TokenDataset(np.arange(15), seq_len=9, val_fraction=0.5)   # no room for a val window
    assert (only.num_train_windows, only.num_val_windows) == (1, 0)


def test_dataset_too_short():
    with pytest.raises(TensorparError, match="9 tokens.*seq_len \\+ 1 = 10"):
        TokenDataset(np.arange(9), seq_len=9)
    with pytest.raises(TensorparError, match="29 tokens.*= 10.*20 validation tokens"):
        TokenDataset(np.arange(29), seq_len=9, val_fraction=0.9)


def test_global_batch_determinism_and_epochs():
    ds = TokenDataset(np.arange(7 * 4), seq_len=3, val_fraction=0.0)   # 7 training windows
    n, g = ds.num_train_windows, 3
    assert n == 7
    b = ds.global_batch(0, seed=1, global_batch_size=g)
    assert b.shape == (g, 4) and b.dtype == torch.long
    assert torch.equal(b, TokenDataset(np.arange(28), 3, 0.0).global_batch(0, 1, g))   # fresh object
    assert not torch.equal(b, ds.global_batch(1, seed=1, global_batch_size=g))
    assert not torch.equal(ds.global_batch(0, 1, 6), ds.global_batch(0, 2, 6))
    # 7 steps of 3 = 3 epochs of 7, batches straddle epoch boundaries
    starts = torch.cat([ds.global_batch(s, seed=1, global_batch_size=g)[:, 0] for s in range(7)]) // 4
    for e in range(3):
        epoch = starts[e * n:(e + 1) * n].tolist()
        assert sorted(epoch) == list(range(n))
        assert epoch == np.random.default_rng([1, e]).permutation(n).tolist()
    # a batch bigger than an epoch, and random access in any order, agree with the stream
    big = ds.global_batch(1, seed=1, global_batch_size=10)[:, 0] // 4   # positions 10..19
    assert big.tolist() == starts[10:20].tolist()
    assert torch.equal(ds.global_batch(5, 1, g), ds.global_batch(5, 1, g))


def test_global_batch_is_cheap_for_late_steps():
    ds = TokenDataset(np.arange(50 * 8), seq_len=7, val_fraction=0.0)
    b = ds.global_batch(10**9, seed=3, global_batch_size=4)
    pos = 10**9 * 4
    expected = np.random.default_rng([3, pos // 50]).permutation(50)[pos % 50:pos % 50 + 4]
    assert (b[:, 0] // 8).tolist() == expected.tolist()


@pytest.mark.parametrize("dp, micro", [(1, 1), (1, 12), (2, 3), (3, 2), (4, 1), (4, 3), (6, 2), (12, 1)])
def test_micro_batches_layout_independent(dp, micro):
    ds = TokenDataset(np.arange(40 * 6), seq_len=5, val_fraction=0.1)
    for step in range(3):
        batch = ds.global_batch(step, seed=7, global_batch_size=12)
        pieces = []
        for rank in range(dp):
            mbs = micro_batches(batch, rank, dp, micro)
            assert len(mbs) == 12 // (dp * micro) and all(m.shape == (micro, 6) for m in mbs)
            pieces.extend(mbs)
        assert torch.equal(torch.cat(pieces), batch)


def test_micro_batches_errors():
    batch = torch.zeros(12, 4, dtype=torch.long)
    with pytest.raises(LayoutError, match="global batch size 12.*dp 2.*micro-batch size 4.*1, 2, 3, 6"):
        micro_batches(batch, 0, 2, 4)
    with pytest.raises(LayoutError, match="global batch size 12.*dp 5.*multiple of dp 5"):
        micro_batches(batch, 0, 5, 1)
    with pytest.raises(LayoutError, match="dp rank 2.*dp size 2"):
        micro_batches(batch, 2, 2, 1)
