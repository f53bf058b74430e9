"""Prefix caching in the serving scheduler (`serve`'s default; `--no-prefix-caching`): the block tables share the
registered blocks of a prompt's longest computed prefix and compute the rest, which gives the tokens and log-probs
of computing every prompt whole, at TP 1 and 2; what may and may not be shared (a prefix diverging inside a block,
longrope's other factors, the last prompt token, prompts whose log-probs are wanted), and which cached blocks give
way when the pool is full."""

import pytest
import torch

from tensorpar.models import Transformer, get_config
from tensorpar.serving.blocks import BlockAllocator
from tensorpar.serving.model_step import run_step
from tensorpar.serving.paged_cache import PagedKVPool
from tensorpar.serving.scheduler import Scheduler, Sequence
from tensorpar.serving.step_plan import Sampling, StepItem, StepPlan

from harness import mesh
from test_scheduler import _run


def _scheduler(blocks=32, block_size=4, budget=64, **kw):
    return Scheduler(BlockAllocator(blocks, block_size, prefix_caching=True), token_budget=budget, max_running=8,
                     max_waiting=16, **kw)


def _finish(s: Scheduler, *seqs):
    """Run the steps until `seqs` have generated their tokens (token 7 each step), as the engine does."""
    while any(q in s.running or q in s.waiting for q in seqs):
        _run(s, s.schedule())


def test_a_prompt_starts_from_the_blocks_of_its_longest_cached_prefix():
    s = _scheduler()
    system = list(range(100, 112))  # three full blocks of 4
    first = Sequence(0, system + [1, 2, 3], max_tokens=2)
    s.add([first])
    _finish(s, first)
    assert s.allocator.used_blocks == 0 and s.allocator.cached_blocks == 4  # prompt + its first generated token
    second, other = Sequence(1, system + [5, 6], max_tokens=1), Sequence(2, [9] + system, max_tokens=1)
    s.add([second, other])
    step = s.schedule()
    assert [(q.seq_id, n) for q, n in step] == [(1, 2), (2, 13)]  # 12 cached tokens; a shifted prefix is not one
    assert second.cached_tokens == 12 and other.cached_tokens == 0
    assert s.allocator.tables[1][:3] == [0, 1, 2] and s.prefix_hits == 12 and s.prefix_queries == 15 + 14 + 13
    _finish(s, second, other)


def test_only_full_blocks_of_the_same_tokens_are_shared_and_the_last_token_is_computed():
    s = _scheduler()
    first = Sequence(0, list(range(10)), max_tokens=1)  # blocks [0-3] [4-7] registered, [8, 9] not full
    s.add([first])
    _finish(s, first)
    cases = {1: (list(range(10)), 8), 2: list(range(8)), 3: list(range(6)) + [0, 0, 8], 4: list(range(9))}
    cases[2], cases[3], cases[4] = (cases[2], 4), (cases[3], 4), (cases[4], 8)
    for seq_id, (prompt, cached) in cases.items():
        q = Sequence(seq_id, prompt, max_tokens=1)
        s.add([q])
        s.schedule()
        # all 8 tokens of [0..7] are cached, but the last must be fed for its logits: one block less
        assert q.cached_tokens == cached and q.computed == cached, (seq_id, q.cached_tokens)
        _finish(s, q)


def test_shared_blocks_are_counted_once_and_freed_blocks_keep_their_prefix_until_taken():
    s = _scheduler(blocks=6)  # 24 slots
    a, b = Sequence(0, [1] * 8 + [2], max_tokens=3), Sequence(1, [1] * 8 + [3], max_tokens=3)
    s.add([a])
    _finish(s, a)
    assert s.allocator.free_blocks == 6 and s.allocator.cached_blocks == 2  # [1]*4, [1]*4, then 2 7 7 (not full)
    s.add([b])
    s.schedule()
    assert s.allocator.tables[1][:2] == s.allocator.cached_prefix([1] * 9) and s.allocator.used_blocks == 3
    c = Sequence(2, [1] * 8 + [4], max_tokens=1)
    s.add([c])
    s.schedule()
    assert s.allocator.used_blocks == 4  # two shared blocks and one block of each sequence's own
    _finish(s, b, c)
    # a pool full of other tokens takes the cached blocks, the least recently released first
    d = Sequence(3, [5] * 23, max_tokens=1)
    s.add([d])
    s.schedule()
    assert s.allocator.cached_prefix([1] * 9) == [] and s.allocator.used_blocks == 6
    _finish(s, d)
    assert s.allocator.used_blocks == 0


def test_a_preempted_sequence_comes_back_to_what_is_left_of_its_blocks():
    s = _scheduler(blocks=6, budget=64)  # 24 slots: 8 + 12 and 9 + 12 tokens do not fit together
    old, young = Sequence(0, [1] * 8, max_tokens=12), Sequence(1, [2] * 9, max_tokens=12)
    s.add([old, young])
    rejoined = []
    while not s.idle:
        waiting = young in s.waiting
        step = s.schedule()
        rejoined += [q.computed for q, _ in step if q is young and waiting and young.preemptions]
        _run(s, step)
    # the old one's growth took the young one's last registered block first (released first); its first came back
    assert young.preemptions == 1 and rejoined == [4] and young.cached_tokens == 0 and len(young.generated) == 12


def test_longropes_long_factors_and_wanted_prompt_logprobs_compute_the_prompt_whole():
    s = _scheduler(rope_switch=8)
    short, long = Sequence(0, [1] * 8, max_tokens=1), Sequence(1, [1] * 8 + [2, 3], max_tokens=1)
    s.add([short])
    _finish(s, short)
    s.add([long])  # longer than the switch: its keys take the long factors, the cached ones have the short ones
    s.schedule()
    assert long.computed == 0 and long.long_rope
    _finish(s, long)
    again = Sequence(2, [1] * 8 + [2, 3, 4], max_tokens=1)
    echo = Sequence(3, [1] * 8 + [5], max_tokens=1, reuse_prefix=False)
    s.add([again, echo])
    s.schedule()
    assert again.computed == 8 and echo.computed == 0  # the long-factor prefix of `long`; the echo computes all


def test_choices_passing_longropes_switch_together_recompute_the_prompt_once():
    """n = 2 choices of a 7-token prompt pass the switch (8) in the same step: the first recomputes its tokens with
    the long factors, the second starts from the blocks the first registers as the step is planned."""
    s = _scheduler(rope_switch=8)
    a, b = Sequence(0, list(range(7)), max_tokens=4), Sequence(1, list(range(7)), max_tokens=4)
    s.add([a, b])
    while a.length <= 8:
        _run(s, s.schedule())
    step = s.schedule()
    assert s.rope_recomputes == 2 and a.long_rope and b.long_rope
    assert [(q.seq_id, n) for q, n in step] == [(0, 9), (1, 1)]  # b: 8 of its 9 tokens cached under the long factors
    assert s.allocator.tables[1][:2] == s.allocator.tables[0][:2]
    _run(s, step)
    _finish(s, a, b)


def test_a_prefix_computed_twice_stays_found_while_either_copy_lives():
    """Two sequences prefill the same tokens side by side (neither found the other's blocks): the second's blocks
    are copies of the first's prefix, and the blocks after them hang off it. When the first leaves, its copies go
    back to the free list and the prefix, with what follows it, is found in the second's blocks."""
    a = BlockAllocator(6, 2, prefix_caching=True)
    first, second = [1, 2, 3, 4], [1, 2, 3, 4, 5, 6]
    a.grow(0, 4)
    a.grow(1, 6)
    a.register(0, first, 4)
    a.register(1, second, 6)
    assert a.cached_prefix(second + [7]) == a.tables[0][:2] + a.tables[1][2:3]
    a.free(0)
    assert a.free_blocks == 3 and a.cached_blocks == 3  # the first's copies are free, not cached
    a.grow(2, 4)  # another sequence takes free blocks
    assert a.cached_prefix(second + [7]) == a.tables[1]
    a.free(1)
    assert a.cached_prefix(second + [7]) == [b for b in a._cached][::-1] and a.used_blocks == 2


def test_sequences_joining_in_one_step_share_the_blocks_it_computes():
    """The choices of a request with n > 1: the first's blocks are registered as the step is planned."""
    s = _scheduler(budget=64)
    choices = [Sequence(i, list(range(10)), max_tokens=2) for i in range(3)]
    s.add(choices)
    step = s.schedule()
    assert [(q.seq_id, n) for q, n in step] == [(0, 10), (1, 2), (2, 2)]
    assert s.allocator.tables[1][:2] == s.allocator.tables[2][:2] == s.allocator.tables[0][:2]
    assert s.allocator.used_blocks == 3 + 2  # the first's three, one of its own for each other choice
    _finish(s, *choices)


def test_without_prefix_caching_nothing_is_registered():
    s = Scheduler(BlockAllocator(32, 4), token_budget=64, max_running=8, max_waiting=16)
    first, second = Sequence(0, list(range(12)), max_tokens=2), Sequence(1, list(range(12)), max_tokens=2)
    s.add([first])
    _finish(s, first)
    s.add([second])
    s.schedule()
    assert second.computed == 0 and s.allocator.cached_blocks == 0 and s.prefix_queries == 0


# -- the model's tokens and log-probs ---------------------------------------------------------------------------

CFG = get_config("tiny").replace(hidden_size=64, num_layers=2, ffn_hidden_size=128)


def serve_greedy(tp: int, prefix_caching: bool, rounds=2, new=6):
    """Greedy continuations with their log-probs of prompts sharing a 13-token system prompt, in `rounds` waves (the
    later ones find the earlier ones' blocks), through the scheduler and `run_step` as the engine runs them; and
    the tokens the steps fed."""
    model = Transformer(CFG, mesh(tp) if tp > 1 else None, seed=3).eval()
    g = torch.Generator().manual_seed(0)
    system = torch.randint(0, CFG.vocab_size, (13,), generator=g).tolist()
    pool = PagedKVPool.for_model(model, 40, 4)
    s = Scheduler(BlockAllocator(40, 4, prefix_caching=prefix_caching), token_budget=24, max_running=4,
                  max_waiting=16)
    out, fed, seq_id = [], 0, 0
    with torch.no_grad():
        for _ in range(rounds):
            seqs = []
            for n in (3, 5, 8):
                seqs.append(Sequence(seq_id, system + torch.randint(0, CFG.vocab_size, (n,), generator=g).tolist(),
                                     max_tokens=new))
                seq_id += 1
            s.add(seqs)
            logprobs = {q.seq_id: [] for q in seqs}
            while any(q in s.running or q in s.waiting for q in seqs):
                step = s.schedule()
                items = [StepItem(tuple(q.tokens[q.computed:q.computed + n]), q.computed,
                                  tuple(s.allocator.tables[q.seq_id]),
                                  sample=Sampling() if q.computed + n == q.length else None,
                                  step=len(q.generated), top_logprobs=0, reach=q.length) for q, n in step]
                results = run_step(model, pool, StepPlan(tuple(items)))
                s.advance(step)
                fed += sum(n for _, n in step)
                for (q, _), r in zip(step, results):
                    if r.token is not None:
                        q.generated.append(r.token)
                        logprobs[q.seq_id].append(r.logprob.logprob)
                        if len(q.generated) == q.max_tokens:
                            s.remove(q)
            out += [(q.generated, logprobs[q.seq_id], q.cached_tokens) for q in seqs]
    return out, fed


@pytest.mark.parametrize("tp", [1, 2])
def test_cached_prefixes_give_the_tokens_and_logprobs_of_whole_prompts(pools, tp):
    for rank, ((cached, fed), (whole, fed_whole)) in enumerate(
            zip(*[[serve_greedy(1, on)] if tp == 1 else pools(2).run(serve_greedy, 2, on) for on in (True, False)])):
        for (tokens, logprobs, hit), (ref_tokens, ref_logprobs, _) in zip(cached, whole):
            assert tokens == ref_tokens, rank
            assert max(abs(a - b) for a, b in zip(logprobs, ref_logprobs)) <= 1e-5, rank
        hits = [hit for _, _, hit in cached]
        # the first computes the system prompt; the second joins the same step (8 of its 18 tokens: the budget)
        # and shares its three full blocks already, being written in that step; the others join later
        assert hits == [0, 12, 12, 12, 12, 12] and fed == fed_whole - 5 * 12, (rank, hits, fed, fed_whole)


def test_a_long_cached_prefix_is_found_without_recursing_through_its_chain():
    """A prompt of more full blocks than Python's recursion limit (1000): its prefix, registered by the first
    sequence, is looked up by the second (and by a choice joining in the same step) without a RecursionError in
    schedule(), which would stop the server's engine loop."""
    s = Scheduler(BlockAllocator(1300, 1, prefix_caching=True), token_budget=4096, max_running=8, max_waiting=16)
    prompt = [i % 50 for i in range(1200)]
    first = Sequence(0, list(prompt), max_tokens=1)
    s.add([first])
    _finish(s, first)
    again = [Sequence(1, list(prompt), max_tokens=1), Sequence(2, list(prompt) + [3], max_tokens=1)]
    s.add(again)
    s.schedule()
    assert [q.computed for q in again] == [1199, 1200]


def test_a_sequence_holding_only_shared_blocks_is_not_preempted_for_blocks():
    """Preempting it would free nothing (a static batch's member that joined without being fed holds only its cached
    prefix): the sequence that needs the block gives way instead."""
    s = _scheduler(blocks=4, budget=64)
    first = Sequence(0, [1] * 8 + [2], max_tokens=10)
    s.add([first])
    s.advance(s.schedule())  # 9 tokens: two full blocks, registered, and one of its own
    shared = Sequence(1, [1] * 8 + [3], max_tokens=5, arrival=5)
    s.allocator.share(1, s.allocator.cached_prefix(shared.tokens))
    shared.computed = 8
    s.running.append(shared)
    s.allocator.grow(0, 16)  # the pool's last block
    assert s.allocator.own_blocks(1) == 0 and s.allocator.own_blocks(0) == 2 and s.allocator.free_blocks == 0
    assert s._make_room(first, 17, set()) is False  # `first` itself gives way: its blocks are the ones that free
    assert shared.preemptions == 0 and first.preemptions == 1 and s.allocator.free_blocks == 2
