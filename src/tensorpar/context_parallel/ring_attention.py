"""Context parallelism: the sequence split across the CP ranks, and causal attention across the split.

The L positions of a sequence are cut into 2 x cp chunks of C = L / (2 cp). With the "zigzag" split
(the default, as in Megatron-Core and torchtitan) CP rank i holds chunks i and 2 cp - 1 - i: under a
causal mask an early chunk sees few keys and a late one many, so pairing them gives every rank the
same work. The "contiguous" split (rank i holds chunks 2i and 2i + 1) is there to measure what the
zigzag saves: its last rank does 2 cp - 1 times the block work of its first (`split_work`).

Two ways to attend across the split (`--cp-impl`):

- ``ring`` (default): each rank keeps its queries and passes its key/value block around the ring
  (asynchronous send to rank + 1 and receive from rank - 1 of the next block while attending to the
  current one). Per (query chunk, key chunk) pair the block is skipped (the key chunk is later),
  attended in full (earlier) or with the causal mask (the same chunk); partial results are merged
  exactly through their log-sum-exp. Backward: the key/value blocks go round again, each followed by
  the gradient accumulated for it, which is finally sent back to the rank that owns the block.
  Nothing of size L is ever held: activations and saved tensors are those of L / cp positions.
- ``allgather``: the keys and values of the whole sequence are all-gathered (backward:
  reduce-scattered) and attended with a position mask, as Llama 3 did; simpler, O(L) memory.

With packed documents (`PackedDocuments`, --document-mask) a query attends only to the earlier keys of its own
document. The ring then skips every (query chunk, key chunk) block in which no query may see any key (a key
chunk wholly before the document of the chunk's first query): such blocks are neither computed nor merged, in
the forward and the backward, so with documents much shorter than a chunk a rank attends little more than its
two diagonal blocks. The blocks it does attend take the document mask; a query row with no visible key in a
block has log-sum-exp -inf there, which the merge treats as an empty partial result. The all-gather attends
each local chunk to the keys from the earliest start of its documents on, never to the blocks before them.
Every rank holds the whole window's document ids (they come with the token ids), so the masks cost no
communication; the K/V blocks still go round the whole ring.

A sliding window (`AttentionPattern.window`: Mistral, Gemma's local layers) is skipped the same way: a block whose
keys all lie before every query's window is neither computed nor merged, and the blocks at the window's edge take
its mask (with the documents', when both). Gemma 2's soft cap of the scores enters each block's scores, and its
derivative (1 - tanh^2) the backward's.

Attention dropout inside the ring draws one mask per (query chunk, key chunk) pair from the layer's
seed, so forward and backward (and recomputation) agree; the masks are a function of the chunks, not
of which rank computes them. Communication per layer and micro-batch (ring, cp ranks): forward
(cp - 1) sends of the local K and V blocks; backward (cp - 1) more of K and V, (cp - 1) of their fp32
gradients, and one final send of those gradients to their owner.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time

import torch

from tensorpar.config.choices import CP_IMPLS, CP_SPLITS
from tensorpar.distributed.comm import Group
from tensorpar.layout import require
from tensorpar.layout.rules import context_split_problem
from tensorpar.functional.attention_pattern import AttentionPattern
from tensorpar.functional.autocast import without_autocast
from tensorpar.functional.document_mask import PackedDocuments
from tensorpar.functional.dropout import fork_rng_seeded, mix_seed
from tensorpar.tensor_parallel.mappings import gather_from_sp

_TAG_FORWARD, _TAG_BACKWARD, _TAG_GRADIENT, _TAG_RETURN = 0, 1, 2, 3


def check_context_split(seq_len: int, cp: int) -> None:
    """A LayoutError unless a sequence of `seq_len` cuts into the 2 x cp equal chunks context parallelism deals."""
    require(context_split_problem(seq_len, cp))


def split_chunks(rank: int, cp: int, split: str = "zigzag") -> tuple[int, int]:
    """The two chunk indices (of 2 cp) that CP rank `rank` holds, in sequence order."""
    if split not in CP_SPLITS:
        raise ValueError(f"unknown context split {split!r}; choose one of {', '.join(CP_SPLITS)}")
    return (rank, 2 * cp - 1 - rank) if split == "zigzag" else (2 * rank, 2 * rank + 1)


def split_work(cp: int, split: str = "zigzag") -> list[float]:
    """Causal attention work of each CP rank, in (chunk x chunk) blocks: a full block counts 1, a diagonal 1/2."""
    work = []
    for rank in range(cp):
        mine = split_chunks(rank, cp, split)
        work.append(sum(qc + 0.5 for qc in mine))  # qc earlier chunks in full, its own causally
    return work


@dataclasses.dataclass(frozen=True)
class ContextSplit:
    """How one sequence of `seq_len` positions lies across the CP ranks of `group`."""

    group: Group
    seq_len: int
    split: str = "zigzag"
    impl: str = "ring"
    # Where the ring adds the CPU seconds its thread spends attending (not waiting for blocks, not descheduled),
    # and the (query chunk, key chunk) blocks it attends, forward and backward: measurements only.
    compute_seconds: list | None = dataclasses.field(default=None, compare=False)
    attended_blocks: list | None = dataclasses.field(default=None, compare=False)

    def __post_init__(self):
        check_context_split(self.seq_len, self.group.size)
        if self.impl not in CP_IMPLS:
            raise ValueError(f"unknown context-parallel attention {self.impl!r}; choose one of {', '.join(CP_IMPLS)}")

    @property
    def chunk_len(self) -> int:
        return self.seq_len // (2 * self.group.size)

    def chunks(self, rank: int | None = None) -> tuple[int, int]:
        return split_chunks(self.group.rank if rank is None else rank, self.group.size, self.split)

    def positions(self, device=None, rank: int | None = None) -> torch.Tensor:
        """The absolute positions this rank (or `rank`) holds: [seq_len / cp], in its local order."""
        c = self.chunk_len
        return torch.cat([torch.arange(k * c, (k + 1) * c, device=device) for k in self.chunks(rank)])

    def local(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's positions of a full-sequence tensor (token ids, targets) along `dim`."""
        return x.index_select(dim, self.positions(x.device))


def _repeat(x: torch.Tensor, times: int) -> torch.Tensor:
    return x if times == 1 else x.repeat_interleave(times, dim=1)


def _fold(grad: torch.Tensor, times: int) -> torch.Tensor:
    """Sum the gradient of repeated KV heads back onto the heads: [B, H, C, D] -> [B, H / times, C, D]."""
    if times == 1:
        return grad
    b, h, c, d = grad.shape
    return grad.view(b, h // times, times, c, d).sum(2)


def _dropout_keep(shape, p: float, seed: int, qc: int, kc: int, device) -> torch.Tensor:
    """The scaled keep mask of one (query chunk, key chunk) block: 1/(1-p) where kept, 0 where dropped."""
    generator = torch.Generator(device=device).manual_seed(mix_seed(seed, qc, kc))
    keep = torch.empty(shape, device=device).uniform_(generator=generator) >= p
    return keep.float() / (1.0 - p)


def _attends(split: ContextSplit, documents: PackedDocuments | None, pattern: AttentionPattern, qc: int,
             kc: int) -> bool:
    """Whether query chunk `qc` sees any key of chunk `kc`: an earlier (or the same) chunk within the window, and with
    documents one that holds part of a document its queries are in."""
    c = split.chunk_len
    return (kc <= qc and pattern.block_seen(qc * c, kc * c, c, c)
            and (documents is None or documents.live_blocks(c)[qc][kc]))


def _scores(q, k, pattern: AttentionPattern, split: ContextSplit, documents: PackedDocuments | None, qc: int,
            kc: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(the block's scaled and soft-capped scores, -inf where the query may not attend the key (later, outside the
    window, another document); tanh of the scaled scores over the cap, for the backward, or None without one)."""
    s = torch.matmul(q, k.transpose(-1, -2)) * pattern.scale_for(q.shape[-1])
    tanh = None
    if pattern.softcap is not None:
        tanh = torch.tanh(s / pattern.softcap)
        s = tanh * pattern.softcap
    c = s.shape[-1]
    mask = pattern.block_visible(qc * c, kc * c, c, c, s.device)
    if documents is not None:
        mask = documents.block_mask(qc, kc, c) if mask is None else documents.block_mask(qc, kc, c) & mask
    return (s if mask is None else s.masked_fill(~mask, float("-inf"))), tanh


def _finite(lse: torch.Tensor) -> torch.Tensor:
    """`lse` with -inf (a row that sees no key yet) as 0: exp(s - 0) of its -inf scores is 0, not NaN."""
    return lse.masked_fill(lse == float("-inf"), 0.0)


class _RingAttention(torch.autograd.Function):
    """Forward: K/V blocks passed around the CP ring (send to rank + 1, receive from rank - 1), cp - 1 times.
    Backward: the blocks passed round again followed by their accumulated gradients, then those gradients
    sent to their owners."""

    @staticmethod
    def forward(ctx, q, k, v, split: ContextSplit, pattern: AttentionPattern, dropout_p: float, dropout_seed,
                documents):
        group, n, r = split.group, split.group.size, split.group.rank
        repeat = q.shape[1] // k.shape[1]
        c = split.chunk_len
        qs = [t.float() for t in q.split(c, dim=2)]
        outs, lses = [None, None], [None, None]
        mine = split.chunks()
        block_k, block_v = k, v
        with without_autocast(q.device.type):
            for step in range(n):
                src = (r - step) % n
                pending = _exchange(group, [block_k, block_v], step, n, _TAG_FORWARD)
                ks = [_repeat(t, repeat).float() for t in block_k.split(c, dim=2)]
                vs = [_repeat(t, repeat).float() for t in block_v.split(c, dim=2)]
                started, attended = time.thread_time(), 0
                for qi, qc in enumerate(mine):
                    for ki, kc in enumerate(split.chunks(src)):
                        if not _attends(split, documents, pattern, qc, kc):
                            continue
                        attended += 1
                        s, _ = _scores(qs[qi], ks[ki], pattern, split, documents, qc, kc)
                        lse = torch.logsumexp(s, dim=-1)
                        p = torch.exp(s - _finite(lse).unsqueeze(-1))
                        if dropout_p > 0:
                            p = p * _dropout_keep(p.shape, dropout_p, dropout_seed, qc, kc, q.device)
                        outs[qi], lses[qi] = _merge(outs[qi], lses[qi], torch.matmul(p, vs[ki]), lse)
                _tally(split, started, attended)
                if pending is not None:
                    block_k, block_v = pending.result()
        out = torch.cat(outs, dim=2)
        lse = torch.cat(lses, dim=2)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.split, ctx.pattern, ctx.dropout_p, ctx.dropout_seed = split, pattern, dropout_p, dropout_seed
        ctx.documents = documents
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        split, pattern, dropout_p, dropout_seed = ctx.split, ctx.pattern, ctx.dropout_p, ctx.dropout_seed
        scale = pattern.scale_for(q.shape[-1])
        documents = ctx.documents
        group, n, r = split.group, split.group.size, split.group.rank
        repeat = q.shape[1] // k.shape[1]
        c = split.chunk_len
        mine = split.chunks()
        with without_autocast(q.device.type):
            dout = dout.float()
            delta = (dout * out).sum(-1)  # rowsum(dO * O) = rowsum(P * dP), dropout or not
            qs, dos = q.float().split(c, dim=2), dout.split(c, dim=2)
            lses, deltas = lse.split(c, dim=2), delta.split(c, dim=2)
            dqs = [torch.zeros_like(t) for t in qs]
            block_k, block_v = k, v
            grad_k = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
            grad_v = torch.zeros(v.shape, dtype=torch.float32, device=v.device)  # latent attention: Dv != D
            for step in range(n):
                src = (r - step) % n
                pending = _exchange(group, [block_k, block_v], step, n, _TAG_BACKWARD)
                ks = [_repeat(t, repeat).float() for t in block_k.split(c, dim=2)]
                vs = [_repeat(t, repeat).float() for t in block_v.split(c, dim=2)]
                dks = [torch.zeros_like(t) for t in ks]
                dvs = [torch.zeros_like(t) for t in vs]
                started, attended = time.thread_time(), 0
                for qi, qc in enumerate(mine):
                    for ki, kc in enumerate(split.chunks(src)):
                        if not _attends(split, documents, pattern, qc, kc):
                            continue
                        attended += 1
                        s, tanh = _scores(qs[qi], ks[ki], pattern, split, documents, qc, kc)
                        p = torch.exp(s - lses[qi].unsqueeze(-1))
                        dp = torch.matmul(dos[qi], vs[ki].transpose(-1, -2))
                        kept = p
                        if dropout_p > 0:
                            keep = _dropout_keep(p.shape, dropout_p, dropout_seed, qc, kc, q.device)
                            kept, dp = p * keep, dp * keep
                        dvs[ki] += torch.matmul(kept.transpose(-1, -2), dos[qi])
                        ds = p * (dp - deltas[qi].unsqueeze(-1))
                        if tanh is not None:  # through the soft cap: d(cap tanh(x / cap)) / dx = 1 - tanh^2
                            ds = ds * (1 - tanh * tanh)
                        dqs[qi] += torch.matmul(ds, ks[ki]) * scale
                        dks[ki] += torch.matmul(ds.transpose(-1, -2), qs[qi]) * scale
                grad_k += torch.cat([_fold(t, repeat) for t in dks], dim=2)
                grad_v += torch.cat([_fold(t, repeat) for t in dvs], dim=2)
                _tally(split, started, attended)
                if pending is not None:
                    block_k, block_v = pending.result()
                    # The gradient follows its block one step behind: the next rank adds to it.
                    grad_k, grad_v = _exchange(group, [grad_k, grad_v], step, n, _TAG_GRADIENT).result()
            if n > 1:  # after a full round each gradient holds every rank's share: back to the block's owner
                grad_k, grad_v = _exchange(group, [grad_k, grad_v], 0, 2, _TAG_RETURN).result()
        dq = torch.cat(dqs, dim=2).to(q.dtype)
        return dq, grad_k.to(k.dtype), grad_v.to(v.dtype), None, None, None, None, None


def _tally(split: ContextSplit, started: float, attended: int) -> None:
    if split.compute_seconds is not None:
        split.compute_seconds[0] += time.thread_time() - started
    if split.attended_blocks is not None:
        split.attended_blocks[0] += attended


def _merge(out, lse, block_out, block_lse):
    """Combine two softmax-normalised partial attentions by their log-sum-exps (exact). A row whose log-sum-exps
    are both -inf (no key seen yet, document masking) stays empty: 0 with log-sum-exp -inf."""
    if out is None:
        return block_out, block_lse
    total = torch.logaddexp(lse, block_lse)
    base = _finite(total).unsqueeze(-1)
    return out * torch.exp(lse.unsqueeze(-1) - base) + block_out * torch.exp(block_lse.unsqueeze(-1) - base), total


class _Exchange:
    """Tensors sent to the next rank of the ring while the same shapes arrive from the previous one."""

    def __init__(self, group: Group, tensors: list[torch.Tensor], tag: int):
        n, r = group.size, group.rank
        self.received = [torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in tensors]
        self.sent = [t.contiguous() for t in tensors]
        self.works = [group.isend(t, (r + 1) % n, tag=tag + 4 * i) for i, t in enumerate(self.sent)]
        self.works += [group.irecv(t, (r - 1) % n, tag=tag + 4 * i) for i, t in enumerate(self.received)]

    def result(self) -> list[torch.Tensor]:
        for work in self.works:
            work.wait()
        return self.received


def _exchange(group: Group, tensors, step: int, n: int, tag: int) -> _Exchange | None:
    """Start passing `tensors` one step round the ring, unless this is the last of `n` steps."""
    return _Exchange(group, tensors, tag) if step < n - 1 else None


def ring_attention(q, k, v, split: ContextSplit, dropout_p: float = 0.0, dropout_seed: int | None = None,
                   documents: PackedDocuments | None = None, pattern: AttentionPattern = AttentionPattern()):
    """Causal attention of this rank's queries [B, H, L/cp, D] over the whole sequence's keys and values, of which
    this rank holds [B, H_kv, L/cp, D] (values [B, H_kv, L/cp, Dv]; H a multiple of H_kv): the ring. Returns
    [B, H, L/cp, Dv]. With
    `documents` (of the whole window), within each document only, skipping the blocks that leaves empty; the
    scores as `pattern` makes them (scale, soft cap, window), skipping the blocks outside the window."""
    return _RingAttention.apply(q, k, v, split, pattern, dropout_p, dropout_seed, documents)


def _within_documents(q, k_all, v_all, keys, split: ContextSplit, documents: PackedDocuments, dropout_p: float,
                      pattern: AttentionPattern):
    """Each local chunk's queries against the gathered keys from the earliest start of their documents (or of their
    window) up to the chunk's end (the keys before it are masked for every query: not computed)."""
    order = torch.argsort(keys)  # the gathered keys in sequence order
    k_seq, v_seq = k_all.index_select(2, order), v_all.index_select(2, order)
    c, first = split.chunk_len, documents.first_visible(split.chunk_len)
    outs = []
    for qi, qc in enumerate(split.chunks()):
        lo, hi = first[qc], (qc + 1) * c
        if pattern.window is not None:
            lo = max(lo, qc * c - pattern.window + 1)
        queries, visible = torch.arange(qc * c, hi, device=q.device), torch.arange(lo, hi, device=q.device)
        mask = documents.allowed(queries, visible) & pattern.visible(queries, visible)
        outs.append(pattern.attend(q[:, :, qi * c:(qi + 1) * c], k_seq[:, :, lo:hi], v_seq[:, :, lo:hi], mask,
                                   dropout_p=dropout_p))
    return torch.cat(outs, dim=2)


def allgather_attention(q, k, v, split: ContextSplit, dropout_p: float = 0.0, dropout_seed: int | None = None,
                        documents: PackedDocuments | None = None, pattern: AttentionPattern = AttentionPattern()):
    """The same result by all-gathering K and V over the CP group (backward: reduce-scatter of their gradients)."""
    group = split.group
    k_all = gather_from_sp(k.contiguous(), group, dim=2)
    v_all = gather_from_sp(v.contiguous(), group, dim=2)
    return attend_gathered(q, k_all, v_all, split, dropout_p, dropout_seed, documents, pattern)


def attend_gathered(q, k_all, v_all, split: ContextSplit, dropout_p: float = 0.0, dropout_seed: int | None = None,
                    documents: PackedDocuments | None = None, pattern: AttentionPattern = AttentionPattern()):
    """This rank's queries [B, H, L/cp, D] over keys and values all-gathered over the CP group in rank order
    ([B, H_kv, L, D], [B, H_kv, L, Dv]: what `gather_from_sp(..., dim=2)` returns), with the causal (or document,
    window) mask of their positions: `allgather_attention`'s second half, for a caller that gathers something
    smaller and expands it (latent attention gathers its compressed latent)."""
    group = split.group
    repeat = q.shape[1] // k_all.shape[1]
    k_all, v_all = _repeat(k_all, repeat), _repeat(v_all, repeat)
    keys = torch.cat([split.positions(q.device, rank) for rank in range(group.size)])
    with fork_rng_seeded(mix_seed(dropout_seed, group.rank), q.device) if dropout_p > 0 else contextlib.nullcontext():
        if documents is not None:
            return _within_documents(q, k_all, v_all, keys, split, documents, dropout_p, pattern)
        mask = pattern.visible(split.positions(q.device), keys)  # [L/cp, L]: True where attended
        return pattern.attend(q, k_all, v_all, mask, dropout_p=dropout_p)


def keep_ring_eager() -> None:
    """Make torch.compile run the ring as it is, a graph break, never traced: its loop over (query chunk, key chunk)
    blocks, under a compiled block, was traced once per block pair (a recompilation each, up to dynamo's limit, then
    the block ran uncompiled), and so were the saved-tensor hooks it ran meanwhile. Called by
    `tensorpar.models.compile` before compiling (idempotent); not at import, as `comm.keep_collectives_eager`."""
    global ring_attention
    if not getattr(ring_attention, "_tensorpar_eager", False):
        ring_attention = torch.compiler.disable(ring_attention)
        ring_attention._tensorpar_eager = True


def context_attention(q, k, v, split: ContextSplit, dropout_p: float = 0.0, dropout_seed: int | None = None,
                      documents: PackedDocuments | None = None, pattern: AttentionPattern = AttentionPattern()):
    """Attention across the CP ranks of `split`, by its `impl` (ring or allgather); with `documents` (of the whole
    window), within each document only; the scores as `pattern` makes them (scale, soft cap, sliding window)."""
    fn = ring_attention if split.impl == "ring" else allgather_attention
    return fn(q, k, v, split, dropout_p, dropout_seed, documents, pattern)
