"""Packed documents in a window of tokens: which document each position belongs to, and where in it it sits.

The data pipeline packs documents back to back with an EOS after each, and a window may span several. With
document masking (`--document-mask`) a token attends only to the earlier tokens of its own document, and its
position (RoPE angle or learned position) counts from its document's first token.

The EOS belongs to the document it ends, as in Megatron's --reset-attention-mask / --reset-position-ids: it is
that document's last token (it attends to the document and is attended to by nothing after it); the next document
starts after it. The EOS position's target, the next document's first token, stays in the loss (predicted from
the ended document alone, as a first token is). A window that starts inside a document sees that document's
tail as a document of its own, starting at position 0.
"""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass
class PackedDocuments:
    """`index` [B, S]: the document of each position, counted from 0 in each row (non-decreasing along S);
    `position` [B, S]: the position within that document. Both int64, on the tokens' device."""

    index: torch.Tensor
    position: torch.Tensor
    _memo: dict = dataclasses.field(default_factory=dict, init=False, repr=False, compare=False)

    @classmethod
    def from_tokens(cls, ids: torch.Tensor, eos_id: int) -> "PackedDocuments":
        """The documents of the token windows `ids` [B, S], each ending at (and including) an `eos_id`."""
        eos = (ids == eos_id).long()
        return cls.from_index(eos.cumsum(1) - eos)  # the EOSes strictly before each position

    @classmethod
    def from_index(cls, index: torch.Tensor) -> "PackedDocuments":
        """The documents whose number at each position is `index` [B, S] (non-decreasing along each row): packed
        instruction examples, whose rows say where each one lies."""
        arange = torch.arange(index.shape[1], device=index.device).expand_as(index)
        starts = torch.ones_like(index, dtype=torch.bool)
        starts[:, 1:] = index[:, 1:] != index[:, :-1]
        first = torch.where(starts, arange, torch.zeros_like(arange)).cummax(1).values
        return cls(index, arange - first)

    @property
    def seq_len(self) -> int:
        return self.index.shape[1]

    def select(self, positions: torch.Tensor) -> "PackedDocuments":
        """The documents of the window positions `positions` only (a CP rank's chunks)."""
        return PackedDocuments(self.index.index_select(1, positions), self.position.index_select(1, positions))

    def allowed(self, queries: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """[B, 1, Q, K] bool, True where query position `queries[i]` may attend key position `keys[j]` (window
        positions): same document, key not after the query. Broadcasts over heads as SDPA's `attn_mask`."""
        same = self.index[:, queries].unsqueeze(2) == self.index[:, keys].unsqueeze(1)
        return (same & (keys.unsqueeze(0) <= queries.unsqueeze(1))).unsqueeze(1)

    def causal_mask(self) -> torch.Tensor:
        """`allowed` of the whole window over itself, [B, 1, S, S] (built once)."""
        if "causal" not in self._memo:
            every = torch.arange(self.seq_len, device=self.index.device)
            self._memo["causal"] = self.allowed(every, every)
        return self._memo["causal"]

    def block_mask(self, query_block: int, key_block: int, block: int) -> torch.Tensor:
        """`allowed` of query block `query_block` over key block `key_block` (blocks of `block` positions),
        [B, 1, block, block]: built once per window, whatever the layers and passes that ask for it."""
        key = ("block", query_block, key_block, block)
        if key not in self._memo:
            within = torch.arange(block, device=self.index.device)
            self._memo[key] = self.allowed(query_block * block + within, key_block * block + within)
        return self._memo[key]

    def live_blocks(self, block: int) -> list[list[bool]]:
        """live[qb][kb] for the window cut into blocks of `block` positions: whether any query of block qb may
        attend any key of block kb in any row (False for every kb > qb). A key block before the query block holds
        an allowed pair exactly when its last key is in the document of the query block's first query (documents
        never decrease along the window). One host transfer, memoised per block size."""
        key = ("live", block)
        if key not in self._memo:
            firsts, lasts = self.index[:, ::block], self.index[:, block - 1::block]
            n = firsts.shape[1]
            live = (firsts.unsqueeze(2) == lasts.unsqueeze(1)).any(0)
            live |= torch.eye(n, dtype=torch.bool, device=live.device)
            self._memo[key] = (live & torch.ones(n, n, dtype=torch.bool, device=live.device).tril()).tolist()
        return self._memo[key]

    def first_visible(self, block: int) -> list[int]:
        """For each block of `block` positions, the earliest key position any of its queries may attend: the start
        of the document of its first query, the earliest over the rows. One host transfer, memoised."""
        key = ("first", block)
        if key not in self._memo:
            starts = torch.arange(self.seq_len, device=self.index.device) - self.position
            self._memo[key] = starts[:, ::block].min(0).values.tolist()
        return self._memo[key]
