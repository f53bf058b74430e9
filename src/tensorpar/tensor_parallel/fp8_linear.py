"""FP8 linear products whose scales agree across the tensor-parallel group.

`fp8_linears(x, weights, recipe, group, split)` computes ``[x W_i^T for W_i in weights]`` with the GEMMs in fp8
(`tensorpar.tensor_parallel.fp8_scaling`: dynamic power-of-two scales, ``tensorwise`` or ``rowwise``). A
tensor's scale comes from the amax of the whole tensor, not of this rank's shard, so that every rank quantises
to exactly the fp8 values one process would: the only difference from TP 1 is the fp32 summation order. Where
the axis an amax runs over is split across the group, the shards' amaxes are combined by one all-reduce (max) of
all of them together: at most one small all-reduce per call in the forward and one in the backward, counted in
the group's CommStats like any other collective. `split` says what is split:

==========  ==============================  ======================================  ================================
split       the layer                       forward all-reduce (max) of             backward all-reduce (max) of
==========  ==============================  ======================================  ================================
"out"       column-parallel: x replicated   tensorwise: each W's amax;              the output gradients' amaxes
            (or all-gathered), W's rows     rowwise: none (W's rows are whole)      (tensorwise: each g's; rowwise:
            split                                                                   per token, and each W's per
                                                                                    input feature)
"in"        row-parallel: x's features and  tensorwise: x's and W's amax;           none (g is whole on every rank)
            W's columns split; outputs are  rowwise: x's per-token and W's per-
            partial sums                    output-feature amaxes
None        unsplit (a group of one)        none                                    none
==========  ==============================  ======================================  ================================

Not reduced, by design: a tensor whose amax axis is whole on every rank (a replicated or all-gathered input,
a row-parallel layer's output gradient), and anything across data- or context-parallel ranks: each rank
scales its own tokens, as one process scales each micro-batch. KV heads replicated on several TP ranks
quantise each copy's partial output gradient before the copies' gradients are summed. The collectives of the
region (`copy_to_tp`, `reduce_from_tp`, the SP all-gather and reduce-scatter) are the caller's, unchanged.
"""

from __future__ import annotations

import torch

from tensorpar.distributed.comm import Group
from tensorpar.tensor_parallel.fp8_scaling import E4M3, Fp8Recipe, amax, pow2_scale, quantize, scaled_mm


def _reduce_max(amaxes: list[torch.Tensor], group: Group | None) -> list[torch.Tensor]:
    """Each tensor's elementwise max over the group, all in one all-reduce."""
    if group is None or group.size == 1 or not amaxes:
        return amaxes
    flat = group.all_reduce(torch.cat([a.reshape(-1) for a in amaxes]), op="max")
    return [piece.view_as(a) for piece, a in zip(flat.split([a.numel() for a in amaxes]), amaxes)]


def _row_axis(rowwise: bool) -> int | None:
    return -1 if rowwise else None


class _Fp8Linears(torch.autograd.Function):
    """Forward: [x W_i^T] in fp8 (one all-reduce (max) of the split amaxes, see the module docstring). Backward:
    the input gradient sum_i g_i W_i and the weight gradients g_i^T x (rowwise: in the compute dtype), with one
    all-reduce (max) of the amaxes split "out" splits (the output gradients', and rowwise W's per input feature).

    The weights are saved as they are (the parameters: no copy; under ZeRO-3 gathered again for the backward, as
    for any layer) and quantised again in the backward: with the forward's scale (tensorwise: the same fp8 values)
    or per input feature (rowwise). Tensorwise keeps the input in fp8, rowwise in the compute dtype, and neither
    keeps it where no weight needs a gradient."""

    @staticmethod
    def forward(ctx, x, recipe: Fp8Recipe, group, split, *weights):
        ys, amaxes, x2, xq, x_scale, w_scales = _forward(x, recipe, group, split, weights)
        # The input serves the weights' gradients alone: frozen weights (LoRA's base) keep none of it.
        kept = (x2 if recipe.rowwise else xq) if any(ctx.needs_input_grad[4:]) else None
        if recipe.rowwise:
            ctx.save_for_backward(kept, *weights)
        else:
            ctx.save_for_backward(kept, x_scale, *weights, *w_scales)
        ctx.recipe, ctx.group, ctx.split, ctx.n = recipe, group, split, len(weights)
        ctx.x_shape, ctx.x_dtype = x.shape, x.dtype
        ctx.mark_non_differentiable(amaxes)
        return (*ys, amaxes)

    @staticmethod
    def backward(ctx, *grads):
        recipe, n = ctx.recipe, ctx.n
        grads = grads[:n]  # not the amaxes
        x_saved, *rest = ctx.saved_tensors
        if recipe.rowwise:
            weights = rest
        else:
            x_scale, weights, w_scales = rest[0], rest[1:1 + n], rest[1 + n:]
        gs = [(g if g is not None else torch.zeros(*ctx.x_shape[:-1], w.shape[0], dtype=ctx.x_dtype,
                                                  device=w.device)).reshape(-1, w.shape[0])
              for g, w in zip(grads, weights)]
        g_amax = [amax(g, _row_axis(recipe.rowwise)) for g in gs]
        w_col_amax = [amax(w, 0) for w in weights] if recipe.rowwise else []  # the input gradient's W^T rows
        if ctx.split == "out":
            g_amax, w_col_amax = _split_at(_reduce_max(g_amax + w_col_amax, ctx.group), n)
        if not torch.compiler.is_compiling():  # a side effect torch.compile cannot trace: compiled runs skip it
            recipe.stats.observe("grad_output", torch.stack([amax(a) for a in g_amax]))  # amax(): empty-safe
        g_scales = [pow2_scale(a, recipe.grad_dtype) for a in g_amax]
        gq = [quantize(g, s, recipe.grad_dtype) for g, s in zip(gs, g_scales)]
        if recipe.rowwise:
            w_scales = [pow2_scale(a, E4M3).t() for a in w_col_amax]  # [in, 1]: per row of W^T
        dx = None
        if ctx.needs_input_grad[0]:
            # g W as (g / s_g) @ ((W^T) / s_w)^T
            parts = [scaled_mm(q, s, quantize(w.t(), ws, E4M3), ws, torch.float32)
                     for q, s, w, ws in zip(gq, g_scales, weights, w_scales)]
            dx = (parts[0] if n == 1 else torch.stack(parts).sum(0)).to(ctx.x_dtype).view(ctx.x_shape)
        dws = []
        for i, (g, q, s, w) in enumerate(zip(gs, gq, g_scales, weights)):
            if not ctx.needs_input_grad[4 + i]:
                dws.append(None)
            elif recipe.rowwise:
                dws.append(g.t().to(w.dtype) @ x_saved.to(w.dtype))
            else:  # g^T x as (g^T / s_g) @ ((x^T) / s_x)^T
                dws.append(scaled_mm(q.t(), s, x_saved.t(), x_scale, w.dtype))
        return (dx, None, None, None, *dws)


def _forward(x, recipe: Fp8Recipe, group, split, weights):
    """The forward's products [x W_i^T] and the amaxes of x and of the weights (one all-reduce (max) where `split`
    says an amax axis is split), with what the backward keeps: (ys, amaxes, x2, xq, x_scale, w_scales). The amaxes
    are returned for the caller to record: a side effect in the autograd Function would make torch.compile give up
    tracing it."""
    x2 = x.reshape(-1, x.shape[-1])
    axis = _row_axis(recipe.rowwise)
    x_amax = amax(x2, axis)
    w_amax = [amax(w, axis) for w in weights]
    if split == "in":
        x_amax, *w_amax = _reduce_max([x_amax, *w_amax], group)
    elif split == "out" and not recipe.rowwise:  # rowwise: W's rows are whole on this rank
        w_amax = _reduce_max(w_amax, group)
    x_scale = pow2_scale(x_amax, E4M3)
    xq = quantize(x2, x_scale, E4M3)
    w_scales = [pow2_scale(a, E4M3) for a in w_amax]
    ys = [scaled_mm(xq, x_scale, quantize(w, s, E4M3), s, x.dtype).view(*x.shape[:-1], w.shape[0])
          for w, s in zip(weights, w_scales)]
    # amax(), not Tensor.amax(): rowwise x_amax is [rows, 1], and an expert may receive no rows
    amaxes = torch.stack([amax(x_amax), torch.stack([amax(a) for a in w_amax]).amax()])
    return ys, amaxes, x2, xq, x_scale, w_scales


def _split_at(items: list, n: int) -> tuple[list, list]:
    return items[:n], items[n:]


def fp8_linears(x: torch.Tensor, weights: list[torch.Tensor], recipe: Fp8Recipe, group: Group | None = None,
                split: str | None = None) -> list[torch.Tensor]:
    """[x W_i^T] with fp8 GEMMs scaled by `recipe`; `split` ("out", "in" or None) says which of x's and W's axes
    are split over `group` (see the module docstring). No bias: the caller adds it in the compute dtype."""
    if split not in ("out", "in", None):
        raise ValueError(f"split must be 'out', 'in' or None, got {split!r}")
    if torch.is_grad_enabled() and (x.requires_grad or any(w.requires_grad for w in weights)):
        *ys, amaxes = _Fp8Linears.apply(x, recipe, group, split, *weights)
    else:  # nothing to differentiate (evaluation, generation): no autograd Function to trace
        ys, amaxes = _forward(x, recipe, group, split, weights)[:2]
    recipe.stats.observe("input", amaxes[0])
    recipe.stats.observe("weight", amaxes[1])
    return ys


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, recipe: Fp8Recipe, group: Group | None = None,
               split: str | None = None) -> torch.Tensor:
    """x W^T with fp8 GEMMs (`fp8_linears` of one weight)."""
    return fp8_linears(x, [weight], recipe, group, split)[0]
