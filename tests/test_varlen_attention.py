"""Attention within packed documents without an [S, S] mask: the varlen kernel (padded length buckets, SDPA causal)
equals SDPA with the dense document mask (output and q / k / v gradients, fp32, GQA, one-token documents, a row
that is one document; with a sliding window, a soft cap and a score scale), the flex kernel's block mask does too (forward: torch has no flex backward on CPU), and a
training step of the model at seq-len 8192 with ~256-token documents creates no tensor of S x S elements (while the
dense kernel does, at 1024)."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tensorpar.errors import TensorparError
from tensorpar.functional.attention_pattern import AttentionPattern
from tensorpar.functional.document_mask import PackedDocuments
from tensorpar.functional.varlen_attention import (bucket_length, check_document_attention, document_attention,
                                                    flex_document_attention)
from tensorpar.models import Transformer, get_config
from tensorpar.models.placement import Placement

from checks import rel_err

EOS = 256


def _documents(seq_len: int, ends: list[list[int]]) -> PackedDocuments:
    ids = torch.randint(0, EOS, (len(ends), seq_len), generator=torch.Generator().manual_seed(0))
    for row, where in enumerate(ends):
        ids[row, where] = EOS
    return PackedDocuments.from_tokens(ids, EOS)


# documents of 1 to 27 tokens, two EOSes in a row, an EOS first; the last row is one document
ENDS = [[2, 3, 11, 38, 40], [0, 7, 20, 21, 31, 63], []]


def _qkv(rows: int, seq_len: int, heads=4, kv_heads=2, dim=8):
    g = torch.Generator().manual_seed(1)
    return [torch.randn(rows, h, seq_len, dim, generator=g, requires_grad=True) for h in (heads, kv_heads, kv_heads)]


def test_bucket_lengths_hold_each_document_within_one_and_a_half_times_its_length():
    for n in range(1, 5000):
        assert n <= bucket_length(n) <= max(1.5 * n, 2)
    assert [bucket_length(n) for n in (1, 2, 3, 5, 7, 192, 193, 257)] == [1, 2, 3, 6, 8, 192, 256, 384]


PATTERNS = {"plain": AttentionPattern(), "window": AttentionPattern(window=5),
            "softcap-scale-window": AttentionPattern(scale=0.2, softcap=3.0, window=12)}


@pytest.mark.parametrize("pattern", list(PATTERNS))
def test_varlen_equals_the_dense_mask(pattern):
    """With the layer's pattern too: a window shorter than some documents (band masks per bucket), a soft cap (the
    softmax written out) and a score scale."""
    docs = _documents(64, ENDS)
    probe = torch.randn(3, 4, 64, 8, generator=torch.Generator().manual_seed(2))
    results = {}
    for kernel in ("dense", "varlen"):
        q, k, v = _qkv(3, 64)
        out = document_attention(q, k, v, docs, kernel, pattern=PATTERNS[pattern])
        (out * probe).sum().backward()
        results[kernel] = [out.detach(), q.grad, k.grad, v.grad]
    errs = [rel_err(a, b) for a, b in zip(results["varlen"], results["dense"])]
    assert max(errs) <= 1e-6, errs


def test_the_varlen_kernel_builds_no_dense_mask():
    docs = _documents(64, ENDS)
    q, k, v = _qkv(3, 64)
    document_attention(q, k, v, docs, "varlen").sum().backward()
    assert {key[0] for key in docs._memo} == {"buckets"}  # not the dense kernel's "causal" [B, 1, S, S] mask


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_flex_block_mask_equals_the_dense_mask():
    """flex_attention eagerly (a masked reference; no gradients on CPU) with the block mask built from the
    documents: the compiled kernel on CUDA takes the same mask (tests/test_cuda.py trains with it)."""
    docs = _documents(64, ENDS)
    q, k, v = (t.detach() for t in _qkv(3, 64))
    for pattern in PATTERNS.values():
        dense = document_attention(q, k, v, docs, "dense", pattern=pattern)
        assert rel_err(flex_document_attention(q, k, v, docs, compiled=False, pattern=pattern), dense) <= 1e-6


def test_flex_is_refused_where_it_cannot_train():
    with pytest.raises(TensorparError, match="flex trains on CUDA only .* use varlen or dense"):
        check_document_attention("flex", "cpu")
    with pytest.raises(TensorparError, match="flex has no attention dropout"):
        check_document_attention("flex", "cuda", dropout=0.1)
    check_document_attention("varlen", "cpu", dropout=0.1)


class LargestTensor(TorchDispatchMode):
    """The most elements of any tensor an op returns inside."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def _largest_tensor_of_a_step(seq_len: int, kernel: str) -> int:
    """A forward and backward of a 2-layer tiny model on one window of ~256-token documents."""
    cfg = get_config("tiny").replace(num_layers=2, max_seq_len=seq_len)
    model = Transformer(cfg, Placement.on(None, document_attention=kernel, loss_chunk_tokens=1024), seed=0)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, EOS, (1, seq_len + 1), generator=g)
    ids[0, torch.randint(128, 385, (seq_len // 128,), generator=g).cumsum(0).clamp(max=seq_len)] = EOS
    docs = PackedDocuments.from_tokens(ids[:, :-1], EOS)
    with LargestTensor() as seen:
        model(ids[:, :-1], ids[:, 1:], documents=docs).backward()
    return seen.largest


def test_document_masked_training_at_8192_makes_no_s_by_s_tensor():
    assert _largest_tensor_of_a_step(8192, "auto") < 8192 * 8192 // 16
    # the check can fail: the dense kernel's mask is [1, 1, S, S]
    assert _largest_tensor_of_a_step(1024, "dense") >= 1024 * 1024
