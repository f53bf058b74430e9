"""vocab_parallel_cross_entropy against F.cross_entropy on the full logits."""

import pytest
import torch
import torch.nn.functional as F

from tensorpar.layers import vocab_parallel_cross_entropy

from checks import rel_err
from harness import mesh

VOCAB = 1001  # divisible by neither 2, 3 nor 4


def _shard(full, tp, rank, pad_value=0.0):
    """This rank's slice of the vocabulary after padding it to a multiple of tp."""
    pad = -(-full.shape[-1] // tp) * tp - full.shape[-1]
    padded = torch.cat([full, full.new_full(full.shape[:-1] + (pad,), pad_value)], -1)
    return padded.chunk(tp, -1)[rank]


def check_cross_entropy(tp, label_smoothing, reduction, pad_value):
    m = mesh(tp=tp)
    g = m.tp_group
    torch.manual_seed(3)
    logits = (3 * torch.randn(3, 7, VOCAB)).requires_grad_()
    targets = torch.randint(0, VOCAB, (3, 7))
    targets[0, :3] = -100  # ignored
    targets[1, :3] = torch.tensor([0, VOCAB - 1, VOCAB // 2])  # first, last and a middle class
    shard = -(-VOCAB // tp)  # the last class of each shard and the first of the next (an off-by-one shows there)
    edges = [c for k in range(1, tp) for c in (k * shard - 1, k * shard)]
    targets[2, :len(edges)] = torch.tensor(edges, dtype=targets.dtype)
    expected = F.cross_entropy(
        logits.flatten(0, 1), targets.flatten(), ignore_index=-100, label_smoothing=label_smoothing, reduction=reduction
    )
    if reduction == "none":
        expected = expected.view(3, 7)
    probe = torch.randn_like(expected) if reduction == "none" else torch.tensor(1.7)
    (expected * probe).sum().backward()

    # Padding columns get `pad_value`: even a huge one must not change anything.
    local = _shard(logits.detach(), tp, g.rank, pad_value).requires_grad_()
    loss = vocab_parallel_cross_entropy(
        local, targets, m, ignore_index=-100, label_smoothing=label_smoothing, reduction=reduction, vocab_size=VOCAB
    )
    (loss * probe).sum().backward()
    expected_grad = _shard(logits.grad, tp, g.rank)
    counts = {k: (v.calls, v.elements) for k, v in m.stats.snapshot().items()}
    return rel_err(loss, expected), rel_err(local.grad, expected_grad), counts


@pytest.mark.parametrize("tp", [1, 2, 3, 4])
@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_matches_torch_cross_entropy(pools, tp, label_smoothing, reduction):
    pad_value = 1e4 if tp > 1 else 0.0
    for loss_err, grad_err, counts in pools(tp).run(check_cross_entropy, tp, label_smoothing, reduction, pad_value):
        assert loss_err <= 1e-5 and grad_err <= 1e-5, (loss_err, grad_err)
        if tp > 1:
            # never gathers the logits: one max all-reduce and one stacked sum all-reduce of per-token values
            per_token = 3 * 7
            stacked = 3 if label_smoothing else 2
            assert counts == {("all_reduce", "tp"): (2, per_token + stacked * per_token)}


def check_bf16_logits(tp):
    m = mesh(tp=tp)
    torch.manual_seed(4)
    logits = (3 * torch.randn(4, 5, VOCAB)).bfloat16()
    targets = torch.randint(0, VOCAB, (4, 5))
    full = logits.float().requires_grad_()
    expected = F.cross_entropy(full.flatten(0, 1), targets.flatten(), label_smoothing=0.1)
    expected.backward()
    local = _shard(logits, tp, m.tp_rank).requires_grad_()
    loss = vocab_parallel_cross_entropy(local, targets, m, label_smoothing=0.1, vocab_size=VOCAB)
    loss.backward()
    # the gradient is computed in fp32 and rounded to bf16 once: within bf16's rounding of the fp32 gradient
    expected_grad = _shard(full.grad, tp, m.tp_rank)
    grad_err = ((local.grad.float() - expected_grad).abs().max() / expected_grad.abs().max()).item()
    return loss.dtype, local.grad.dtype, rel_err(loss, expected), grad_err


@pytest.mark.parametrize("tp", [1, 2, 3])
def test_bf16_logits_are_reduced_in_fp32(pools, tp):
    for loss_dtype, grad_dtype, err, grad_err in pools(tp).run(check_bf16_logits, tp):
        assert loss_dtype == torch.float32 and grad_dtype == torch.bfloat16
        assert err <= 1e-5
        assert grad_err <= 2 ** -8, grad_err


@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
def test_one_rank_with_padding_columns(label_smoothing):
    """One rank whose logits carry padding columns takes the general path (the one-rank log-softmax needs none)."""
    torch.manual_seed(5)
    logits = (3 * torch.randn(6, VOCAB)).requires_grad_()
    targets = torch.randint(0, VOCAB, (6,))
    targets[1] = -100
    expected = F.cross_entropy(logits, targets, label_smoothing=label_smoothing)
    expected.backward()
    padded = torch.cat([logits.detach(), torch.full((6, 7), 1e4)], -1).requires_grad_()
    loss = vocab_parallel_cross_entropy(padded, targets, label_smoothing=label_smoothing, vocab_size=VOCAB)
    loss.backward()
    assert rel_err(loss, expected) <= 1e-5
    assert rel_err(padded.grad[:, :VOCAB], logits.grad) <= 1e-5
    assert padded.grad[:, VOCAB:].abs().max() == 0


def test_rejects_inconsistent_shapes():
    with pytest.raises(ValueError, match="does not match"):
        vocab_parallel_cross_entropy(torch.randn(2, 10), torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="vocab_size"):
        vocab_parallel_cross_entropy(torch.randn(2, 10), torch.zeros(2, dtype=torch.long), vocab_size=11)
    with pytest.raises(ValueError, match="reduction"):
        vocab_parallel_cross_entropy(torch.randn(2, 10), torch.zeros(2, dtype=torch.long), reduction="avg")
