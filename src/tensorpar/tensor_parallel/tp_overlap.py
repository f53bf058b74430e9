"""Tensor-parallel communication hidden behind compute, at the two edges of a TP region.

Megatron-Core's LinearWithGradAccumulationAndAsyncCommunication and its chunked sequence-parallel
all-gather, without CUDA streams: a collective is started asynchronously (``async_op=True``, through
`Group.*_async`, so it is counted, timed and explained on failure like any other) and waited for
only where its result is needed; the GEMMs that do not need it run meanwhile. On NCCL the collective
runs on its own stream; on gloo on the process group's worker thread.

============================  ===========================================  ===========================================
op                            forward                                      backward
============================  ===========================================  ===========================================
column_parallel_in            identity (f); with SP, all-gather along the  all-reduce (SP: reduce-scatter) of the input
(enter the region, then the   sequence in `chunks` pieces: each piece's    gradient, started asynchronously once the
column-parallel linears that  GEMMs start as soon as it has arrived,       input-gradient GEMMs are done; the weight-
share its input)              while the next pieces travel                 gradient GEMMs run while it travels
row_parallel_out              all-reduce (g) (SP: reduce-scatter along     none (SP: all-gather of the output gradient
(the row-parallel linear,     the sequence) in `chunks` pieces of the      in `chunks` pieces: each piece's input- and
then leave the region, then   tokens: each piece's collective starts as    weight-gradient GEMMs run as soon as it
add the replicated bias)      soon as its GEMM is done, while the next     has arrived, while the next travel; the
                              piece's GEMM runs                            bias gradient's all-reduce travels beside)
copy_params_to_tp             identity                                     one all-reduce of all the parameters'
(replicated parameters used                                                gradients, flattened together (coalesced)
on a sequence shard)
============================  ===========================================  ===========================================

Both compute what `copy_to_tp` / `gather_from_sp` followed by `F.linear`, and `F.linear` followed by
`reduce_from_tp` / `reduce_scatter_to_sp` compute (tensorpar.tensor_parallel.mappings), with the same bytes moved,
up to the order of float additions. Activations are batch-first, the sequence in dimension 1: [B, S, H].

The pieces are slices of the batch where the micro-batch holds at least two sequences: a batch slice is
contiguous in the shard and in the gathered tensor alike, so chunking costs no copies beyond the unchunked
path's (on 2 CPU cores, sequence slices cost the TP 2 + SP step 0.18 s of strided copies and smaller GEMMs).
A micro-batch of one sequence is cut along the sequence instead.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tensorpar.distributed.comm import Group
from tensorpar.functional.autocast import autocast_dtype

DEFAULT_CHUNKS = 2


def _pieces(length: int, chunks: int) -> int:
    """The number of equal pieces (at most `chunks`, at least 1) that `length` positions split into."""
    return max(k for k in range(1, max(1, min(chunks, length)) + 1) if length % k == 0)


def _by_batch(batch: int, chunks: int) -> bool:
    """Whether the SP pieces are batch slices (the micro-batch holds at least two sequences to split)."""
    return _pieces(batch, chunks) > 1


def sp_pieces(batch: int, shard_len: int, chunks: int = DEFAULT_CHUNKS) -> int:
    """How many pieces the SP overlap sends each gather and reduce-scatter of a micro-batch of `batch` sequences
    in (`shard_len`: the sequence positions per rank): batch slices where there are two sequences or more, else
    sequence slices."""
    return _pieces(batch, chunks) if _by_batch(batch, chunks) else _pieces(shard_len, chunks)


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype the GEMMs run in: autocast's where it is on (as F.linear's would), else x's. Collectives keep the
    dtypes the plain path sends (the activation's and its gradient's), so the bytes are the same."""
    return autocast_dtype(x)


def _cast(t, dtype):
    return None if t is None else t.to(dtype)


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1])


def _weight_grads(dys, x, needs) -> list:
    """The W half of the backward: [dW_0, db_0, dW_1, db_1, ...] of y_i = x W_i^T + b_i (None where not needed)."""
    x2, out = _flat(x), []
    for i, dy in enumerate(dys):
        dy2 = None if dy is None else _flat(dy)
        out.append(dy2.t().mm(x2) if dy2 is not None and needs[2 * i] else None)
        out.append(dy2.sum(0) if dy2 is not None and needs[2 * i + 1] else None)
    return out


def _gathered_linears(x, group: Group, chunks: int, weights, biases, dtype):
    """All-gather the sequence shards `x` [B, s, H] in pieces, computing each piece's linears as it arrives.
    Returns (the gathered [B, tp*s, H] input, the outputs [B, tp*s, out_i])."""
    if _by_batch(x.shape[0], chunks):
        return _gathered_linears_by_batch(x, group, chunks, weights, biases, dtype)
    b, s, h = x.shape
    tp, k = group.size, _pieces(s, chunks)
    c = s // k
    pieces = [x[:, j * c:(j + 1) * c].contiguous() for j in range(k)]
    received = [x.new_empty((tp * b, c, h)) for _ in range(k)]
    pending = [group.all_gather_async(received[j], pieces[j]) for j in range(k)]
    full = x.new_empty((b, tp, k, c, h), dtype=dtype)  # position r*s + j*c + t is full[:, r, j, t]
    outs = [x.new_empty((b, tp, k, c, w.shape[0]), dtype=dtype) for w in weights]
    for j in range(k):
        pending[j].wait()
        piece = received[j].view(tp, b, c, h).to(dtype)  # rank r's piece j, rank-major
        full[:, :, j] = piece.transpose(0, 1)
        for out, w, bias in zip(outs, weights, biases):
            out[:, :, j] = F.linear(piece, w, bias).transpose(0, 1)
    return full.view(b, tp * s, h), [out.view(b, tp * s, -1) for out in outs]


def _linear_into(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias) -> None:
    """out = x W^T + b for 2-D contiguous `out` and `x`, written in place (no temporary)."""
    if bias is None:
        torch.mm(x, weight.t(), out=out)
    else:
        torch.addmm(bias, x, weight.t(), out=out)


def _gathered_linears_by_batch(x, group: Group, chunks: int, weights, biases, dtype):
    """`_gathered_linears` with the pieces along the batch: a batch slice is contiguous both in the shard
    [B, s, H] and in the gathered [B, tp*s, H], so the pieces cost no copy beyond the one that puts the gathered
    rank-major blocks in sequence order (which the unchunked gather makes too), and the GEMMs write their
    rows of the outputs in place."""
    b, s, h = x.shape
    tp, k = group.size, _pieces(b, chunks)
    c, seq = b // k, group.size * s
    x = x.contiguous()
    received = [x.new_empty((tp * c, s, h)) for _ in range(k)]  # rank-major
    pending = [group.all_gather_async(received[j], x[j * c:(j + 1) * c]) for j in range(k)]
    full = x.new_empty((b, tp, s, h), dtype=dtype)  # = [B, tp*s, H] in sequence order
    outs = [x.new_empty((b, seq, w.shape[0]), dtype=dtype) for w in weights]
    for j in range(k):
        rows = slice(j * c, (j + 1) * c)
        pending[j].wait()
        full[rows] = received[j].view(tp, c, s, h).transpose(0, 1)
        piece = full[rows].view(c * seq, h)
        for out, w, bias in zip(outs, weights, biases):
            _linear_into(out[rows].view(c * seq, -1), piece, w, bias)
    return full.view(b, seq, h), outs


class _ColumnParallelIn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group: Group, sequence_parallel: bool, chunks: int, *params):
        dtype = _compute_dtype(x)
        weights, biases = [_cast(w, dtype) for w in params[0::2]], [_cast(b, dtype) for b in params[1::2]]
        if sequence_parallel:
            full, outs = _gathered_linears(x, group, chunks, weights, biases, dtype)
        else:
            full = x.to(dtype)
            outs = [F.linear(full, w, bias) for w, bias in zip(weights, biases)]
        ctx.group, ctx.sequence_parallel = group, sequence_parallel
        ctx.x_dtype, ctx.param_dtypes = x.dtype, [None if p is None else p.dtype for p in params]
        ctx.save_for_backward(full, *weights)
        return tuple(outs)

    @staticmethod
    def backward(ctx, *dys):
        full, *weights = ctx.saved_tensors
        group, tp = ctx.group, ctx.group.size
        used = [(dy, w) for dy, w in zip(dys, weights) if dy is not None]
        # B: the input gradient, summed over the linears, then its reduction started.
        if ctx.sequence_parallel:
            b, seq, h = full.shape
            # Rank-major [tp, B, S/tp, H], so that each rank's block of the reduce-scatter is contiguous.
            dx = sum(torch.matmul(dy.to(w.dtype).reshape(b, tp, seq // tp, -1).transpose(0, 1), w) for dy, w in used)
            dx = dx.to(ctx.x_dtype).reshape(tp * b, seq // tp, h)
            grad_x = dx.new_empty((b, seq // tp, h))
            pending = group.reduce_scatter_async(grad_x, dx)
        else:
            grad_x = sum(torch.matmul(dy.to(w.dtype), w) for dy, w in used).to(ctx.x_dtype).contiguous()
            pending = group.all_reduce_async(grad_x)
        # W: the weight gradients while it travels.
        params_grads = [_cast(g, dtype) for g, dtype in zip(
            _weight_grads([_cast(dy, full.dtype) for dy in dys], full, ctx.needs_input_grad[4:]), ctx.param_dtypes)]
        pending.wait()
        return (grad_x, None, None, None, *params_grads)


def _reduced_product(x, weight, group: Group, sequence_parallel: bool, chunks: int):
    """x W^T summed over the group (SP: reduce-scattered along the sequence), in pieces whose collectives start
    as soon as each piece's GEMM is done."""
    if sequence_parallel and _by_batch(x.shape[0], chunks):
        return _reduce_scattered_product_by_batch(x, weight, group, chunks)
    if sequence_parallel:
        b, seq, n_in = x.shape
        tp = group.size
        k = _pieces(seq // tp, chunks)
        c = seq // tp // k
        pieces = x.view(b, tp, k, c, n_in)
        partial, outs, pending = [], [], []
        for j in range(k):
            # Piece j of every rank's sequence shard, rank-major: rank r's block is its own piece j.
            partial.append(torch.matmul(pieces[:, :, j].transpose(0, 1), weight.t()).reshape(tp * b, c, -1))
            outs.append(x.new_empty((b, c, weight.shape[0])))
            pending.append(group.reduce_scatter_async(outs[j], partial[j]))
        for p in pending:
            p.wait()
        return torch.cat(outs, 1)
    x2 = _flat(x)
    y = x2.new_empty((x2.shape[0], weight.shape[0]))
    pending = []
    n, k = x2.shape[0], max(1, min(chunks, x2.shape[0]))
    for lo, hi in ((n * j // k, n * (j + 1) // k) for j in range(k)):
        torch.mm(x2[lo:hi], weight.t(), out=y[lo:hi])
        pending.append(group.all_reduce_async(y[lo:hi]))
    for p in pending:
        p.wait()
    return y.view(*x.shape[:-1], weight.shape[0])


def _reduce_scattered_product_by_batch(x, weight, group: Group, chunks: int):
    """`_reduced_product` under SP with the pieces along the batch: each batch slice's product is put in rank-major
    order (the one copy the unchunked reduce-scatter makes too) and reduce-scattered straight into its rows of the
    [B, S/tp, out] result, while the next slice's GEMM runs."""
    b, seq, _ = x.shape
    tp, k = group.size, _pieces(b, chunks)
    c, s = b // k, seq // group.size
    out = x.new_empty((b, s, weight.shape[0]))
    partial, pending = [], []
    for j in range(k):
        y = torch.matmul(x[j * c:(j + 1) * c], weight.t())  # [c, seq, out]
        partial.append(y.view(c, tp, s, -1).transpose(0, 1).reshape(tp * c, s, -1))  # rank r's block: its shard
        pending.append(group.reduce_scatter_async(out[j * c:(j + 1) * c], partial[j]))
    for p in pending:
        p.wait()
    return out


def _gathered_grad_products_by_batch(dy, x, weight, group: Group, chunks: int, need_dw: bool = True):
    """The SP backward of the row-parallel product with the pieces along the batch: all-gather the output
    gradient's shards `dy` [B, s, out] slice by slice, computing each slice's input gradient (in place, its rows
    of dx) and weight-gradient share as it arrives. Returns (dx [B, tp*s, in], dW, None for a frozen weight)."""
    b, s, n_out = dy.shape
    tp, k = group.size, _pieces(b, chunks)
    c, seq, n_in = b // k, group.size * s, x.shape[-1]
    dy = dy.contiguous()
    received = [dy.new_empty((tp * c, s, n_out)) for _ in range(k)]  # rank-major
    pending = [group.all_gather_async(received[j], dy[j * c:(j + 1) * c]) for j in range(k)]
    dx = x.new_empty((b, seq, n_in))
    dw = None
    for j in range(k):
        rows = slice(j * c, (j + 1) * c)
        pending[j].wait()
        g = received[j].view(tp, c, s, n_out).transpose(0, 1).reshape(c * seq, n_out)  # sequence order
        torch.mm(g, weight, out=dx[rows].view(c * seq, n_in))
        if need_dw:
            part = g.t().mm(x[rows].reshape(c * seq, n_in))
            dw = part if dw is None else dw.add_(part)
    return dx, dw


def _gathered_grad_products_by_sequence(dy, x, weight, group: Group, chunks: int, need_dw: bool = True):
    """`_gathered_grad_products_by_batch` with the pieces along the sequence (a micro-batch of one sequence)."""
    b, seq, n_in = x.shape
    tp = group.size
    s = seq // tp
    k = _pieces(s, chunks)
    c = s // k
    pieces = [dy[:, j * c:(j + 1) * c].contiguous() for j in range(k)]
    received = [dy.new_empty((tp * b, c, dy.shape[-1])) for _ in range(k)]
    pending = [group.all_gather_async(received[j], pieces[j]) for j in range(k)]
    x_pieces = x.view(b, tp, k, c, n_in)
    dx = x.new_empty((b, tp, k, c, n_in))
    dw = None
    for j in range(k):
        pending[j].wait()
        g = received[j].view(tp, b, c, -1)
        dx[:, :, j] = torch.matmul(g, weight).transpose(0, 1)
        if need_dw:
            part = _flat(g).t().mm(_flat(x_pieces[:, :, j].transpose(0, 1)))
            dw = part if dw is None else dw.add_(part)
    return dx.view(b, seq, n_in), dw


class _RowParallelOut(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, group: Group, sequence_parallel: bool, chunks: int):
        ctx.group, ctx.sequence_parallel, ctx.chunks, ctx.has_bias = group, sequence_parallel, chunks, bias is not None
        ctx.dtypes = x.dtype, weight.dtype
        dtype = _compute_dtype(x)
        x, weight = x.to(dtype), weight.to(dtype)
        ctx.save_for_backward(x, weight)
        y = _reduced_product(x, weight, group, sequence_parallel, chunks)
        return y if bias is None else y + bias

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        x_dtype, w_dtype = ctx.dtypes
        db = _flat(dy).sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        dy = dy.to(x.dtype)  # the product's gradient, in the dtype the product (and its reduction) had
        need_dw = ctx.needs_input_grad[1]  # not for a frozen weight (LoRA's base)
        if not ctx.sequence_parallel:
            dw = _flat(dy).t().mm(_flat(x)).to(w_dtype) if need_dw else None
            return torch.matmul(dy, weight).to(x_dtype), dw, db, None, None, None
        group = ctx.group
        # Each rank saw its sequence shard only: the replicated bias's gradient is summed over the ranks,
        # travelling while the all-gather and the GEMMs below run.
        bias_pending = group.all_reduce_async(db) if db is not None else None
        by_batch = _by_batch(x.shape[0], ctx.chunks)
        gathered_grad_products = _gathered_grad_products_by_batch if by_batch else _gathered_grad_products_by_sequence
        dx, dw = gathered_grad_products(dy, x, weight, group, ctx.chunks, need_dw)
        if bias_pending is not None:
            bias_pending.wait()
        return dx.to(x_dtype), None if dw is None else dw.to(w_dtype), db, None, None, None


class _CopyParamsToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, group: Group, *params):
        ctx.group = group
        ctx.shapes = [p.shape for p in params]
        return tuple(p.view_as(p) for p in params)

    @staticmethod
    def backward(ctx, *grads):
        ref = next(g for g in grads if g is not None)
        flat = torch.cat([(g if g is not None else ref.new_zeros(s)).reshape(-1) for g, s in zip(grads, ctx.shapes)])
        ctx.group.all_reduce(flat)
        return (None, *(part.view(s) for part, s in zip(flat.split([s.numel() for s in ctx.shapes]), ctx.shapes)))


def column_parallel_in(x: torch.Tensor, params, group: Group, sequence_parallel: bool,
                       chunks: int = DEFAULT_CHUNKS) -> list[torch.Tensor]:
    """Enter a TP region with `x` (replicated, or with SP this rank's sequence shard) and apply the column-parallel
    linears `params` [(weight, bias or None), ...] that share it: [x W_i^T + b_i, ...] over the full sequence.
    Forward identity (SP: chunked all-gather); backward all-reduce (SP: reduce-scatter) of the input gradient,
    overlapped with the weight-gradient GEMMs."""
    if group.size == 1:
        return [F.linear(x, w, bias) for w, bias in params]
    flat = [t for pair in params for t in pair]
    return list(_ColumnParallelIn.apply(x, group, sequence_parallel, chunks, *flat))


def row_parallel_out(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, group: Group,
                     sequence_parallel: bool, chunks: int = DEFAULT_CHUNKS) -> torch.Tensor:
    """The row-parallel product x W^T summed over the TP group (SP: and split along the sequence), leaving the TP
    region, plus the replicated `bias`. Forward all-reduce (SP: reduce-scatter) in chunks overlapped with the
    GEMM's next chunk; backward no communication (SP: chunked all-gather of the output gradient overlapped with
    the GEMMs, and the all-reduce of the bias gradient, which each rank computed from its shard only)."""
    if group.size == 1:
        return F.linear(x, weight, bias)
    return _RowParallelOut.apply(x, weight, bias, group, sequence_parallel, chunks)


def copy_params_to_tp(params, group: Group) -> list[torch.Tensor]:
    """Replicated parameters (a norm's weight and bias) entering a sequence-parallel region: forward identity;
    backward one all-reduce of all their gradients together, each rank having computed them from its sequence
    shard (rather than one small all-reduce per parameter)."""
    params = list(params)
    if group.size == 1 or not torch.is_grad_enabled():
        # Without autograd there is nothing to do, and torch.compile, tracing the Function under no_grad, returned
        # only its first output (a LayerNorm's weight without its bias).
        return params
    return list(_CopyParamsToTP.apply(group, *params))
