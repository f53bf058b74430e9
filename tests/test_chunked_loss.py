"""The LM head and the vocab-parallel loss fused per chunk of tokens (`VocabParallelLMHead.loss`) against the head's
logits fed to `vocab_parallel_cross_entropy`: loss, input, weight and bias gradients, and the same collectives (the
same elements; the loss's two all-reduces once per chunk, as its gradients are computed in the forward)."""

import pytest
import torch
from torch import nn

from tensorpar.models.placement import Placement
from tensorpar.distributed.comm import Group
from tensorpar.layers import VocabParallelLMHead, tp_region, vocab_parallel_cross_entropy
from tensorpar.models import Transformer, get_config
from tensorpar.pipeline_parallel.weight_grad import WeightGradQueue

from checks import rel_err
from harness import mesh

B, S, H = 2, 12, 16  # 24 tokens; S divides by 2 (sequence parallelism)
TOL = 1e-6


def _counts(m):
    return {k: (v.calls, v.elements) for k, v in m.stats.snapshot().items()}


def _run(head, h, targets, m, label_smoothing, chunk_tokens=None, reduction="mean"):
    """Loss, gradients (input, weight, bias) and collectives of one forward and backward, unfused without
    `chunk_tokens`. With reduction "none" the per-token losses are weighed unevenly (the backward's path)."""
    head.zero_grad(set_to_none=True)
    x = h.detach().clone().requires_grad_()
    m.stats.reset()
    if chunk_tokens is None:
        loss = vocab_parallel_cross_entropy(head(x), targets, m, vocab_size=head.vocab_size,
                                            label_smoothing=label_smoothing, reduction=reduction)
    else:
        loss = head.loss(x, targets, label_smoothing=label_smoothing, chunk_tokens=chunk_tokens, reduction=reduction)
    if reduction == "none":
        loss = (loss * torch.linspace(0.5, 2.0, loss.numel()).view(loss.shape)).sum()
    (1.7 * loss).backward()
    grads = [x.grad, head.weight.grad] + ([head.bias.grad] if head.bias is not None else [])
    return loss.detach(), grads, _counts(m)


def check_fused_head_loss(tp, cases, sequence_parallel=False):
    """`cases`: (vocab, label_smoothing, chunk_tokens, bias, tokens per sequence). Every error, per case."""
    m = mesh(tp=tp)
    region = tp_region(m.tp_group, sequence_parallel=sequence_parallel)
    results = []
    for vocab, label_smoothing, chunk, bias, seq in cases:
        torch.manual_seed(vocab + tp + chunk)
        head = VocabParallelLMHead.from_dense(nn.Linear(H, vocab, bias=bias), region)
        with torch.no_grad():
            if bias:
                head.bias.normal_()
        h = torch.randn(B, seq // tp if region.sequence_parallel else seq, H)
        targets = torch.randint(0, vocab, (B, seq))
        targets[0, :3] = -100  # ignored
        targets[1, 0] = vocab - 1  # the last real row, next to the padding
        targets[1, 1] = 0
        for reduction in ("mean", "none"):
            ref_loss, ref_grads, ref_counts = _run(head, h, targets, m, label_smoothing, reduction=reduction)
            loss, grads, counts = _run(head, h, targets, m, label_smoothing, chunk, reduction)
            errs = [rel_err(loss, ref_loss)] + [rel_err(a, b) for a, b in zip(grads, ref_grads)]
            padding = head.weight.grad[max(0, vocab - head.vocab_start):].abs().sum().item()
            if tp > 1 and reduction == "mean":  # the max and the stacked sums once per chunk instead of once
                calls, elements = ref_counts[("all_reduce", "tp")]
                ref_counts[("all_reduce", "tp")] = (calls + 2 * (-(-B * seq // chunk) - 1), elements)
            results.append((max(errs), padding, counts == ref_counts, counts))
    return results


# chunk sizes 5 and 7 do not divide the 24 tokens, 8 does, 1000 is one chunk
CASES = [(1001, 0.0, 5, False, S), (1001, 0.1, 7, True, S), (1001, 0.1, 8, False, S), (1001, 0.0, 1000, True, S)]


@pytest.mark.parametrize("tp", [1, 2, 3, 4])
def test_fused_head_loss_matches_logits_then_loss(pools, tp):
    for rank, results in enumerate(pools(tp).run(check_fused_head_loss, tp, CASES)):
        for case, (err, padding, same_collectives, counts) in zip([c for c in CASES for _ in "mn"], results):
            assert err <= TOL, f"rank {rank} {case}: relative error {err:.2e}"
            assert padding == 0.0, "the padding rows get no gradient"
            assert same_collectives, counts


def test_fused_head_loss_llama3_vocabulary_and_sequence_parallelism(pools):
    cases = [(128256, 0.1, 4, True, 6), (128256, 0.0, 6, False, 6)]
    sp_cases = [(1001, 0.1, 7, True, S), (1001, 0.0, 24, False, S)]
    for rank, results in enumerate(pools(2).run(check_fused_head_loss, 2, cases)
                                   + pools(2).run(check_fused_head_loss, 2, sp_cases, True)):
        for err, padding, same_collectives, counts in results:
            assert err <= TOL and padding == 0.0 and same_collectives, (rank, err, padding, counts)


CONFIGS = {"tiny": get_config("tiny").replace(num_layers=1), "tiny-gpt2": get_config("tiny-gpt2").replace(num_layers=1)}


def check_model(tp, config, sequence_parallel, chunk):
    m = mesh(tp=tp)
    cfg = CONFIGS[config]
    torch.manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (B, S))
    targets = torch.randint(0, cfg.vocab_size, (B, S))
    targets[0, :2] = -100
    losses, grads = [], []
    for loss_chunk_tokens in (None, chunk):
        model = Transformer(cfg, Placement.on(m, sequence_parallel=sequence_parallel, loss_chunk_tokens=loss_chunk_tokens),
                            seed=5)
        loss = model(ids, targets)
        loss.backward()
        losses.append(loss.detach())
        grads.append({n: p.grad for n, p in model.named_parameters()})
    errs = {"loss": rel_err(losses[1], losses[0])}
    # The key bias's gradient is zero up to rounding (softmax ignores a shift shared by all keys): errors are
    # relative to max(|grad|, 1e-3 |all grads|), as in test_transformer.
    floor = 1e-3 * torch.sqrt(sum(g.double().pow(2).sum() for g in grads[0].values())).item()
    errs.update({n: (grads[1][n] - g).double().norm().item() / max(g.double().norm().item(), floor)
                 for n, g in grads[0].items()})
    return errs


@pytest.mark.parametrize("config,sp", [("tiny", False), ("tiny-gpt2", False), ("tiny-gpt2", True)])
def test_model_with_fused_loss_matches_the_unfused_model(pools, config, sp):
    for rank, errs in enumerate(pools(2).run(check_model, 2, config, sp, 5)):
        bad = {k: f"{v:.1e}" for k, v in errs.items() if v > TOL}
        assert not bad, f"rank {rank}: {bad}"


def test_rejects_bad_arguments():
    head = VocabParallelLMHead(8, 11)
    h, targets = torch.randn(3, 8), torch.zeros(3, dtype=torch.long)
    with pytest.raises(ValueError, match="chunk_tokens"):
        head.loss(h, targets, chunk_tokens=0)
    with pytest.raises(ValueError, match="does not match"):
        head.loss(h, targets[:2], chunk_tokens=2)
    with pytest.raises(Exception, match="loss_chunk_tokens"):
        Transformer(CONFIGS["tiny"], Placement.on(Group.single("tp"), loss_chunk_tokens=0))


def test_bf16_autocast_and_the_split_backward():
    """Under bf16 autocast the head's GEMMs run in bf16 and the loss in fp32, as unfused: the same loss. The
    gradients round differently: unfused, the scaled logit gradient is rounded to bf16 and the input gradient is a
    bf16 GEMM's output; fused, the unscaled logit gradient is rounded, the GEMMs' outputs are scaled in fp32 and the
    weight gradient is summed over the chunks in fp32. Against the fp32 head and loss, every fused gradient is at
    least as close as the unfused one. Under a split backward (zero-bubble) the head keeps the unfused path: its
    weight gradient waits in the queue."""
    torch.manual_seed(1)
    head = VocabParallelLMHead.from_dense(nn.Linear(H, 1001, bias=True), Group.single("tp"))
    h, targets = torch.randn(B, S, H), torch.randint(0, 1001, (B, S))
    group = Group.single("tp")
    _, exact, _ = _run(head, h, targets, group, 0.1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref_loss, ref_grads, _ = _run(head, h, targets, group, 0.1)
        loss, grads, _ = _run(head, h, targets, group, 0.1, 7)
    assert loss.dtype == torch.float32 and rel_err(loss, ref_loss) <= TOL
    errs = [(rel_err(a, e), rel_err(b, e)) for a, b, e in zip(grads, ref_grads, exact)]
    assert all(fused <= unfused <= 1e-2 for fused, unfused in errs), errs

    queue = WeightGradQueue()
    split = VocabParallelLMHead.from_dense(nn.Linear(H, 1001, bias=False), tp_region(group, weight_grads=queue))
    split.loss(h.requires_grad_(), targets, chunk_tokens=7).backward()
    assert split.weight.grad is None and h.grad is not None
    queue.close("mb")
    queue.run("mb")
    assert split.weight.grad is not None
