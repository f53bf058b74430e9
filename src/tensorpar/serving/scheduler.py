"""Continuous batching: which tokens of which sequences the next step runs, within a token budget and the KV pool.

Every step, each running sequence feeds the tokens it has that are not cached yet: one while it decodes (the token
sampled last step), a chunk of its prompt while it prefills. Running sequences go first, oldest first, so decoding
never waits behind a long prompt; a prompt longer than what is left of the step's `token_budget` is split into
chunks over several steps (chunked prefill). Then waiting sequences join, first come first served, while the budget,
`max_running` and the pool allow: one joins only when the pool can hold all the tokens it has, so that a prompt
admitted is rarely preempted.

When a running sequence needs a block and the pool has none free, the youngest running sequence (latest arrival) is
preempted: its blocks are freed, it goes back to the front of the queue and is recomputed from its tokens (prompt and
what it generated so far) when it is readmitted. Requests therefore wait, never fail, when memory runs out; the
server refuses, before they start, sequences longer than the pool (see `tensorpar.commands.serve`).

LongRoPE (Phi-3) rotates a sequence with its short factors while it is no longer than `rope_switch` (the original
length) and with its long factors once it is longer, every token of it, as transformers' Phi-3 generation does: the
step at which a sequence passes `rope_switch` with keys cached under the short factors recomputes it from its tokens
(its blocks freed, not counted as a preemption), in chunks within the budget as a preempted sequence is, from the
blocks of its longest prefix cached with the long factors where prefix caching finds one.

With prefix caching (`BlockAllocator(prefix_caching=True)`), a sequence that joins starts from the cached blocks of
its longest cached prefix (under its RoPE factors: longrope's short and long keys are different prefixes) and feeds
only the rest. Every block a step fills is registered when the step is planned, so that a sequence joining in the
same step (another choice of the same request, or any prompt with the same start) shares it already. A sequence
whose prompt's log-probs are wanted computes its whole prompt (`reuse_prefix=False`).
"""

from __future__ import annotations

import bisect
import collections
import dataclasses

from tensorpar.errors import TensorparError
from tensorpar.serving.blocks import BlockAllocator


class QueueFull(TensorparError):
    """The waiting queue cannot take a request: `status` 429 while it is full, 400 for a request of more sequences
    than it ever holds."""

    def __init__(self, message: str, status: int = 429):
        super().__init__(message)
        self.status = status


@dataclasses.dataclass(eq=False)
class Sequence:
    """One generated continuation: its prompt, what it has generated, and how many of its tokens are cached."""

    seq_id: int
    prompt: list[int]
    max_tokens: int
    arrival: int = 0
    generated: list[int] = dataclasses.field(default_factory=list)
    computed: int = 0  # tokens whose keys and values are in the pool
    preemptions: int = 0
    long_rope: bool = False  # its cached keys were rotated with longrope's long factors
    reuse_prefix: bool = True  # may start from cached blocks (not when every prompt token's log-prob is wanted)
    cached_tokens: int = 0  # prompt tokens it found cached when it first started

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.generated

    @property
    def length(self) -> int:
        return len(self.prompt) + len(self.generated)

    @property
    def remaining(self) -> int:
        """Tokens known but not cached yet: what the next steps feed."""
        return self.length - self.computed


class Scheduler:
    def __init__(self, allocator: BlockAllocator, *, token_budget: int, max_running: int, max_waiting: int,
                 static: bool = False, rope_switch: int | None = None):
        """`static`: static batching, for comparison: sequences join only when the running batch has emptied;
        `rope_switch`: the length beyond which longrope's long factors apply (`Transformer.rope_switch_length`)."""
        if token_budget < 1 or max_running < 1 or max_waiting < 0:
            raise TensorparError(f"the scheduler needs a token budget and max_running of at least 1 and a queue of "
                                 f"at least 0, got {token_budget}, {max_running}, {max_waiting}")
        self.allocator, self.static = allocator, static
        self.token_budget, self.max_running, self.max_waiting = token_budget, max_running, max_waiting
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.running: list[Sequence] = []  # oldest first
        self.rope_switch = rope_switch
        self.preemptions = 0
        self.rope_recomputes = 0  # sequences recomputed at longrope's switch
        self.prefix_queries = self.prefix_hits = 0  # tokens of starting sequences looked up, and found cached
        self._arrivals = 0

    def add(self, seqs: list[Sequence]) -> None:
        """Queue the sequences of one request (all or none: QueueFull when the queue cannot take them)."""
        if len(seqs) > self.max_waiting:
            raise QueueFull(f"the request asks for {len(seqs)} sequences (prompts x n), more than the server queues at "
                            f"once ({self.max_waiting}: serve --max-queue)", status=400)
        if len(self.waiting) + len(seqs) > self.max_waiting:
            raise QueueFull(f"the server is overloaded: {len(self.waiting)} sequences are waiting (at most "
                            f"{self.max_waiting}); retry later")
        for seq in seqs:
            seq.arrival = self._arrivals
            self._arrivals += 1
            self.waiting.append(seq)

    def remove(self, seq: Sequence) -> None:
        """Take `seq` out (finished or cancelled) and free its blocks at once."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.allocator.free(seq.seq_id)

    @property
    def idle(self) -> bool:
        return not self.running and not self.waiting

    def schedule(self) -> list[tuple[Sequence, int]]:
        """The next step: (sequence, how many of its uncached tokens to feed), running ones first. Grows the block
        tables to hold them; may preempt."""
        budget = self.token_budget
        chunks: list[tuple[Sequence, int]] = []
        scheduled: set[int] = set()
        for seq in list(self.running):
            if budget == 0:
                break
            if self._passes_switch(seq):
                self._recompute(seq)
            if seq.remaining == 0 or seq not in self.running:  # nothing to feed, or preempted above
                continue
            n = min(seq.remaining, budget)
            if not self._make_room(seq, seq.computed + n, scheduled):
                continue
            self._feed(seq, n, chunks, scheduled)
            budget -= n
        forming = self.static and not self.running  # static batching: the batch forms only when it is empty
        joining = forming or not self.static
        while joining and (budget or forming) and self.waiting and len(self.running) < self.max_running:
            seq = self.waiting[0]
            prefix = self.allocator.cached_prefix(seq.tokens, self._salt(seq)) if seq.reuse_prefix else []
            if self.allocator.blocks_to_start(seq.length, prefix) > self.allocator.free_blocks:
                break
            self.waiting.popleft()
            bisect.insort(self.running, seq, key=lambda s: s.arrival)
            self._start(seq, prefix)
            n = min(seq.remaining, budget)
            if n:
                self._feed(seq, n, chunks, scheduled)
                budget -= n
        return chunks

    def _salt(self, seq: Sequence) -> bool:
        """What besides its tokens shapes a sequence's cached keys: longrope's long factors, or the short ones."""
        return self.rope_switch is not None and seq.length > self.rope_switch

    def _start(self, seq: Sequence, prefix: list[int]) -> None:
        """A sequence joins: its cached prefix's blocks are shared, their tokens not fed again."""
        self._share(seq, prefix)
        if seq.preemptions == 0 and not seq.generated:
            seq.cached_tokens = seq.computed

    def _share(self, seq: Sequence, prefix: list[int]) -> None:
        """`seq`, holding no blocks, starts from the cached blocks `prefix` (`BlockAllocator.cached_prefix`)."""
        if self.allocator.prefix_caching and seq.reuse_prefix:
            self.prefix_queries += seq.length
            self.prefix_hits += len(prefix) * self.allocator.block_size
        if prefix:
            self.allocator.share(seq.seq_id, prefix, self._salt(seq))
            seq.computed = len(prefix) * self.allocator.block_size
            seq.long_rope = self._salt(seq)

    def _feed(self, seq: Sequence, n: int, chunks: list[tuple[Sequence, int]], scheduled: set[int]) -> None:
        """Put `seq`'s next `n` tokens in the step, its block table grown to hold them."""
        self.allocator.grow(seq.seq_id, seq.computed + n)
        chunks.append((seq, n))
        scheduled.add(seq.seq_id)
        seq.long_rope = self._salt(seq)
        size = self.allocator.block_size
        if self.allocator.prefix_caching and (seq.computed + n) // size > seq.computed // size:
            # registered now: a sequence joining later in this step may share them, since the step writes every
            # new key of a layer before any sequence reads its keys (`PagedStep.append`)
            self.allocator.register(seq.seq_id, seq.tokens, seq.computed + n, seq.long_rope)

    def _passes_switch(self, seq: Sequence) -> bool:
        """Whether `seq` is longer than longrope's original length while its cached keys carry the short factors."""
        return self.rope_switch is not None and seq.length > self.rope_switch and seq.computed > 0 \
            and not seq.long_rope

    def _recompute(self, seq: Sequence) -> None:
        """Drop `seq`'s cache: it runs again with the long factors, keeping its place, from its first token or from
        the cached blocks of its longest prefix computed with them (another choice of its request that passed the
        switch first, in this step or before)."""
        self._drop_cache(seq)
        self.rope_recomputes += 1
        if seq.reuse_prefix:
            self._share(seq, self.allocator.cached_prefix(seq.tokens, self._salt(seq)))

    def _drop_cache(self, seq: Sequence) -> None:
        """Free `seq`'s blocks: its tokens are fed again from the first."""
        self.allocator.free(seq.seq_id)
        seq.computed = 0

    def _make_room(self, seq: Sequence, tokens: int, scheduled: set[int]) -> bool:
        """Free blocks until `seq` can hold `tokens` tokens by preempting the youngest running sequences not yet in
        this step (`seq` itself last); False when `seq` was the one preempted. A sequence whose blocks are all
        shared with others (a cached prefix) frees none: it is not preempted for blocks."""
        while not self.allocator.can_hold(seq.seq_id, tokens):
            victims = [s for s in self.running if s is not seq and s.seq_id not in scheduled
                       and self.allocator.own_blocks(s.seq_id)]
            victim = max(victims, key=lambda s: s.arrival) if victims else seq
            self.preempt(victim)
            if victim is seq:
                return False
        return True

    def preempt(self, seq: Sequence) -> None:
        """Free `seq`'s blocks and queue it first, to be recomputed from its tokens."""
        self.running.remove(seq)
        self._drop_cache(seq)
        seq.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(seq)

    def advance(self, chunks: list[tuple[Sequence, int]]) -> None:
        """Count the tokens a step has cached."""
        for seq, n in chunks:
            seq.computed += n
