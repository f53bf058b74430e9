"""Context-parallel attention against dense causal attention: the ring and the all-gather, zigzag and contiguous
splits, GQA, dropout; outputs, query/key/value gradients (fp32, relative error <= 1e-5); communication."""

import pytest
import torch
import torch.nn.functional as F

from tensorpar.context_parallel.ring_attention import (
    ContextSplit,
    _dropout_keep,
    check_context_split,
    context_attention,
    split_chunks,
    split_work,
)
from tensorpar.errors import LayoutError

from checks import rel_err
from harness import mesh

B, H, H_KV, D = 2, 4, 2, 8


def _dense(q, k, v, dropout_keep=None):
    """Causal attention of the whole sequence; with `dropout_keep` [L, L] scaled keep masks, applied to the softmax."""
    k, v = k.repeat_interleave(q.shape[1] // k.shape[1], 1), v.repeat_interleave(q.shape[1] // v.shape[1], 1)
    if dropout_keep is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    s = (q @ k.transpose(-1, -2)) / D**0.5
    s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
    return (torch.softmax(s, -1) * dropout_keep) @ v


def check_context_attention(cp, impl, split, seq_len, dropout):
    m = mesh(tp=1, cp=cp, dp=4 // cp)
    torch.manual_seed(0)
    q = torch.randn(B, H, seq_len, D, requires_grad=True)
    k = torch.randn(B, H_KV, seq_len, D, requires_grad=True)
    v = torch.randn(B, H_KV, seq_len, D, requires_grad=True)
    probe = torch.randn(B, H, seq_len, D)
    ctx = ContextSplit(m.cp_group, seq_len, split, impl)
    seed = 1234 if dropout else None
    keep = None
    if dropout:  # the same per-(query chunk, key chunk) masks the ring draws, laid out over the whole sequence
        c = ctx.chunk_len
        keep = torch.cat([torch.cat([_dropout_keep((B, H, c, c), dropout, seed, qc, kc, q.device)
                                     for kc in range(2 * cp)], -1) for qc in range(2 * cp)], -2)
    (_dense(q, k, v, keep) * probe).sum().backward()

    pos = ctx.positions()
    local = [t.detach()[:, :, pos].clone().requires_grad_() for t in (q, k, v)]
    m.stats.reset()
    out = context_attention(*local, ctx, dropout, seed)
    (out * probe[:, :, pos]).sum().backward()
    errs = {"output": rel_err(out, _dense(q, k, v, keep).detach()[:, :, pos])}
    for name, mine, full in zip("qkv", local, (q, k, v)):
        errs[f"d{name}"] = rel_err(mine.grad, full.grad[:, :, pos])
    counts = {key: (c.calls, c.bytes) for key, c in m.stats.snapshot().items()}
    return errs, counts


CASES = [(2, "ring", "zigzag", 16, 0.0), (4, "ring", "zigzag", 32, 0.0), (4, "ring", "contiguous", 32, 0.0),
         (2, "allgather", "zigzag", 16, 0.0), (4, "allgather", "zigzag", 24, 0.0), (2, "ring", "zigzag", 16, 0.2),
         (4, "ring", "zigzag", 16, 0.3)]


@pytest.mark.parametrize("cp,impl,split,seq_len,dropout", CASES, ids=[f"cp{c}-{i}-{s}-L{L}-p{p}"
                                                                     for c, i, s, L, p in CASES])
def test_context_attention_equals_dense_causal_attention(pools, cp, impl, split, seq_len, dropout):
    for rank, (errs, counts) in enumerate(pools(4).run(check_context_attention, cp, impl, split, seq_len, dropout)):
        bad = {k: v for k, v in errs.items() if v > 1e-5}
        assert not bad, f"rank {rank}: {bad}"
        block = B * H_KV * (seq_len // cp) * D * 4  # one rank's K (or V) block, fp32 bytes
        if impl == "ring":
            # forward: K, V passed cp - 1 times; backward: again, then their gradients cp - 1 times and home once
            assert counts[("send", "cp")] == (6 * (cp - 1) + 2, 2 * block * (3 * (cp - 1) + 1)), counts
        else:
            assert counts[("all_gather", "cp")] == (2, 2 * block * cp)
            assert counts[("reduce_scatter", "cp")] == (2, 2 * block * cp)


def test_zigzag_balances_the_causal_work():
    assert split_chunks(0, 4) == (0, 7) and split_chunks(3, 4) == (3, 4)
    assert split_chunks(1, 4, "contiguous") == (2, 3)
    for cp in (2, 4, 8, 16):
        zigzag, contiguous = split_work(cp), split_work(cp, "contiguous")
        assert max(zigzag) == min(zigzag) == 2 * cp  # every rank: 2 cp - 1 full blocks and 2 half ones
        assert contiguous[-1] / contiguous[0] == 2 * cp - 1
        assert sum(zigzag) == sum(contiguous) == (2 * cp) ** 2 / 2


def test_a_sequence_that_does_not_split_into_2cp_chunks_is_refused():
    check_context_split(24, 4)
    check_context_split(7, 1)
    with pytest.raises(LayoutError, match="sequence length 20 is not divisible by 2 x cp = 8.*not padded"):
        check_context_split(20, 4)


def check_model_logits(cp):
    """A CP model's logits at this rank's positions against the dense model's there, with rotary (tiny) and learned
    (tiny-gpt2) positions: each chunk's tokens take their positions in the whole sequence."""
    from tensorpar.models import Transformer, get_config
    from tensorpar.models.placement import Placement

    m, seq_len = mesh(tp=1, cp=cp, dp=4 // cp), 16
    errs = {}
    for name in ("tiny", "tiny-gpt2"):
        cfg = get_config(name).replace(num_layers=2)
        ids = torch.randint(0, cfg.vocab_size, (B, seq_len), generator=torch.Generator().manual_seed(0))
        dense = Transformer(cfg, None, seed=5).eval()(ids).detach()
        model = Transformer(cfg, Placement.on(m), seed=5).eval()
        errs[name] = rel_err(model(ids).detach(), dense[:, model.context(seq_len).positions()])
    return errs


@pytest.mark.parametrize("cp", [2, 4])
def test_context_parallel_model_logits_equal_the_dense_models(pools, cp):
    for rank, errs in enumerate(pools(4).run(check_model_logits, cp)):
        assert max(errs.values()) <= 1e-5, (rank, errs)


def check_pattern(impl: str, with_documents: bool):
    """A sliding window of 5 (chunks of 4: the ring skips the blocks before it), a soft cap of 2 and a scale of its
    own, with packed documents or without, at CP 4 against the same arithmetic over the whole sequence."""
    from tensorpar.functional.attention_pattern import AttentionPattern
    from tensorpar.functional.document_mask import PackedDocuments

    m, seq_len = mesh(tp=1, cp=4, dp=1), 32
    pattern = AttentionPattern(scale=0.3, softcap=2.0, window=5)
    torch.manual_seed(1)
    q, k, v = (torch.randn(B, h, seq_len, D, requires_grad=True) for h in (H, H_KV, H_KV))
    probe = torch.randn(B, H, seq_len, D)
    docs = None
    if with_documents:
        ids = torch.randint(0, 9, (B, seq_len), generator=torch.Generator().manual_seed(2))
        docs = PackedDocuments.from_tokens(ids, eos_id=0)
    every = torch.arange(seq_len)
    mask = pattern.visible(every, every) if docs is None else pattern.visible(every, every) & docs.causal_mask()
    dense = pattern.attend(q, *(t.repeat_interleave(H // H_KV, 1) for t in (k, v)), mask)
    (dense * probe).sum().backward()

    ctx = ContextSplit(m.cp_group, seq_len, "zigzag", impl, attended_blocks=[0])
    pos = ctx.positions()
    local = [t.detach()[:, :, pos].clone().requires_grad_() for t in (q, k, v)]
    out = context_attention(*local, ctx, 0.0, None, docs, pattern)
    (out * probe[:, :, pos]).sum().backward()
    errs = {"output": rel_err(out, dense.detach()[:, :, pos])}
    errs.update({f"d{n}": rel_err(mine.grad, full.grad[:, :, pos]) for n, mine, full in zip("qkv", local, (q, k, v))})
    return errs, ctx.attended_blocks[0]


@pytest.mark.parametrize("impl,with_documents", [("ring", False), ("ring", True), ("allgather", True)])
def test_window_soft_cap_and_scale_equal_dense_attention(pools, impl, with_documents):
    for rank, (errs, attended) in enumerate(pools(4).run(check_pattern, impl, with_documents)):
        assert max(errs.values()) <= 1e-5, (rank, errs)
        if impl == "ring":  # each of the two local chunks sees its own and at most the previous one, both passes
            assert attended <= 2 * 2 * 2, (rank, attended)
