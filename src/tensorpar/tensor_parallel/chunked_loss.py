"""The LM head and the vocabulary-parallel cross-entropy fused, one chunk of tokens at a time.

`vocab_parallel_cross_entropy(F.linear(h, W, b), targets, ...)` holds every token's logits [N, V/tp] in fp32
(8192 tokens x 128,256 vocabulary: 4.2 GB) from the forward until the backward. Fused, the head's GEMM runs
per chunk of `chunk_tokens` tokens and each chunk's logits are dropped as soon as they are reduced to, per
token, this rank's log-sum-exp over its real (unpadded) columns, the target's logit when it is in this rank's
shard and, with label smoothing, the sum of the real logits. The ranks combine those with the collectives of the
unfused loss (all-reduce MAX, one stacked all-reduce SUM):

    lse = m + log(sum_r exp(lse_r - m)),  m = max_r lse_r
    loss = (1 - eps) * (lse - x_y) + eps * (lse - sum_c x_c / V)

Two ways to get the gradients, with the same softmax, exp(x - lse):

- **In the forward** (training's case: the loss summed or averaged, gradients wanted). Each chunk's statistics are
  combined over the ranks at once (the two all-reduces per chunk instead of once), so the chunk's softmax is known
  while its logits are still there: g = softmax - target distribution, dh_chunk = g W (a partial sum over the TP
  ranks, summed by the region entry's backward), dW += g^T h_chunk, db += sum g. The backward only multiplies those
  by the incoming scalar gradient (so the GEMMs take the unscaled logit gradient, rounded to their dtype). Saved:
  dh (the size of h, which is no longer needed) and dW, db in fp32. No GEMM is run twice: the head costs what the unfused head costs (Liger-Kernel's fused linear cross-entropy does
  the same on one rank).
- **In the backward** (per-token losses, `reduction="none"`, whose gradient may weigh each token differently).
  The statistics are combined once after all chunks; the backward recomputes each chunk's logits and softmax.

With a final soft cap (Gemma 2: x -> cap * tanh(x / cap), elementwise, so each rank caps its own columns) the loss
takes the capped logits, and the gradient is multiplied by 1 - tanh^2 before the GEMMs.

Dtypes are the unfused path's: the GEMMs run in the dtype the head's F.linear runs in (bf16 under autocast or
with bf16 parameters), the loss and softmax in fp32. The weight gradient is accumulated over chunks in fp32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tensorpar.distributed.comm import Group
from tensorpar.functional.autocast import without_autocast
from tensorpar.tensor_parallel.cross_entropy import (check_loss_arguments, local_targets, reduce_losses, shard_columns,
                                                    smoothed_loss, subtract_target_distribution)


def _chunk_logits(h_chunk, weight, bias, n_valid: int, softcap: float | None):
    """(this chunk's real logits in fp32, soft-capped; tanh(x / cap) or None; the GEMM's dtype)."""
    logits = F.linear(h_chunk, weight, bias)
    x = logits.float()[:, :n_valid]  # the chunk's own buffer when fp32: overwritten by the softmax
    tanh = None
    if softcap is not None:
        tanh = torch.tanh(x / softcap)
        x = tanh * softcap
    return x, tanh, logits.dtype


def _local_statistics(x, on_rank, local_target, label_smoothing: float, keep: bool = True):
    """Per token of the chunk: this rank's log-sum-exp, target logit (0 off this rank) and logit sum (with smoothing;
    else None). `x` is left as it is when `keep`, else overwritten."""
    n = x.shape[0]
    if x.shape[1] == 0:  # only padding rows on this rank: no target here, lse -inf
        zeros = torch.zeros(n, device=x.device)
        return torch.full((n,), float("-inf"), device=x.device), zeros, zeros if label_smoothing > 0 else None
    logit_sum = x.sum(dim=-1) if label_smoothing > 0 else None
    target_logit = torch.where(on_rank, x.gather(-1, local_target[:, None]).squeeze(-1), 0.0)
    m = x.max(dim=-1).values
    shifted = x - m[:, None] if keep else x.sub_(m[:, None])
    return m + shifted.exp_().sum(dim=-1).log(), target_logit, logit_sum


def _combine(group: Group, local_lse, target_logit, logit_sum):
    """(lse, target logit, logit sum or None) over the whole vocabulary: all-reduce (max), then all-reduce (sum) of
    [exp(lse_r - max), target logit, logit sum] stacked."""
    global_max = local_lse.clone()
    group.all_reduce(global_max, op="max")
    sums = [(local_lse - global_max).exp(), target_logit] + ([] if logit_sum is None else [logit_sum])
    reduced = group.all_reduce(torch.stack(sums))
    return global_max + reduced[0].log(), reduced[1], reduced[2] if logit_sum is not None else None


def _logit_gradient(x, tanh, lse, on_rank, local_target, scale, local_vocab: int, vocab_size: int, eps: float):
    """d loss / d logits of a chunk [tokens, local_vocab] in fp32: softmax = exp(x - lse) (in place of the logits
    `x`) - target distribution, times the per-token `scale`, times 1 - tanh^2 under a soft cap; 0 in the padding
    columns."""
    n_valid = x.shape[1]
    g = x.sub_(lse[:, None]).exp_()
    if n_valid < local_vocab:
        g = F.pad(g, (0, local_vocab - n_valid))
    subtract_target_distribution(g, on_rank, local_target, n_valid, vocab_size, eps)
    g.mul_(scale[:, None])
    if tanh is not None:
        g[:, :n_valid].mul_(1 - tanh * tanh)
    return g


def _accumulate(g, h_chunk, w, grad_h, grad_w, grad_b, lo: int, hi: int) -> None:
    """The head's gradients from a chunk's logit gradient `g` (in the GEMMs' dtype): dh[lo:hi] = g W (a partial sum
    over the TP ranks), dW += g^T h, db += sum g; the fp32 buffers (None where not wanted) add without a copy."""
    if grad_h is not None:
        grad_h[lo:hi] = g @ w
    if grad_w is not None and g.dtype == torch.float32:
        grad_w.addmm_(g.t(), h_chunk)
    elif grad_w is not None:
        grad_w.add_(g.t() @ h_chunk)  # converted to fp32 as it is added, without a copy
    if grad_b is not None:
        grad_b += g.sum(0, dtype=torch.float32)


class _ChunkedHeadCrossEntropy(torch.autograd.Function):
    """Forward: all-reduce (max) of the per-token local log-sum-exp, then all-reduce (sum) of
    [exp(lse_r - max), target logit, sum of logits] stacked: per chunk when the gradients are computed in the
    forward (`grads_now`: the output is the summed loss), else once after all chunks (the per-token losses).
    Backward: none (dh is a partial sum over TP: the caller's region entry reduces it)."""

    @staticmethod
    def forward(ctx, h, weight, bias, targets, group: Group, vocab_size: int, ignore_index: int,
                label_smoothing: float, chunk_tokens: int, softcap: float | None, grads_now: bool):
        start, n_valid = shard_columns(group, weight.shape[0], vocab_size)
        ignored, on_rank, local_target = local_targets(targets, start, n_valid, ignore_index)
        n, eps = h.shape[0], label_smoothing
        chunks = [(lo, min(n, lo + chunk_tokens)) for lo in range(0, n, chunk_tokens)]
        ctx.n_valid, ctx.vocab_size, ctx.label_smoothing = n_valid, vocab_size, label_smoothing
        ctx.chunk_tokens, ctx.softcap, ctx.grads_now = chunk_tokens, softcap, grads_now
        if not grads_now:
            stats = [torch.empty(n, device=h.device) for _ in range(3)]
            for lo, hi in chunks:
                x, _, ctx.logits_dtype = _chunk_logits(h[lo:hi], weight, bias, n_valid, softcap)
                for buffer, value in zip(stats, _local_statistics(x, on_rank[lo:hi], local_target[lo:hi], eps,
                                                                  keep=False)):
                    if value is not None:
                        buffer[lo:hi] = value
            lse, target_logit, logit_sum = _combine(group, stats[0], stats[1], stats[2] if eps > 0 else None)
            ctx.save_for_backward(h, weight, bias, lse, on_rank, local_target, ignored)
            return smoothed_loss(lse, target_logit, logit_sum, vocab_size, eps, ignored)

        kept = (~ignored).float()
        need = ctx.needs_input_grad
        grad_h = torch.empty(h.shape, dtype=torch.float32, device=h.device) if need[0] else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need[1] else None
        grad_b = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) if bias is not None and need[2] \
            else None
        losses, w = torch.empty(n, device=h.device), None
        for lo, hi in chunks:
            x, tanh, dt = _chunk_logits(h[lo:hi], weight, bias, n_valid, softcap)
            stats = _local_statistics(x, on_rank[lo:hi], local_target[lo:hi], eps)
            lse, target_logit, logit_sum = _combine(group, *stats)
            losses[lo:hi] = smoothed_loss(lse, target_logit, logit_sum, vocab_size, eps, ignored[lo:hi])
            g = _logit_gradient(x, tanh, lse, on_rank[lo:hi], local_target[lo:hi], kept[lo:hi], weight.shape[0],
                                vocab_size, eps)
            w = weight.to(dt) if w is None else w  # cast once (the GEMMs' dtype shows in the first chunk's logits)
            with without_autocast(h.device.type):
                _accumulate(g.to(dt), h[lo:hi].to(dt), w, grad_h, grad_w, grad_b, lo, hi)
        ctx.save_for_backward(grad_h, grad_w, grad_b)
        ctx.dtypes = h.dtype, weight.dtype, None if bias is None else bias.dtype
        return losses.sum()

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_loss):
        if ctx.grads_now:  # the gradients of the summed loss, times the incoming scalar, in fp32 then cast
            grads = [None if g is None else g.mul_(grad_loss.float()).to(dtype)
                     for g, dtype in zip(ctx.saved_tensors, ctx.dtypes)]
            return (*grads, None, None, None, None, None, None, None, None)
        h, weight, bias, lse, on_rank, local_target, ignored = ctx.saved_tensors
        dt, scale = ctx.logits_dtype, grad_loss.float().masked_fill(ignored, 0.0)
        w, b = weight.to(dt), None if bias is None else bias.to(dt)
        need_w, need_b = ctx.needs_input_grad[1], bias is not None and ctx.needs_input_grad[2]  # not a frozen head's
        grad_h = torch.empty_like(h)
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        grad_b = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) if need_b else None
        with without_autocast(h.device.type):
            for lo in range(0, h.shape[0], ctx.chunk_tokens):
                hi = min(h.shape[0], lo + ctx.chunk_tokens)
                h_chunk = h[lo:hi].to(dt)
                x, tanh, _ = _chunk_logits(h_chunk, w, b, ctx.n_valid, ctx.softcap)
                g = _logit_gradient(x, tanh, lse[lo:hi], on_rank[lo:hi], local_target[lo:hi], scale[lo:hi],
                                    weight.shape[0], ctx.vocab_size, ctx.label_smoothing)
                _accumulate(g.to(dt), h_chunk, w, grad_h, grad_w, grad_b, lo, hi)
        grad_b = None if grad_b is None else grad_b.to(bias.dtype)
        grad_w = None if grad_w is None else grad_w.to(weight.dtype)
        return grad_h, grad_w, grad_b, None, None, None, None, None, None, None, None


def chunked_head_cross_entropy(
    h: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    group: Group,
    *,
    vocab_size: int,
    chunk_tokens: int,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    reduction: str = "mean",
    softcap: float | None = None,
) -> torch.Tensor:
    """``vocab_parallel_cross_entropy(F.linear(h, weight, bias), targets, group, vocab_size=...)`` computed
    `chunk_tokens` tokens at a time, never holding more than one chunk's logits. `h` [..., H] is inside the TP
    region (replicated over the group), `weight` [V_pad / tp, H] this rank's rows of the padded head, `targets`
    [...] the full targets; `softcap`: the logits soft-capped first (cap * tanh(logits / cap)). With a summed or
    averaged loss whose gradient is wanted the gradients are computed in the forward (the module's docstring).

    Forward: all-reduce (max) and all-reduce (sum), per chunk with the gradients in the forward, else once.
    Backward: none; the input gradient is a partial sum over the group, for the region entry's backward."""
    check_loss_arguments(weight.shape[0], group, vocab_size, reduction, label_smoothing, targets, h.shape[:-1],
                         "a head")
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be at least 1, got {chunk_tokens}")
    wanted = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (h, weight, bias))
    grads_now = wanted and reduction != "none"
    out = _ChunkedHeadCrossEntropy.apply(h.reshape(-1, h.shape[-1]), weight, bias, targets.reshape(-1), group,
                                         vocab_size, ignore_index, label_smoothing, chunk_tokens, softcap, grads_now)
    if not grads_now:
        return reduce_losses(out, targets, ignore_index, reduction)
    return out if reduction == "sum" else out / (targets != ignore_index).sum()
