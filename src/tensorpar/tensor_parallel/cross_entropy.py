"""Cross-entropy over vocabulary-sharded logits, without ever gathering the full logits.

Rank r holds logits for vocabulary columns [r*V_local, (r+1)*V_local) of the padded vocabulary.
Three quantities are reduced across the TP group, all per token, never per column:

1. the max logit (all-reduce MAX) for a stable softmax;
2. the target's logit, the sum of exp(logit - max) and, with label smoothing, the sum of the
   logits (one all-reduce SUM of the three stacked).

Then loss = log(sum_exp) - target_logit, and with label smoothing eps over C classes
(torch's definition: target distribution (1 - eps) * one_hot + eps / C):

    loss = (1 - eps) * (log Z - x_y) + eps * (log Z - sum_c x_c / C)

The gradient, softmax - target distribution, is computed locally on each rank's shard.
Padding columns (vocabulary padded to a multiple of TP) are excluded everywhere: they never win
the max, never enter Z or the smoothing sum, and get zero gradient.
"""

from __future__ import annotations

import torch

from tensorpar.distributed.comm import Group, as_group


def shard_columns(group: Group, local_vocab: int, vocab_size: int) -> tuple[int, int]:
    """(first vocabulary row of this rank's shard, how many of its rows are real, not padding)."""
    start = group.rank * local_vocab
    return start, max(0, min(local_vocab, vocab_size - start))


def local_targets(targets: torch.Tensor, start: int, n_valid: int, ignore_index: int):
    """(ignored, on this rank's shard, index within the shard (0 elsewhere)) of each target."""
    ignored = targets == ignore_index
    on_rank = (targets >= start) & (targets < start + n_valid) & ~ignored
    return ignored, on_rank, torch.where(on_rank, targets - start, torch.zeros_like(targets))


def smoothed_loss(log_z, target_logit, logit_sum, vocab_size: int, label_smoothing: float, ignored):
    """(1 - eps) (log Z - x_y) + eps (log Z - sum_c x_c / C) per token, 0 where the target is ignored."""
    loss = log_z - target_logit
    if label_smoothing > 0:
        smooth = log_z - logit_sum / vocab_size
        loss = (1.0 - label_smoothing) * loss + label_smoothing * smooth
    return loss.masked_fill(ignored, 0.0)


def subtract_target_distribution(grad, on_rank, local_target, n_valid: int, vocab_size: int,
                                 label_smoothing: float) -> None:
    """softmax -> softmax - target distribution, in place, on a [tokens, V_local] shard (padding columns left).
    A scatter of -(1 - eps) at each token's target (of 0 where the target is on another rank or ignored): no
    host-device synchronisation, as selecting the rows first would need."""
    hit = on_rank.to(grad.dtype).mul_(-(1.0 - label_smoothing))
    grad.scatter_add_(-1, local_target.unsqueeze(-1), hit.unsqueeze(-1))
    if label_smoothing > 0:
        grad[:, :n_valid] -= label_smoothing / vocab_size


def check_loss_arguments(local_vocab: int, group: Group, vocab_size: int, reduction: str, label_smoothing: float,
                         targets: torch.Tensor, tokens_shape, what: str) -> None:
    """ValueError for a reduction, a smoothing, a vocabulary size or a targets shape the losses do not take."""
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing}")
    padded_vocab = local_vocab * group.size
    if not padded_vocab - local_vocab < vocab_size <= padded_vocab:
        raise ValueError(f"vocab_size={vocab_size} does not match {what} sharded as {local_vocab} x {group.size} ranks")
    if targets.shape != tokens_shape:
        raise ValueError(f"targets shape {tuple(targets.shape)} does not match {what} {tuple(tokens_shape)}")


def reduce_losses(losses: torch.Tensor, targets: torch.Tensor, ignore_index: int, reduction: str) -> torch.Tensor:
    """Per-token losses reduced as torch does: 'none', 'sum', or 'mean' over the targets that are not ignored."""
    if reduction == "none":
        return losses.view(targets.shape)
    if reduction == "sum":
        return losses.sum()
    return losses.sum() / (targets != ignore_index).sum()


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Forward: all-reduce (max), then all-reduce (sum) of [target logit, sum exp, sum logits].
    Backward: none (the gradient is local to each vocabulary shard).

    A group of one rank with no padding column needs neither reduction: its forward is one fp32 `log_softmax`,
    whose log-probabilities the backward exponentiates in place (a third of the memory traffic of the
    max / subtract / exp / sum / divide steps the shards need)."""

    @staticmethod
    def forward(ctx, logits, targets, group: Group, vocab_size: int, ignore_index: int, label_smoothing: float):
        local_vocab = logits.shape[-1]
        start, n_valid = shard_columns(group, local_vocab, vocab_size)
        ignored, on_rank, local_target = local_targets(targets, start, n_valid, ignore_index)
        ctx.n_valid, ctx.vocab_size, ctx.label_smoothing = n_valid, vocab_size, label_smoothing
        ctx.logits_dtype = logits.dtype
        ctx.log_probs = group.size == 1 and n_valid == local_vocab
        if ctx.log_probs:
            log_probs = torch.log_softmax(logits, dim=-1, dtype=torch.float32)
            target_log_prob = log_probs.gather(-1, local_target.unsqueeze(-1)).squeeze(-1)
            log_prob_sum = log_probs.sum(dim=-1) if label_smoothing > 0 else None
            ctx.save_for_backward(log_probs, on_rank, local_target, ignored)
            # log Z - x_y = -log p_y, and log Z - sum_c x_c / C = -sum_c log p_c / C
            return smoothed_loss(0.0, target_log_prob, log_prob_sum, vocab_size, label_smoothing, ignored)

        x = logits.float()
        if n_valid < local_vocab:
            x = x.clone()
            x[..., n_valid:] = float("-inf")
        global_max = x.max(dim=-1).values
        group.all_reduce(global_max, op="max")
        x = x - global_max.unsqueeze(-1)

        target_logit = torch.where(on_rank, x.gather(-1, local_target.unsqueeze(-1)).squeeze(-1), 0.0)

        exp_x = x.exp()
        sums = [target_logit, exp_x.sum(dim=-1)]
        if label_smoothing > 0:
            sums.append(x[..., :n_valid].sum(dim=-1))
        reduced = group.all_reduce(torch.stack(sums))
        target_logit, sum_exp = reduced[0], reduced[1]

        loss = smoothed_loss(sum_exp.log(), target_logit, reduced[2] if label_smoothing > 0 else None, vocab_size,
                             label_smoothing, ignored)

        softmax = exp_x.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, on_rank, local_target, ignored)
        return loss

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_loss):
        if getattr(ctx, "consumed", False):
            raise RuntimeError("vocab_parallel_cross_entropy: backward ran twice; its softmax buffer is reused in place")
        ctx.consumed = True
        saved, on_rank, local_target, ignored = ctx.saved_tensors
        eps = ctx.label_smoothing
        # d loss / d x = softmax - target distribution; the saved buffer is ours to reuse
        grad = saved.exp_() if ctx.log_probs else saved
        subtract_target_distribution(grad.view(-1, grad.shape[-1]), on_rank.view(-1), local_target.view(-1),
                                     ctx.n_valid, ctx.vocab_size, eps)
        scale = grad_loss.masked_fill(ignored, 0.0).unsqueeze(-1)
        return grad.mul_(scale).to(ctx.logits_dtype), None, None, None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor,
    targets: torch.Tensor,
    tp_group=None,
    *,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    reduction: str = "mean",
    vocab_size: int | None = None,
) -> torch.Tensor:
    """Cross-entropy of vocabulary-sharded `logits` [..., V_local] against full `targets` [...].

    Matches ``F.cross_entropy(full_logits.flatten(0, -2), targets.flatten(), ignore_index=...,
    label_smoothing=..., reduction=...)``, computed in fp32. `vocab_size` is the real vocabulary
    size when the shards were padded (default: V_local x TP, i.e. no padding). ``reduction='mean'``
    averages over the targets that are not `ignore_index`, as torch does.
    """
    group = as_group(tp_group)
    vocab_size = logits.shape[-1] * group.size if vocab_size is None else vocab_size
    check_loss_arguments(logits.shape[-1], group, vocab_size, reduction, label_smoothing, targets, logits.shape[:-1],
                         "logits")
    losses = _VocabParallelCrossEntropy.apply(logits, targets, group, vocab_size, ignore_index, label_smoothing)
    return reduce_losses(losses, targets, ignore_index, reduction)
