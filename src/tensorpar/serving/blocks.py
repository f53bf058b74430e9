"""The block tables of the paged KV cache: which fixed-size blocks of the pool hold each sequence's keys and values.

The pool holds `num_blocks` blocks of `block_size` token slots on every rank (each rank its own KV heads). A
sequence holding n tokens owns ceil(n / block_size) blocks, in order: token t sits in slot t % block_size of block
table[t // block_size]. Blocks are taken from a free list as sequences grow and returned whole when a sequence
finishes, is cancelled or is preempted, so memory follows the tokens actually held (at most block_size - 1 slots
unused per sequence), unlike a cache preallocated for the longest possible sequence. Only rank 0 allocates; the
other ranks receive the tables with each step.

**Prefix caching** (`prefix_caching=True`, vLLM's automatic prefix caching). A full block whose keys and values are
computed is registered under its content: the tokens of the sequence up to its end (a chain: the previous block's
registration and the block's own tokens) and a salt for what else shapes the keys (longrope's factors). A key is
flat, (parent, tokens): `parent` is the salt for a first block, else the serial number of the previous block's
registration, never given twice, so that comparing two keys never walks the chain (a nested chain of tuples compared
recursively and raised RecursionError beyond 1000 blocks); a block registered after a parent that was taken since is
simply not found. Keys are the tokens themselves, not a hash of them: two different prefixes never meet.

A block computed beside another that registered the same prefix first (two sequences prefilling the same prompt
at once, a preempted one recomputing) registers as a second holder of that prefix, under the same serial: when one
copy is taken, the other keeps the prefix, and the blocks registered after it, findable; a copy that no sequence
holds any more goes back to the free list at once, the first holder staying cached.

A sequence that starts takes the registered blocks of its longest registered prefix instead of computing them; a
block is shared by reference count and never written again (only full blocks are shared, and a sequence writes only
after the tokens it holds). A block whose last holder leaves keeps its content while it waits in the free list, taken
for other tokens only when no block without a registered prefix is left, the least recently released first: a later
sequence with that prefix, or a preempted one coming back, finds it there.
"""

from __future__ import annotations

import collections
from typing import Hashable, Sequence

from tensorpar.errors import TensorparError


def blocks_for(tokens: int, block_size: int) -> int:
    """Blocks needed to hold `tokens` tokens."""
    return -(-tokens // block_size)


class BlockAllocator:
    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = False):
        if num_blocks < 1 or block_size < 1:
            raise TensorparError(f"the KV pool needs at least one block of at least one slot, got {num_blocks} "
                                 f"blocks of {block_size}")
        self.num_blocks, self.block_size, self.prefix_caching = num_blocks, block_size, prefix_caching
        self._free = list(range(num_blocks - 1, -1, -1))  # holding no registered prefix: popped from the end
        self._cached: collections.OrderedDict[int, None] = collections.OrderedDict()  # registered, unheld; LRU first
        self._refs = [0] * num_blocks
        self._block_of: dict[tuple, int] = {}  # a registered prefix's key (parent, tokens) -> the block found for it
        self._holders: dict[tuple, set[int]] = {}  # a key -> every block holding it (copies computed side by side)
        self._key_of: dict[int, tuple] = {}
        self._serial_of: dict[int, int] = {}  # a registered block -> its key's serial: its children's parent
        self._serials = 0
        self._registered: dict[int, tuple[int, Hashable]] = {}  # seq_id -> (its first blocks registered, the parent
        # of the next: the last one's serial, or the salt's root)
        self.tables: dict[int, list[int]] = {}

    @property
    def free_blocks(self) -> int:
        """Blocks that can be taken: holding no registered prefix, or one that no sequence holds."""
        return len(self._free) + len(self._cached)

    @property
    def used_blocks(self) -> int:
        return self.num_blocks - self.free_blocks

    @property
    def cached_blocks(self) -> int:
        """Blocks holding a registered prefix (held or not)."""
        return len(self._key_of)

    def missing(self, seq_id: int, tokens: int) -> int:
        """Blocks `seq_id` still needs to hold `tokens` tokens."""
        return max(0, blocks_for(tokens, self.block_size) - len(self.tables.get(seq_id, ())))

    def own_blocks(self, seq_id: int) -> int:
        """Blocks of `seq_id` that no other sequence holds: what freeing it gives back."""
        return sum(self._refs[block] == 1 for block in self.tables.get(seq_id, ()))

    def can_hold(self, seq_id: int, tokens: int) -> bool:
        return self.missing(seq_id, tokens) <= self.free_blocks

    def grow(self, seq_id: int, tokens: int) -> list[int]:
        """The table of `seq_id` grown to hold `tokens` tokens (raises when the pool has too few free blocks)."""
        need = self.missing(seq_id, tokens)
        if need > self.free_blocks:
            raise TensorparError(f"KV pool exhausted: {need} blocks needed, {self.free_blocks} free")
        table = self.tables.setdefault(seq_id, [])
        for _ in range(need):
            block = self._take()
            self._refs[block] = 1
            table.append(block)
        return table

    def free(self, seq_id: int) -> int:
        """Release every block of `seq_id`; how many. A registered block no other sequence holds keeps its prefix
        until it is taken: the table's last blocks are taken first (a longer prefix is worth less)."""
        table = self.tables.pop(seq_id, [])
        self._registered.pop(seq_id, None)
        for block in reversed(table):
            self._refs[block] -= 1
            if self._refs[block] == 0:
                if block in self._key_of and len(self._holders[self._key_of[block]]) == 1:
                    self._cached[block] = None
                else:  # holding no prefix, or a copy of one that another block keeps
                    for copy in self._holders.get(self._key_of.get(block), ()):
                        if copy in self._cached:  # released now, as far as the prefix goes: after its children
                            self._cached.move_to_end(copy)
                    self._unregister(block)
                    self._free.append(block)
        return len(table)

    # -- prefix caching ------------------------------------------------------------------------------------------

    def _take(self) -> int:
        if self._free:
            return self._free.pop()
        block, _ = self._cached.popitem(last=False)  # the least recently released prefix gives way
        self._unregister(block)
        return block

    def _unregister(self, block: int) -> None:
        """`block` no longer holds its prefix (if it held one); the prefix lives on in another copy, if any, so that
        the blocks registered after it are still found."""
        key = self._key_of.pop(block, None)
        if key is None:
            return
        del self._serial_of[block]
        holders = self._holders[key]
        holders.discard(block)
        if not holders:
            del self._holders[key], self._block_of[key]
        elif self._block_of[key] == block:
            self._block_of[key] = min(holders)

    def _key(self, tokens: Sequence[int], b: int, parent: Hashable) -> tuple:
        """The key of full block `b` of `tokens` after `parent` (`_serial_of` block b - 1, or the salt's root)."""
        return parent, tuple(tokens[b * self.block_size:(b + 1) * self.block_size])

    def cached_prefix(self, tokens: Sequence[int], salt: Hashable = False) -> list[int]:
        """The registered blocks of the longest prefix of `tokens` made of full blocks, leaving at least the last
        token out (its logits are wanted, so it must be computed)."""
        found = []
        if self.prefix_caching:
            parent: Hashable = (salt,)
            for b in range((len(tokens) - 1) // self.block_size):
                block = self._block_of.get(self._key(tokens, b, parent))
                if block is None:
                    break
                found.append(block)
                parent = self._serial_of[block]
        return found

    def blocks_to_start(self, tokens: int, prefix: list[int]) -> int:
        """Free blocks a sequence of `tokens` tokens starting from the registered blocks `prefix` takes up: its new
        blocks, and the blocks of `prefix` that wait in the free list."""
        return blocks_for(tokens, self.block_size) - len(prefix) + sum(block in self._cached for block in prefix)

    def share(self, seq_id: int, prefix: list[int], salt: Hashable = False) -> None:
        """Start the empty table of `seq_id` with the registered blocks `prefix` (`cached_prefix`)."""
        if self.tables.get(seq_id):
            raise TensorparError(f"sequence {seq_id} already holds blocks: a prefix is shared only at its start")
        for block in prefix:
            self._refs[block] += 1
            self._cached.pop(block, None)
        self.tables[seq_id] = list(prefix)
        self._registered[seq_id] = (len(prefix), self._serial_of[prefix[-1]] if prefix else (salt,))

    def register(self, seq_id: int, tokens: Sequence[int], computed: int, salt: Hashable = False) -> None:
        """Register the full blocks of `seq_id` among its first `computed` tokens (`tokens`), whose keys and values
        are in the pool once the step being planned has run. A prefix registered already (by a sequence that
        computed it too) keeps its block."""
        if not self.prefix_caching:
            return
        table = self.tables.get(seq_id, ())
        done, parent = self._registered.get(seq_id, (0, (salt,)))
        full = min(computed // self.block_size, len(table))
        for b in range(done, full):
            key, block = self._key(tokens, b, parent), table[b]
            if block not in self._key_of:
                found = self._block_of.get(key)
                if found is None:  # a new prefix
                    self._serials += 1
                    self._block_of[key], self._holders[key], serial = block, {block}, self._serials
                else:  # a copy of a registered prefix, computed beside it: one more holder of its key
                    self._holders[key].add(block)
                    serial = self._serial_of[found]
                self._key_of[block], self._serial_of[block] = key, serial
            if self._key_of[block] != key:  # cannot happen (a block holds the tokens it was registered with): the
                self._serials += 1  # rest of its chain under a parent nobody finds
                parent = self._serials
            else:
                parent = self._serial_of[block]
        if full > done:
            self._registered[seq_id] = (full, parent)
