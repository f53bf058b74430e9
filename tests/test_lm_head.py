"""VocabParallelLMHead.from_dense: a dense head whose vocabulary does not divide by TP, fed to the vocab-parallel
loss, computes what nn.Linear + F.cross_entropy compute (loss, input and weight gradients, weights after AdamW)."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tensorpar.layers import VocabParallelLMHead, tp_region, vocab_parallel_cross_entropy

from checks import rel_err
from harness import mesh

B, S, H = 2, 12, 48  # S divides by 1, 2, 3 and 4 (sequence parallelism)


def check_lm_head(tp, vocab, label_smoothing, bias=False, sequence_parallel=False):
    m = mesh(tp=tp)
    g = m.tp_group
    torch.manual_seed(vocab + tp)
    dense = nn.Linear(H, vocab, bias=bias)
    h = torch.randn(B, S, H, requires_grad=True)
    targets = torch.randint(0, vocab, (B, S))
    targets[0, :3] = -100  # ignored positions
    targets[1, 0] = vocab - 1  # the last real row, next to the padding
    head = VocabParallelLMHead.from_dense(dense, tp_region(g, sequence_parallel=sequence_parallel))
    # The reference in float64: the exact answer, so that the comparison measures the parallel head's fp32
    # rounding alone (an fp32 reference adds its own, which at 50257 classes is as large as the head's).
    dense, h = dense.double(), h.detach().double().requires_grad_()
    loss = F.cross_entropy(dense(h).flatten(0, 1), targets.flatten(), label_smoothing=label_smoothing)
    loss.backward()

    if sequence_parallel:
        h_local = h.detach().float().chunk(tp, 1)[g.rank].clone().requires_grad_()
        h_grad_expected = h.grad.chunk(tp, 1)[g.rank]
    else:
        h_local = h.detach().float().clone().requires_grad_()
        h_grad_expected = h.grad
    logits = head(h_local)
    local_loss = vocab_parallel_cross_entropy(logits, targets, m, label_smoothing=label_smoothing,
                                              vocab_size=head.vocab_size)
    local_loss.backward()

    start, rows = head.vocab_start, head.out_per_rank
    real = max(0, min(rows, vocab - start))  # this rank's rows that are not padding
    errs = {
        "loss": rel_err(local_loss, loss),
        "input grad": rel_err(h_local.grad, h_grad_expected),
        "weight grad": rel_err(head.weight.grad[:real], dense.weight.grad[start:start + real]),
    }
    if bias:
        errs["bias grad"] = rel_err(head.bias.grad[:real], dense.bias.grad[start:start + real])
    padding_grad = head.weight.grad[real:].abs().max().item() if real < rows else 0.0
    # AdamW's first update is lr * g / (|g| + eps). A 50257-row head's gradient entries are ~1e-8: at the default
    # eps (1e-8) that ratio magnifies fp32 rounding (a 4e-5 weight difference from gradients equal to 1e-7).
    # eps = 1e-6 keeps the comparison about the step rather than about the rounding.
    for params in (dense.parameters(), head.parameters()):
        torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, eps=1e-6).step()
    errs["weight after AdamW"] = rel_err(head.weight[:real], dense.weight[start:start + real])
    padding_weight = head.weight[real:].abs().max().item() if real < rows else 0.0
    return errs, padding_grad, padding_weight, tuple(logits.shape), head.padded_vocab_size


CASES = [(tp, vocab, ls) for tp in (2, 3, 4) for vocab in (1001, 50257) for ls in (0.0, 0.1)]


@pytest.mark.parametrize("tp,vocab,label_smoothing", CASES)
def test_dense_head_becomes_a_vocab_parallel_head(pools, tp, vocab, label_smoothing):
    for rank, (errs, pad_grad, pad_weight, shape, padded) in enumerate(
            pools(tp).run(check_lm_head, tp, vocab, label_smoothing)):
        assert padded % tp == 0 and vocab <= padded < vocab + tp
        assert shape == (B, S, padded // tp)
        bad = {k: v for k, v in errs.items() if v > 1e-5}
        assert not bad, f"rank {rank}: {bad}"
        assert pad_grad == 0.0 and pad_weight == 0.0, "padding rows must stay zero"


@pytest.mark.parametrize("tp", [1, 3])
def test_head_with_bias_under_sequence_parallelism(pools, tp):
    for errs, pad_grad, pad_weight, _, _ in pools(tp).run(check_lm_head, tp, 1001, 0.1, bias=True,
                                                          sequence_parallel=True):
        assert max(errs.values()) <= 1e-5, errs
        assert pad_grad == 0.0 and pad_weight == 0.0


def test_a_dense_head_of_the_wrong_shape_is_refused():
    head = VocabParallelLMHead(8, 11)
    with pytest.raises(ValueError, match="expected \\(11, 8\\)"):
        head._load_full(torch.zeros(10, 8), None)
    assert head.weight.shape == (11, 8) and head.vocab_size == 11
