"""The paged KV cache and one serving step (`run_step`) against the model without a cache, at TP 1 and 2 and for an
MoE model over 2 expert-parallel ranks: packed prefill chunks and decodes give the full forward's logits, log-probs are the model's log_softmax (1e-5) with its top
tokens, and a seeded row samples what `tensorpar generate`'s sampler samples for it alone, whatever shares the step."""

import pytest
import torch

from tensorpar.inference.generation import select_tokens
from tensorpar.models import Transformer, get_config
from tensorpar.serving.blocks import BlockAllocator
from tensorpar.serving.model_step import run_step
from tensorpar.serving.paged_cache import PagedKVPool, Segment
from tensorpar.serving.sampling import sample_rows
from tensorpar.serving.step_plan import Sampling, StepItem, StepPlan

from harness import mesh

# vocab 257 (padded at TP 2), 2 KV heads; rope.
CFG = get_config("tiny").replace(hidden_size=64, num_layers=2, ffn_hidden_size=128)
LENGTHS = (12, 7, 23)  # what STEPS feed
# Steps of (sequence, new tokens): prefill chunks beside decodes, a chunk that continues a prompt, one token.
STEPS = [[(0, 6), (1, 5), (2, 10)], [(0, 1), (1, 1), (2, 13)], [(0, 4)], [(1, 1), (0, 1)]]
SAMPLED = Sampling(greedy=False, temperature=0.9, top_k=40, top_p=0.95, seed=5)


MOE = get_config("tiny-moe").replace(num_layers=2)  # dropless routing: a token's experts do not depend on the batch
# Gemma 2's attention: a window of 5 on the first layer (shorter than every sequence), soft caps, its own score scale.
WINDOWED = CFG.replace(family="gemma2", sliding_window=5, layer_types=("sliding_attention", "full_attention"),
                       attn_logit_softcap=2.0, final_logit_softcap=3.0, query_pre_attn_scalar=24.0,
                       norm_placement="sandwich", norm_offset=1.0, embedding_multiplier=8.0)


LATENT = get_config("tiny-deepseek").replace(num_layers=2)  # latent attention: the pool holds latents and rotary keys


def _model(tp, moe=False, cfg=CFG):
    """The model of `cfg` at TP `tp`; `moe`: the MoE one, its experts over 2 expert-parallel ranks (replicas of the
    TP group, as `serve --ep 2` runs it); `moe="latent"`: a DeepSeek-V3-class one (latent attention) likewise."""
    if moe:
        return _model_of(Transformer(LATENT if moe == "latent" else MOE, mesh(tp, dp=2 // tp, ep=2), seed=3).eval())
    return _model_of(Transformer(cfg, mesh(tp) if tp > 1 else None, seed=3).eval())


def _model_of(model):
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, model.cfg.vocab_size, (n,), generator=g) for n in LENGTHS]
    return model, seqs


def check_paged_steps(tp, moe=False, cfg=CFG):
    """Largest |paged - full| logit and log-prob error over STEPS; the sampled tokens of each step."""
    model, seqs = _model(tp, moe, cfg)
    alloc, pool = BlockAllocator(20, 4), PagedKVPool.for_model(model, 20, 4)
    done, logit_err, lp_err, tokens = [0] * 3, 0.0, 0.0, []
    with torch.no_grad():
        for step in STEPS:
            segments, items = [], []
            for i, n in step:
                blocks = tuple(alloc.grow(i, done[i] + n))
                segments.append(Segment(done[i], n, blocks))
                chunk = tuple(seqs[i][done[i]:done[i] + n].tolist())
                targets = tuple(seqs[i][done[i] + 1:done[i] + n].tolist())  # every position but the last
                items.append(StepItem(chunk, done[i], blocks, targets, SAMPLED, step=done[i], top_logprobs=3))
            view = pool.step(segments)
            h = model.cached_hidden(torch.tensor([t for it in items for t in it.tokens])[None], view, view.positions)
            logits = model.logits(model.final_norm(h[0]))
            offset = 0
            for (i, n), item in zip(step, items):
                full = model(seqs[i][None, :done[i] + n])[0, done[i]:]
                logit_err = max(logit_err, (logits[offset:offset + n] - full).abs().max().item())
                offset += n
            # The same tokens again through run_step (the pool is rewritten with the same keys and values).
            results = run_step(model, pool, StepPlan(tuple(items)))
            for (i, n), res in zip(step, results):
                full = model(seqs[i][None, :done[i] + n])[0, done[i]:]
                lp_err = max(lp_err, _logprob_error(model, full, seqs[i][done[i] + 1:done[i] + n], res))
                tokens.append(res.token)
                done[i] += n
    return logit_err, lp_err, tokens


def _logprob_error(model, local_full, targets, result) -> float:
    """|served - log_softmax| over the result's prompt targets and top tokens (dense logits gathered here)."""
    group = model.tp_group
    dense = group.all_gather(model.mask_padding(local_full.float()).unsqueeze(0), dim=0)
    dense = torch.cat(list(dense), dim=-1)[:, :model.cfg.vocab_size]
    reference = torch.log_softmax(dense.double(), dim=-1)
    err = 0.0
    for p, (target, lp) in enumerate(zip(targets.tolist(), result.prompt_logprobs)):
        err = max(err, abs(lp.logprob - reference[p, target].item()))
        ref_top = reference[p].topk(3)
        assert [t for t, _ in lp.top] == ref_top.indices.tolist()
        err = max(err, max(abs(v - r) for (_, v), r in zip(lp.top, ref_top.values.tolist())))
    assert len(result.prompt_logprobs) == len(targets)
    err = max(err, abs(result.logprob.logprob - reference[-1, result.token].item()))
    return err


@pytest.fixture(scope="module")
def tp1():
    return check_paged_steps(1)


def test_paged_steps_equal_the_full_forward_tp1(tp1):
    logit_err, lp_err, _ = tp1
    assert logit_err <= 2e-5 and lp_err <= 1e-5


def test_paged_steps_equal_the_full_forward_tp2(pools, tp1):
    for rank, (logit_err, lp_err, tokens) in enumerate(pools(2).run(check_paged_steps, 2)):
        assert logit_err <= 2e-5 and lp_err <= 1e-5, rank
        assert tokens == tp1[2], rank  # seeded samples: the same at every TP size


def test_paged_steps_of_a_windowed_soft_capped_model(pools):
    """A sliding layer's keys before its window are masked in prefill chunks (a prompt continued included) and
    decodes alike; the soft caps and score scale as the full forward's."""
    for rank, (logit_err, lp_err, _) in enumerate(pools(2).run(check_paged_steps, 2, False, WINDOWED)):
        assert logit_err <= 2e-5 and lp_err <= 1e-5, rank


@pytest.mark.parametrize("kind", [True, "latent"])
def test_paged_steps_of_an_moe_model_over_expert_parallel_ranks(pools, kind):
    for rank, (logit_err, lp_err, _) in enumerate(pools(2).run(check_paged_steps, 1, kind)):
        assert logit_err <= 2e-5 and lp_err <= 1e-5, rank


def check_rows_sample_alone(tp):
    """Each row's token from `sample_rows` in a mixed batch, and from generate's sampler for that row alone."""
    model, _ = _model(tp)
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(4, model.head.out_per_rank, generator=g) * 3
    rows = [SAMPLED, Sampling(), Sampling(greedy=False, temperature=1.3, top_p=0.8, seed=9),
            Sampling(greedy=False, temperature=0.7, seed=2)]
    steps = [3, 0, 8, 1]
    batch = sample_rows(logits, model, rows, steps).tolist()
    alone = [select_tokens(logits[r:r + 1], model, greedy=s.greedy, temperature=s.temperature, top_k=s.top_k,
                           top_p=s.top_p, seed=s.seed, step=steps[r]).item() for r, s in enumerate(rows)]
    return batch, alone


@pytest.mark.parametrize("tp", [1, 2])
def test_a_row_samples_what_it_would_alone(pools, tp):
    results = [check_rows_sample_alone(1)] if tp == 1 else pools(2).run(check_rows_sample_alone, 2)
    for batch, alone in results:
        assert batch == alone


def test_rope_spans_are_each_sequences_reach():
    """RoPE that depends on the span (longrope, dynamic NTK) sees each sequence's reach the engine gives (its length:
    the whole prompt for a prefill chunk), else its segment's end."""
    pool = PagedKVPool(["0"], 4, 4, 1, 2)
    view = pool.step([Segment(0, 3, (0, 1), reach=9), Segment(5, 1, (2, 3)), Segment(4, 2, (1, 2), reach=6)])
    assert view.spans(view.positions).tolist() == [[9, 9, 9, 6, 6, 6]]
