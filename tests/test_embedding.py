"""VocabParallelEmbedding against nn.Embedding, with a vocabulary that does not divide by TP."""

import pytest
import torch
from torch import nn

from tensorpar.layers import VocabParallelEmbedding, tp_region

from harness import mesh
from test_linear import TP_SIZES, B, H, S, _errors  # noqa: F401


def check_embedding(tp, vocab, replicated, sequence_parallel):
    m = mesh(tp=tp)
    g = m.tp_group
    torch.manual_seed(2)
    dense = nn.Embedding(vocab, H)
    ids = torch.randint(0, vocab, (B, S))
    ids[0, :4] = torch.tensor([0, vocab - 1, vocab - 2, vocab // 2])  # the edges of every shard's range
    probe = torch.randn(B, S, H)
    out = dense(ids)
    (out * probe).sum().backward()

    layer = VocabParallelEmbedding.from_dense(dense, tp_region(g, sequence_parallel=sequence_parallel),
                                             replicated=replicated)
    local_out = layer(ids)
    if sequence_parallel:
        expected_out, local_probe = out.chunk(tp, 1)[g.rank], probe.chunk(tp, 1)[g.rank]
    else:
        expected_out, local_probe = out, probe
    (local_out * local_probe).sum().backward()

    if replicated:
        expected_grad = dense.weight.grad
    else:
        padded_grad = torch.cat([dense.weight.grad, torch.zeros(layer.padded_vocab_size - vocab, H)])
        expected_grad = padded_grad.chunk(tp, 0)[g.rank]
    errs = _errors({"output": (local_out, expected_out), "weight grad": (layer.weight.grad, expected_grad)})
    torch.optim.SGD(dense.parameters(), lr=0.5).step()
    torch.optim.SGD(layer.parameters(), lr=0.5).step()
    full_after = g.all_gather(layer.weight.detach(), dim=0)[:vocab] if not replicated else layer.weight
    errs.update(_errors({"weight after SGD": (full_after, dense.weight)}))
    padding_rows = layer.weight[layer.vocab_end - layer.vocab_start :]
    return errs, float(padding_rows.abs().sum()), layer.weight.shape[0]


@pytest.mark.parametrize("tp", TP_SIZES)
@pytest.mark.parametrize(
    "mode", [(False, False), (False, True), (True, False), (True, True)], ids=["vocab", "vocab+sp", "repl", "repl+sp"]
)
def test_vocab_parallel_embedding_1001_rows_matches_nn_embedding(pools, tp, mode):
    replicated, sequence_parallel = mode
    for errs, padding_sum, rows in pools(tp).run(check_embedding, tp, 1001, replicated, sequence_parallel):
        assert max(errs.values()) <= 1e-5, errs
        assert padding_sum == 0.0, "padding rows must stay zero"
        assert rows == (1001 if replicated else -(-1001 // tp))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_low_precision_table_sums_a_frequent_rows_gradient_in_fp32(dtype):
    # 1000 lookups of row 0 with gradient 0.01 each: 10.0. Summed in bf16 the row stops near 4 (PyTorch's CPU
    # embedding backward); each addend is exact in fp32, so the wide sum rounds once.
    layer = VocabParallelEmbedding(4, 3, init=False, dtype=dtype)
    ids = torch.zeros(2, 500, dtype=torch.long)
    layer(ids).backward(torch.full((2, 500, 3), 0.01, dtype=dtype))
    expected = torch.full((1000,), 0.01, dtype=dtype).float().sum()
    assert layer.weight.grad.dtype == dtype
    torch.testing.assert_close(layer.weight.grad[0].float(), expected.expand(3), rtol=4e-3, atol=0)
    assert layer.weight.grad[1:].eq(0).all()
