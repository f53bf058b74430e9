"""Causal attention within packed documents, without an [S, S] mask (`--document-attention`).

Three kernels compute the same function (a query attends the keys of its own document up to itself):

- ``varlen``: the documents of every row gathered into a few padded batches, one per length bucket (lengths
  rounded up to 2^k or 3 x 2^(k-1)), each attended by SDPA with ``is_causal=True``: no mask at all, so SDPA takes
  its flash kernel on CPU and CUDA. A padded key sits after every real query of its document, so the causal mask
  alone keeps it out; padded queries are dropped. Memory O(S) beyond the attention itself, work O(sum of the
  documents' squared lengths), at most 2.25 x that of the exact lengths. The index tensors are built once per
  window (one host transfer of the document ids) and shared by every layer and pass.
- ``flex``: torch's flex_attention with a block mask built from the document ids (compiled; CUDA only: torch has
  no flex_attention backward on CPU). No dropout.
- ``dense``: SDPA with the [B, 1, S, S] boolean mask of `PackedDocuments.causal_mask` (the reference, and the
  fallback on devices the others do not serve).

``auto`` is ``varlen`` on CPU and CUDA, else ``dense``. Each kernel applies the layer's `AttentionPattern` (score
scale, soft cap, sliding window): a window is, for varlen, a band mask per bucket ([L, L], not [S, S]; within a
document the distance between two positions is the window's), for flex part of the block mask, for dense ANDed
into the mask; a soft cap makes the varlen and dense kernels write the softmax out (SDPA has none) and flex apply it
as its score_mod.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from tensorpar.config.choices import DOCUMENT_ATTENTION
from tensorpar.errors import TensorparError
from tensorpar.functional.attention_pattern import AttentionPattern
from tensorpar.functional.document_mask import PackedDocuments


def document_kernel(choice: str, device: torch.device | str, dropout: float = 0.0) -> str:
    """The kernel `choice` (one of DOCUMENT_ATTENTION) names on `device`: ``auto`` resolved, the others checked."""
    if choice not in DOCUMENT_ATTENTION:
        raise TensorparError(f"document attention must be one of {DOCUMENT_ATTENTION}, got {choice!r}")
    kind = torch.device(device).type
    if choice == "auto":
        return "varlen" if kind in ("cpu", "cuda") else "dense"
    if choice == "flex" and dropout > 0:
        raise TensorparError("--document-attention flex has no attention dropout: use varlen or dense with --dropout")
    return choice


def check_document_attention(choice: str, device: str | None, dropout: float = 0.0) -> None:
    """Refuse a training run's `choice` where it cannot run: flex on a device other than CUDA (torch has no
    flex_attention backward on CPU) or with attention dropout. `device` None: this machine's GPU if any, else CPU."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if choice == "flex" and torch.device(device).type != "cuda":
        raise TensorparError(f"--document-attention flex trains on CUDA only (torch {torch.__version__} has no "
                             f"flex_attention backward on {device}): use varlen or dense")
    document_kernel(choice, device, dropout)


def bucket_length(n: int) -> int:
    """The padded length of a document of `n` tokens: the smallest 2^k or 3 x 2^(k-1) that holds it."""
    p = 1 << max(n - 1, 0).bit_length()
    return 3 * p // 4 if n <= 3 * p // 4 and p >= 4 else p


@dataclasses.dataclass
class DocumentBuckets:
    """The documents of a window [B, S] as padded batches: `gathers[i]` [N_i, L_i] holds the flat (b * S + s)
    positions of bucket i's N_i documents, each padded with its own last position to L_i; `scatter` [B * S] the
    place of each position in the buckets' outputs laid end to end."""

    gathers: list[torch.Tensor]
    scatter: torch.Tensor

    @classmethod
    def of(cls, documents: PackedDocuments) -> "DocumentBuckets":
        """Built once per window and device (one host transfer of the document ids), memoised in `documents`."""
        key = ("buckets", documents.index.device)
        if key not in documents._memo:
            documents._memo[key] = cls._build(documents.index)
        return documents._memo[key]

    @classmethod
    def _build(cls, index: torch.Tensor) -> "DocumentBuckets":
        ids = index.cpu()
        starts = torch.ones_like(ids, dtype=torch.bool)
        starts[:, 1:] = ids[:, 1:] != ids[:, :-1]
        first = starts.flatten().nonzero().flatten()  # flat start of every document, in order
        lengths = torch.diff(first, append=torch.tensor([ids.numel()]))
        pads = torch.tensor([bucket_length(n) for n in lengths.tolist()])
        gathers, places, offset = [], torch.empty(ids.numel(), dtype=torch.long), 0
        for pad in pads.unique().tolist():
            mine = (pads == pad).nonzero().flatten()
            within = torch.arange(pad)
            start, length = first[mine, None], lengths[mine, None]
            gathers.append(start + torch.minimum(within, length - 1))  # [N, pad]
            slots = offset + torch.arange(len(mine))[:, None] * pad + within  # where each one lands
            real = within < length
            places[(start + within)[real]] = slots[real]
            offset += len(mine) * pad
        device = index.device
        return cls([g.to(device) for g in gathers], places.to(device))


def _repeat_heads(t: torch.Tensor, heads: int) -> torch.Tensor:
    return t if t.shape[1] == heads else t.repeat_interleave(heads // t.shape[1], dim=1)


def varlen_attention(q, k, v, documents: PackedDocuments, dropout_p: float = 0.0,
                     pattern: AttentionPattern = AttentionPattern()) -> torch.Tensor:
    """Causal attention of q [B, H, S, D] over k, v [B, H_kv, S, D] within each document, by padded length
    buckets (see the module). Returns [B, H, S, D]."""
    b, h, s, d = q.shape
    buckets = DocumentBuckets.of(documents)
    flat = [t.transpose(1, 2).reshape(b * s, t.shape[1], d) for t in (q, k, v)]  # [B * S, heads, D]
    outs = []
    for gather in buckets.gathers:
        n, pad = gather.shape
        qb, kb, vb = (t.index_select(0, gather.flatten()).view(n, pad, t.shape[1], d).transpose(1, 2) for t in flat)
        band = pattern.causal_mask(pad, q.device) if pattern.windowed(pad) else None
        out = pattern.attend(qb, _repeat_heads(kb, h), _repeat_heads(vb, h), band, band is None, dropout_p)
        outs.append(out.transpose(1, 2).reshape(n * pad, h, d))
    out = torch.cat(outs).index_select(0, buckets.scatter)
    return out.view(b, s, h, d).transpose(1, 2)


@functools.cache
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def _block_mask(documents: PackedDocuments, window: int | None):
    """flex_attention's block mask of the window's documents (and a sliding `window`), memoised per device."""
    from torch.nn.attention.flex_attention import create_block_mask

    key = ("flex", documents.index.device, window)
    if key not in documents._memo:
        index = documents.index

        def same_document(b, h, q_idx, kv_idx):
            seen = (index[b, q_idx] == index[b, kv_idx]) & (kv_idx <= q_idx)
            return seen if window is None else seen & (q_idx - kv_idx < window)

        b, s = index.shape
        documents._memo[key] = create_block_mask(same_document, b, None, s, s, device=index.device)
    return documents._memo[key]


def flex_document_attention(q, k, v, documents: PackedDocuments, compiled: bool = True,
                            pattern: AttentionPattern = AttentionPattern()) -> torch.Tensor:
    """The same by flex_attention with the documents' block mask (`compiled`: torch.compile'd, as it must be to
    be fast; eager runs it as a masked reference); a soft cap as its score_mod."""
    from torch.nn.attention.flex_attention import flex_attention

    cap = pattern.softcap
    score_mod = None if cap is None else (lambda score, b, h, q_idx, kv_idx: torch.tanh(score / cap) * cap)
    fn = _compiled_flex() if compiled else flex_attention
    return fn(q, k, v, score_mod=score_mod, block_mask=_block_mask(documents, pattern.window),
              scale=pattern.scale, enable_gqa=k.shape[1] != q.shape[1])


def dense_document_attention(q, k, v, documents: PackedDocuments, dropout_p: float = 0.0,
                             pattern: AttentionPattern = AttentionPattern()) -> torch.Tensor:
    """The same by the dense [B, 1, S, S] mask (O(S^2) memory: the reference)."""
    h, s = q.shape[1], q.shape[2]
    mask = documents.causal_mask()
    if pattern.windowed(s):
        mask = mask & pattern.causal_mask(s, q.device)
    return pattern.attend(q, _repeat_heads(k, h), _repeat_heads(v, h), mask, False, dropout_p)


def document_attention(q, k, v, documents: PackedDocuments, kernel: str = "auto", dropout_p: float = 0.0,
                       pattern: AttentionPattern = AttentionPattern()) -> torch.Tensor:
    """Causal attention of q [B, H, S, D] over k, v [B, H_kv, S, D] (H a multiple of H_kv) within each packed
    document of `documents`, by `kernel` (see the module; ``auto`` resolved by the tensors' device), the scores
    as `pattern` makes them. Dropout, if any, draws from torch's current RNG (the caller seeds it)."""
    kernel = document_kernel(kernel, q.device, dropout_p)
    if kernel == "varlen":
        return varlen_attention(q, k, v, documents, dropout_p, pattern)
    if kernel == "flex":
        return flex_document_attention(q, k, v, documents, pattern=pattern)
    return dense_document_attention(q, k, v, documents, dropout_p, pattern)
