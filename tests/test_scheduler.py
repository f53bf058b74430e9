"""The serving scheduler and its block tables, in this process: chunked prefill within the token budget, decoding
first, admission while the pool holds a sequence's tokens, preemption of the youngest by recompute, blocks returned
at once, and the paged pool holding more sequences than a preallocated cache of the same memory."""

import pytest

from tensorpar.errors import TensorparError
from tensorpar.serving.blocks import BlockAllocator, blocks_for
from tensorpar.serving.scheduler import QueueFull, Scheduler, Sequence


def _scheduler(blocks=64, block_size=4, budget=16, running=8, waiting=16):
    return Scheduler(BlockAllocator(blocks, block_size), token_budget=budget, max_running=running,
                     max_waiting=waiting)


def _run(s: Scheduler, chunks, sample=True):
    """Advance a step as the engine does: count the cached tokens, append a token to each sequence that is caught
    up, finish those that reached max_tokens."""
    s.advance(chunks)
    for seq, _ in chunks:
        if seq.remaining == 0 and sample:
            seq.generated.append(7)
            if len(seq.generated) >= seq.max_tokens:
                s.remove(seq)


def test_blocks_follow_the_tokens_and_come_back():
    a = BlockAllocator(10, 4)
    assert a.grow(1, 5) == [0, 1] and a.grow(1, 8) == [0, 1] and a.grow(1, 9) == [0, 1, 2]
    assert a.grow(2, 1) == [3] and a.used_blocks == 4 and a.missing(2, 13) == 3
    assert a.free(1) == 3 and a.free_blocks == 9 and a.free(1) == 0
    with pytest.raises(TensorparError, match="KV pool exhausted"):
        a.grow(3, 41)
    assert a.used_blocks == 1 and blocks_for(0, 4) == 0 and blocks_for(4, 4) == 1 and blocks_for(5, 4) == 2


def test_long_prompts_are_chunked_and_decoding_goes_first():
    s = _scheduler(budget=16)
    long, short = Sequence(0, list(range(40)), max_tokens=3), Sequence(1, [1, 2, 3], max_tokens=3)
    s.add([long, short])
    step = s.schedule()
    assert [(q.seq_id, n) for q, n in step] == [(0, 16)]  # the budget, all to the first prompt
    _run(s, step)
    step = s.schedule()
    assert [(q.seq_id, n) for q, n in step] == [(0, 16)]
    _run(s, step)
    step = s.schedule()  # the last 8 of the long prompt, then the short one joins in the same step
    assert [(q.seq_id, n) for q, n in step] == [(0, 8), (1, 3)]
    _run(s, step)
    assert long.generated == [7] and short.generated == [7]
    step = s.schedule()  # both decode: one token each
    assert [(q.seq_id, n) for q, n in step] == [(0, 1), (1, 1)]
    assert s.allocator.tables[0] == s.allocator.tables[0][:blocks_for(42, 4)]


def test_the_step_budget_and_max_running_hold():
    s = _scheduler(budget=10, running=3)
    seqs = [Sequence(i, [1] * 4, max_tokens=5) for i in range(6)]
    s.add(seqs)
    step = s.schedule()
    assert sum(n for _, n in step) <= 10 and len(s.running) <= 3
    for _ in range(40):
        _run(s, step)
        step = s.schedule()
        assert sum(n for _, n in step) <= 10 and len(s.running) <= 3
    assert s.idle and s.allocator.used_blocks == 0
    assert all(len(q.generated) == 5 for q in seqs)


def test_a_full_pool_preempts_the_youngest_which_is_recomputed():
    s = _scheduler(blocks=6, block_size=4, budget=64)  # 24 slots
    old, young = Sequence(0, [1] * 8, max_tokens=12), Sequence(1, [2] * 8, max_tokens=12)
    s.add([old, young])
    for _ in range(6):
        step = s.schedule()
        _run(s, step)
    assert s.preemptions >= 1 and young.preemptions >= 1 and old.preemptions == 0
    assert young in s.waiting or young.computed < young.length  # it waits, its tokens kept
    kept = list(young.generated)
    while not s.idle:
        _run(s, s.schedule())
    assert len(old.generated) == 12 and len(young.generated) == 12 and young.generated[: len(kept)] == kept
    assert s.allocator.used_blocks == 0


def test_admission_waits_for_blocks_and_the_queue_is_bounded():
    s = _scheduler(blocks=4, block_size=4, budget=64, waiting=3)
    first, second = Sequence(0, [1] * 12, max_tokens=2), Sequence(1, [1] * 8, max_tokens=2)
    s.add([first, second])
    assert [q.seq_id for q, _ in s.schedule()] == [0]  # the second does not fit beside the first
    with pytest.raises(QueueFull, match="overloaded") as full:
        s.add([Sequence(i, [1], 1) for i in (2, 3, 4)])
    assert full.value.status == 429 and len(s.waiting) == 1  # all or nothing: retry later
    with pytest.raises(QueueFull, match="asks for 4 sequences .* more than the server queues at once") as never:
        s.add([Sequence(i, [1], 1) for i in (5, 6, 7, 8)])  # more than the queue ever holds: no retry helps
    assert never.value.status == 400 and len(s.waiting) == 1
    s.remove(first)  # cancelled: its blocks come back at once
    assert s.allocator.used_blocks == 0 and [q.seq_id for q, _ in s.schedule()] == [1]


def test_paged_pool_holds_more_sequences_than_a_preallocated_cache_of_the_same_memory():
    """A preallocated cache reserves the whole context per sequence; the pool only the blocks of the tokens held."""
    context, block = 256, 16
    pool_tokens = 4 * context  # the memory of 4 preallocated sequences
    s = _scheduler(blocks=pool_tokens // block, block_size=block, budget=512, running=64, waiting=64)
    seqs = [Sequence(i, [1] * 20, max_tokens=30) for i in range(40)]
    s.add(seqs)
    most = 0
    while not s.idle:
        _run(s, s.schedule())
        most = max(most, len(s.running))
    assert most >= 4 * (pool_tokens // context) and all(len(q.generated) == 30 for q in seqs)


def test_static_batching_forms_a_batch_only_when_the_last_has_finished():
    s = Scheduler(BlockAllocator(64, 4), token_budget=4, max_running=8, max_waiting=16, static=True)
    first = [Sequence(i, [1, 2], max_tokens=1 + 3 * i) for i in range(3)]
    s.add(first)
    step = s.schedule()  # the whole batch joins, though the budget feeds only two prompts this step
    assert len(s.running) == 3 and [q.seq_id for q, _ in step] == [0, 1]
    late = Sequence(9, [1], max_tokens=1)
    s.add([late])
    while late not in s.running:
        _run(s, step)
        step = s.schedule()
    assert [q.seq_id for q, _ in step] == [9] and all(len(q.generated) == q.max_tokens for q in first)


def test_a_sequence_passing_longropes_original_length_is_recomputed_once():
    s = Scheduler(BlockAllocator(64, 4), token_budget=4, max_running=8, max_waiting=16, rope_switch=8)
    grows, long = Sequence(0, [1] * 5, max_tokens=6), Sequence(1, [2] * 10, max_tokens=2)
    s.add([grows])
    fed = []
    while len(grows.generated) < 4:  # a chunk of 4 and one token: then one token a step up to length 9
        step = s.schedule()
        fed.append(step[0][1])
        _run(s, step)
    assert fed == [4, 1, 1, 1, 1] and grows.length == 9 and grows.computed == 8 and s.rope_recomputes == 0
    s.add([long])  # longer than the original length from the start: its chunks are never recomputed
    steps = [[(q.seq_id, n) for q, n in s.schedule()]]
    assert steps == [[(0, 4)]] and s.rope_recomputes == 1  # the 9 tokens again, in chunks within the budget
    assert grows.computed == 0 and len(s.allocator.tables[0]) == 1  # its blocks freed, one grown for the chunk
    _run(s, [(grows, 4)])
    while not s.idle:
        step = s.schedule()
        steps.append([(q.seq_id, n) for q, n in step])
        _run(s, step)
    assert steps[1:4] == [[(0, 4)], [(0, 1), (1, 3)], [(0, 1), (1, 3)]] and len(grows.generated) == 6
    assert s.rope_recomputes == 1 and s.preemptions == 0 and grows.preemptions == 0


def test_a_request_that_slips_past_a_drain_is_refused_not_left_waiting():
    """An HTTP thread checks `accepting`, a SIGTERM drains and the idle loop stops, then the request arrives: it gets
    a 503, whether it came before the loop's last look at its inbox or after."""
    from types import SimpleNamespace

    from tensorpar.serving.engine import Engine, EngineRequest, RequestDone

    answers = []
    requests = [EngineRequest([[1, 2]], 4, sink=answers.append) for _ in range(2)]
    engine = Engine(None, None, _scheduler(), None, SimpleNamespace(size=1), context_len=64)
    engine.drain()
    engine.inbox.put(("submit", requests[0]))  # submitted before the loop's last look: the loop refuses it
    engine.inbox.put(("cancel", requests[0]))
    engine._take_inbox = lambda wait: None  # the loop's last look at the inbox came just before the request
    engine.serve_forever()
    engine.submit(requests[1])  # after: submit itself refuses it
    assert [(type(a), a.status) for a in answers] == [(RequestDone, 503)] * 2
    assert engine.inbox.empty()
