"""A randomized differential test of prefix caching: the scheduler, `run_step` and a small paged pool run the same
random traffic with prefix caching on and off, and every sequence's tokens (greedy and sampled) and their log-probs
must agree (1e-5). The traffic: prompts made of a few shared starts (diverging inside and at block boundaries),
random lengths (one token, exact multiples of the block size), requests with several identical choices joining in
one step, random max_tokens, cancellations mid-flight, pools small enough to preempt and evict, budgets small enough
to chunk prefills, continuous and static batching, and a longrope model (two layers, one sliding) whose sequences cross the original length.
After every schedule and every step the allocator's bookkeeping is checked, and every block a sequence holds (or
that is registered under a prefix) holds the keys of exactly the tokens (and RoPE factors) it stands for."""

import random

import pytest
import torch

from tensorpar.models import Transformer, get_config
from tensorpar.serving.blocks import BlockAllocator
from tensorpar.serving.model_step import run_step
from tensorpar.serving.paged_cache import PagedKVPool
from tensorpar.serving.scheduler import Scheduler, Sequence
from tensorpar.serving.step_plan import Sampling, StepItem, StepPlan

CFG = get_config("tiny").replace(hidden_size=32, num_layers=1, ffn_hidden_size=64, num_heads=2, num_kv_heads=1,
                                 vocab_size=64, max_seq_len=64)
ORIGINAL = 12
LONGROPE = CFG.replace(rope_scaling={"rope_type": "longrope", "short_factor": [1.0, 1.2, 1.5, 2.0] * 2,
                                     "long_factor": [3.0, 5.0, 8.0, 12.0] * 2,
                                     "original_max_position_embeddings": ORIGINAL},
                       num_layers=2, sliding_window=7, layer_types=("sliding_attention", "full_attention"))

_MODELS = {}


def _model(longrope: bool):
    if longrope not in _MODELS:
        _MODELS[longrope] = Transformer(LONGROPE if longrope else CFG, None, seed=5).eval()
    return _MODELS[longrope]


def _traffic(rng: random.Random, block_size: int, capacity: int):
    """Requests [(arrival step, prompts, n, max_tokens, sampling seed or None, cancel step or None)]."""
    starts = [[rng.randrange(CFG.vocab_size) for _ in range(rng.randrange(1, 3 * block_size + 2))] for _ in range(3)]
    requests = []
    step = 0
    for _ in range(rng.randrange(6, 12)):
        step += rng.choice([0, 0, 1, 2, 3])
        prompts = []
        for _ in range(rng.choice([1, 1, 1, 2])):
            kind = rng.random()
            if kind < 0.15:
                prompt = [rng.randrange(CFG.vocab_size)]
            else:
                base = list(rng.choice(starts))
                cut = rng.choice([len(base), (len(base) // block_size) * block_size, rng.randrange(len(base) + 1)])
                prompt = base[:cut] + [rng.randrange(CFG.vocab_size) for _ in range(rng.choice([0, 1, 2, 5]))]
                if rng.random() < 0.3:  # an exact multiple of the block size
                    prompt = (prompt + [rng.randrange(CFG.vocab_size) for _ in range(block_size)])[
                        :max(block_size, len(prompt) // block_size * block_size)]
                prompt = prompt or [rng.randrange(CFG.vocab_size)]
            prompts.append(prompt[:capacity - 1])
        max_tokens = rng.choice([1, 1, 2, 3, 5, 8])
        max_tokens = min(max_tokens, capacity - max(len(p) for p in prompts))
        n = rng.choice([1, 1, 2, 3])
        seed = rng.randrange(1 << 30) if rng.random() < 0.3 else None
        cancel = step + rng.randrange(1, 6) if rng.random() < 0.2 else None
        requests.append((step, prompts, n, max_tokens, seed, cancel))
    return requests


def check_allocator(a: BlockAllocator) -> None:
    held = collections_counter(a.tables)
    for b in range(a.num_blocks):
        assert a._refs[b] == held.get(b, 0), (b, a._refs[b], held.get(b, 0))
    free, cached = set(a._free), set(a._cached)
    assert len(free) == len(a._free) and not free & cached and not (free | cached) & set(held)
    assert len(free) + len(cached) + len(held) == a.num_blocks
    assert cached <= set(a._key_of) and not free & set(a._key_of)
    # every registered block is a holder of its key, and a key is found at one of its holders
    assert {b: k for k, holders in a._holders.items() for b in holders} == a._key_of
    assert set(a._block_of) == set(a._holders) and all(a._block_of[k] in a._holders[k] for k in a._holders)
    assert all(a._serial_of[b] == a._serial_of[a._block_of[k]] for b, k in a._key_of.items())
    # no registered block outlives its parent's prefix (it could never be found again): children give way first
    live = set(a._serial_of.values())
    assert all(isinstance(k[0], tuple) or k[0] in live for k in a._key_of.values())
    for table in a.tables.values():
        assert len(set(table)) == len(table)


def collections_counter(tables):
    held = {}
    for table in tables.values():
        for b in table:
            held[b] = held.get(b, 0) + 1
    return held


def _key_tokens(a: BlockAllocator, key):
    """(tokens, salt) of a registered prefix's key (parent, tokens), the parent the salt's root or the serial of the
    previous block's registration; None when that registration is gone (the key cannot be found any more)."""
    blocks = {serial: block for block, serial in a._serial_of.items()}
    parts = []
    while True:
        parent, tokens = key
        parts.append(tokens)
        if isinstance(parent, tuple):
            return [t for block in reversed(parts) for t in block], parent[0]
        if parent not in blocks:
            return None
        key = a._key_of[blocks[parent]]


def check_contents(a: BlockAllocator, shadow: dict, seqs) -> None:
    """Every registered block, and every computed token a sequence holds, holds the keys of its tokens."""
    size = a.block_size
    for block, key in a._key_of.items():  # every copy of a prefix
        found = _key_tokens(a, key)
        if found is None:
            continue
        tokens, salt = found
        first = len(tokens) - size
        for i in range(size):
            assert shadow.get(block * size + i) == (tuple(tokens[:first + i + 1]), salt), ("registered", block, i)
    for q in seqs:
        table = a.tables.get(q.seq_id, [])
        for p in range(q.computed):
            assert shadow.get(table[p // size] * size + p % size) == (tuple(q.tokens[:p + 1]), q.long_rope), \
                ("held", q.seq_id, p)


def serve(traffic, *, prefix_caching: bool, block_size: int, blocks: int, budget: int, max_running: int,
          static: bool, longrope: bool):
    """Run `traffic`; per (request, choice): (tokens, log-probs), the sequences' cached_tokens, and steps."""
    model = _model(longrope)
    pool = PagedKVPool.for_model(model, blocks, block_size)
    alloc = BlockAllocator(blocks, block_size, prefix_caching=prefix_caching)
    s = Scheduler(alloc, token_budget=budget, max_running=max_running, max_waiting=1000, static=static,
                  rope_switch=ORIGINAL if longrope else None)
    shadow = {}  # slot -> (the tokens up to the one whose keys it holds, the RoPE factors: long or not)
    out, live, cached, seq_id = {}, {}, {}, 0
    pending = sorted(range(len(traffic)), key=lambda r: traffic[r][0])
    step = 0
    while pending or not s.idle:
        while pending and traffic[pending[0]][0] <= step:
            r = pending.pop(0)
            _, prompts, n, max_tokens, seed, _ = traffic[r]
            seqs = []
            for p, prompt in enumerate(prompts):
                for i in range(n):
                    q = Sequence(seq_id, list(prompt), max_tokens)
                    q.sampling = Sampling() if seed is None else Sampling(greedy=False, temperature=0.8,
                                                                         seed=seed + 7 * (p * n + i))
                    seq_id += 1
                    seqs.append(q)
                    out[(r, p * n + i)] = ([], [])
            s.add(seqs)
            live[r] = seqs
        for r, seqs in list(live.items()):
            if traffic[r][5] is not None and traffic[r][5] <= step:
                for q in seqs:
                    s.remove(q)
                del live[r]
        chunks = s.schedule()
        check_allocator(alloc)
        items = [StepItem(tuple(q.tokens[q.computed:q.computed + n]), q.computed, tuple(alloc.tables[q.seq_id]),
                          sample=q.sampling if q.computed + n == q.length else None, step=len(q.generated),
                          top_logprobs=0, reach=q.length) for q, n in chunks]
        results = run_step(model, pool, StepPlan(tuple(items)))
        for q, n in chunks:
            table = alloc.tables[q.seq_id]
            for pos in range(q.computed, q.computed + n):
                # the factors the keys really took: long once the sequence's reach (its length) passes the switch
                shadow[table[pos // block_size] * block_size + pos % block_size] = (tuple(q.tokens[:pos + 1]),
                                                                                    longrope and q.length > ORIGINAL)
        s.advance(chunks)
        for (q, _), res in zip(chunks, results):
            if res.token is not None:
                r = next(r for r, seqs in live.items() if q in seqs)
                index = live[r].index(q)
                q.generated.append(res.token)
                out[(r, index)][0].append(res.token)
                out[(r, index)][1].append(res.logprob.logprob)
                if len(q.generated) >= q.max_tokens:
                    s.remove(q)
                    cached[(r, index)] = q.cached_tokens
                    if all(x not in s.running and x not in s.waiting for x in live[r]):
                        del live[r]
        check_allocator(alloc)
        check_contents(alloc, shadow, s.running)
        step += 1
        assert step < 2000, "no progress"
    assert alloc.used_blocks == 0 and not alloc.tables
    return out, cached, s


def _cancelled_prefix(a, b):
    m = min(len(a), len(b))
    return a[:m], b[:m]


CASES = [  # (seed, block_size, blocks, budget, max_running, static, longrope)
    (0, 4, 8, 7, 4, False, False),
    (1, 2, 12, 5, 3, False, False),
    (2, 4, 6, 64, 8, False, False),
    (3, 3, 10, 4, 4, True, False),
    (4, 4, 8, 9, 4, False, True),
    (5, 2, 14, 3, 5, False, True),
    (6, 5, 6, 11, 2, False, False),
    (7, 4, 7, 16, 6, True, True),
]


@pytest.fixture(autouse=True)
def one_thread():
    """Steps of a few tokens: a second thread only adds its start-up to every GEMM (3 s instead of 20 here)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("case", CASES, ids=[f"seed{c[0]}" for c in CASES])
def test_prefix_caching_changes_no_token_or_logprob(case):
    seed, block_size, blocks, budget, max_running, static, longrope = case
    for round_ in range(3):
        rng = random.Random(seed * 100 + round_)
        traffic = _traffic(rng, block_size, blocks * block_size)
        kw = dict(block_size=block_size, blocks=blocks, budget=budget, max_running=max_running, static=static,
                  longrope=longrope)
        on, hits, s_on = serve(traffic, prefix_caching=True, **kw)
        off, _, s_off = serve(traffic, prefix_caching=False, **kw)
        for key in off:
            (t1, l1), (t2, l2) = on[key], off[key]
            if traffic[key[0]][5] is not None:  # cancelled: as far as both got
                t1, t2 = _cancelled_prefix(t1, t2)
                l1, l2 = _cancelled_prefix(l1, l2)
            assert t1 == t2, (round_, key, traffic[key[0]])
            assert all(abs(x - y) <= 1e-5 for x, y in zip(l1, l2)), (round_, key)
        for (r, index), hit in hits.items():
            prompt = traffic[r][1][index // traffic[r][2]]
            assert hit <= len(prompt) - 1 and hit % block_size == 0
