"""The block tables of the paged KV cache: which fixed-size blocks of the pool hold each sequence's keys and values.

The pool holds `num_blocks` blocks of `block_size` token slots on every rank (each rank its own KV heads). A
sequence holding n tokens owns ceil(n / block_size) blocks, in order: token t sits in slot t % block_size of block
table[t // block_size]. Blocks are taken from a free list as sequences grow and returned whole when a sequence
finishes, is cancelled or is preempted, so memory follows the tokens actually held (at most block_size - 1 slots
unused per sequence), unlike a cache preallocated for the longest possible sequence. Only rank 0 allocates; the
other ranks receive the tables with each step.
"""

from __future__ import annotations

from tensorpar.errors import TensorparError


def blocks_for(tokens: int, block_size: int) -> int:
    """Blocks needed to hold `tokens` tokens."""
    return -(-tokens // block_size)


class BlockAllocator:
    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1 or block_size < 1:
            raise TensorparError(f"the KV pool needs at least one block of at least one slot, got {num_blocks} "
                                 f"blocks of {block_size}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self._free = list(range(num_blocks - 1, -1, -1))  # popped from the end: block 0 first
        self.tables: dict[int, list[int]] = {}

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    @property
    def used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def missing(self, seq_id: int, tokens: int) -> int:
        """Blocks `seq_id` still needs to hold `tokens` tokens."""
        return max(0, blocks_for(tokens, self.block_size) - len(self.tables.get(seq_id, ())))

    def can_hold(self, seq_id: int, tokens: int) -> bool:
        return self.missing(seq_id, tokens) <= len(self._free)

    def grow(self, seq_id: int, tokens: int) -> list[int]:
        """The table of `seq_id` grown to hold `tokens` tokens (raises when the pool has too few free blocks)."""
        need = self.missing(seq_id, tokens)
        if need > len(self._free):
            raise TensorparError(f"KV pool exhausted: {need} blocks needed, {len(self._free)} free")
        table = self.tables.setdefault(seq_id, [])
        table.extend(self._free.pop() for _ in range(need))
        return table

    def free(self, seq_id: int) -> int:
        """Return every block of `seq_id` to the pool; how many."""
        table = self.tables.pop(seq_id, [])
        self._free.extend(reversed(table))
        return len(table)
