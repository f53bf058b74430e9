"""The LM head and the vocabulary-parallel cross-entropy fused, one chunk of tokens at a time.

`vocab_parallel_cross_entropy(F.linear(h, W, b), targets, ...)` holds every token's logits [N, V/tp] in fp32
(8192 tokens x 128,256 vocabulary: 4.2 GB) from the forward until the backward. Fused, the head's GEMM runs
per chunk of `chunk_tokens` tokens and each chunk's logits are dropped as soon as they are reduced to, per
token, this rank's log-sum-exp over its real (unpadded) columns, the target's logit when it is in this rank's
shard and, with label smoothing, the sum of the real logits. After the last chunk the ranks combine those
once, with the collectives of the unfused loss (all-reduce MAX, one stacked all-reduce SUM):

    lse = m + log(sum_r exp(lse_r - m)),  m = max_r lse_r
    loss = (1 - eps) * (lse - x_y) + eps * (lse - sum_c x_c / V)

Saved for the backward: the per-token lse [N] (fp32) besides h, W, b and the targets, which are alive anyway.
The backward recomputes each chunk's logits, softmax = exp(x - lse), subtracts the target distribution and
multiplies by the incoming gradient: dh_chunk = g W (a partial sum over the TP ranks, summed by the region
entry's backward) and dW += g^T h_chunk, db += sum g.

With a final soft cap (Gemma 2: x -> cap * tanh(x / cap), elementwise, so each rank caps its own columns) the loss
takes the capped logits, and the backward multiplies their gradient by 1 - tanh^2 before the GEMMs.

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


class _ChunkedHeadCrossEntropy(torch.autograd.Function):
    """Forward: all-reduce (max) of the per-token local log-sum-exp, then all-reduce (sum) of
    [exp(lse_r - max), target logit, sum of logits] stacked, once after all chunks.
    Backward: none (dh is a partial sum over TP: the caller's region entry reduces it)."""

    @staticmethod
    def forward(ctx, h, weight, bias, targets, group: Group, vocab_size: int, ignore_index: int,
                label_smoothing: float, chunk_tokens: int, softcap: float | None):
        start, n_valid = shard_columns(group, weight.shape[0], vocab_size)
        ignored, on_rank, local_target = local_targets(targets, start, n_valid, ignore_index)
        n = h.shape[0]
        local_lse = torch.full((n,), float("-inf"), device=h.device)
        target_logit = torch.zeros(n, device=h.device)
        logit_sum = torch.zeros(n, device=h.device)
        logits_dtype = h.dtype
        for lo in range(0, n, chunk_tokens):
            hi = min(n, lo + chunk_tokens)
            logits = F.linear(h[lo:hi], weight, bias)
            logits_dtype = logits.dtype
            x = logits.float()[:, :n_valid]  # the chunk's own buffer when fp32: overwritten below
            del logits
            if softcap is not None:
                x = torch.tanh(x / softcap) * softcap
            if n_valid == 0:  # only padding rows on this rank: no target here, lse stays -inf
                continue
            if label_smoothing > 0:
                logit_sum[lo:hi] = x.sum(dim=-1)
            picked = x.gather(-1, local_target[lo:hi, None]).squeeze(-1)
            target_logit[lo:hi] = torch.where(on_rank[lo:hi], picked, 0.0)
            chunk_max = x.max(dim=-1).values
            local_lse[lo:hi] = chunk_max + x.sub_(chunk_max[:, None]).exp_().sum(dim=-1).log()
            del x
        global_max = local_lse.clone()
        group.all_reduce(global_max, op="max")
        sums = [(local_lse - global_max).exp(), target_logit]
        if label_smoothing > 0:
            sums.append(logit_sum)
        reduced = group.all_reduce(torch.stack(sums))
        lse = global_max + reduced[0].log()
        loss = smoothed_loss(lse, reduced[1], reduced[2] if label_smoothing > 0 else None, vocab_size,
                             label_smoothing, ignored)

        ctx.save_for_backward(h, weight, bias, lse, on_rank, local_target, ignored)
        ctx.n_valid, ctx.vocab_size, ctx.label_smoothing = n_valid, vocab_size, label_smoothing
        ctx.chunk_tokens, ctx.logits_dtype, ctx.softcap = chunk_tokens, logits_dtype, softcap
        return loss

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_loss):
        h, weight, bias, lse, on_rank, local_target, ignored = ctx.saved_tensors
        dt, eps, n_valid = ctx.logits_dtype, ctx.label_smoothing, ctx.n_valid
        scale = grad_loss.float().masked_fill(ignored, 0.0)
        w, b = weight.to(dt), None if bias is None else bias.to(dt)
        grad_h = torch.empty_like(h)
        need_w, need_b = ctx.needs_input_grad[1], bias is not None and ctx.needs_input_grad[2]  # not a frozen head's
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        grad_b = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) if need_b else None
        with without_autocast(h.device.type):
            for lo in range(0, h.shape[0], ctx.chunk_tokens):
                hi = min(h.shape[0], lo + ctx.chunk_tokens)
                h_chunk = h[lo:hi].to(dt)
                g = F.linear(h_chunk, w, b).float()
                tanh = None
                if ctx.softcap is not None:
                    tanh = torch.tanh(g / ctx.softcap)
                    g = tanh * ctx.softcap
                g.sub_(lse[lo:hi, None]).exp_()  # the softmax, computed in place of the logits
                g[:, n_valid:] = 0.0
                subtract_target_distribution(g, on_rank[lo:hi], local_target[lo:hi], n_valid, ctx.vocab_size, eps)
                g.mul_(scale[lo:hi, None])
                if tanh is not None:
                    g.mul_(1 - tanh * tanh)
                g = g.to(dt)
                grad_h[lo:hi] = g @ w
                if grad_w is not None and dt == torch.float32:
                    grad_w.addmm_(g.t(), h_chunk)
                elif grad_w is not None:
                    grad_w.add_(g.t() @ h_chunk)  # converted to fp32 as it is added, without a copy
                if grad_b is not None:
                    grad_b += g.sum(0, dtype=torch.float32)
        grad_b = None if grad_b is None else grad_b.to(bias.dtype)
        grad_w = None if grad_w is None else grad_w.to(weight.dtype)
        return grad_h, grad_w, grad_b, None, None, None, None, None, None, None


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
    [...] the full targets; `softcap`: the logits soft-capped first (cap * tanh(logits / cap)).

    Forward: all-reduce (max) and all-reduce (sum), once after all chunks, as the unfused loss.
    Backward: none; the input gradient is a partial sum over the group, for the region entry's backward."""
    check_loss_arguments(weight.shape[0], group, vocab_size, reduction, label_smoothing, targets, h.shape[:-1],
                         "a head")
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be at least 1, got {chunk_tokens}")
    losses = _ChunkedHeadCrossEntropy.apply(h.reshape(-1, h.shape[-1]), weight, bias, targets.reshape(-1), group,
                                            vocab_size, ignore_index, label_smoothing, chunk_tokens, softcap)
    return reduce_losses(losses, targets, ignore_index, reduction)
