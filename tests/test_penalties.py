"""The sampling fields that look at the tokens so far (`tensorpar.inference.penalties`), on logits alone: each rank's
slice of the vocabulary penalized on its own gives the whole row penalized as the definitions say, and min-p keeps
what transformers' MinPLogitsWarper keeps. (Against a served model at TP 2: tests/test_serve.py.)"""

import math

import torch

from tensorpar.distributed.comm import Group
from tensorpar.models import get_config
from tensorpar.inference.penalties import apply_penalties, min_p_threshold
from tensorpar.serving.sampling import penalties
from tensorpar.serving.step_plan import Sampling, StepItem

V = 11
DENSE_CFG = get_config("tiny")


def _items():
    penalized = Sampling(presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=1.3)
    return [StepItem((1,), 0, (), sample=penalized, output_counts=((3, 2), (9, 1)), prompt_tokens=(0, 3, 7),
                     banned=(10,)),
            StepItem((1,), 0, (), sample=Sampling(frequency_penalty=-1.0), output_counts=((4, 3),)),
            StepItem((1,), 0, (), sample=Sampling())]


def test_penalties_follow_their_definitions_on_any_vocabulary_shards():
    logits = torch.randn(3, V, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    expected = logits.clone()
    for t in (0, 3, 7, 9):  # repetition: the prompt's tokens and the continuation's
        expected[0, t] = expected[0, t] / 1.3 if expected[0, t] > 0 else expected[0, t] * 1.3
    expected[0, 3] -= 2 * 0.25 + 0.5
    expected[0, 9] -= 1 * 0.25 + 0.5
    expected[0, 10] = float("-inf")
    expected[1, 4] += 3.0
    whole = logits.clone()
    apply_penalties(whole, [penalties(it) for it in _items()], 0)
    assert torch.equal(whole, expected)
    for width in (6, 4):  # 2 shards, the last padded; 3 shards
        padded = torch.cat([logits, torch.full((3, -V % width), float("-inf"), dtype=torch.float64)], dim=-1)
        shards = [s.clone() for s in padded.split(width, dim=-1)]
        for rank, shard in enumerate(shards):
            apply_penalties(shard, [penalties(it) for it in _items()], rank * width)
        assert torch.equal(torch.cat(shards, dim=-1)[:, :V], expected), width


def test_min_p_keeps_what_transformers_keeps():
    from transformers.generation.logits_process import MinPLogitsWarper

    logits = torch.randn(4, 50, dtype=torch.float64, generator=torch.Generator().manual_seed(1)) * 3
    for min_p in (0.05, 0.3, 1.0):
        threshold = min_p_threshold(logits, Group.single(), min_p)
        ours = logits >= threshold[:, None]
        theirs = torch.isfinite(MinPLogitsWarper(min_p)(None, logits.clone()))
        assert torch.equal(ours, theirs), min_p
        assert ours.sum(dim=-1).min() >= 1 and math.isclose(float(threshold[0] - logits[0].max()), math.log(min_p))


def test_generate_with_min_p_1_samples_the_most_likely_token_and_penalties_change_greedy():
    """generate's sampler with the same fields (against transformers and the formula at TP 2: test_serve.py)."""
    from tensorpar.inference.generation import generate
    from tensorpar.models import Transformer

    model = Transformer(DENSE_CFG, None, seed=0).eval()
    prompts = [[1, 2, 3, 1, 2], [5]]
    greedy = generate(model, prompts, 6)
    assert generate(model, prompts, 6, greedy=False, temperature=2.0, seed=3, min_p=1.0) == greedy
    assert generate(model, prompts, 6, greedy=False, temperature=2.0, seed=3) != greedy
    # negative penalties favour the tokens already generated, by 4 logits after one (a random model's logits
    # spread far less): the first greedy token over and over
    assert generate(model, prompts, 6, frequency_penalty=-2.0, presence_penalty=-2.0) == [[g[0]] * 6 for g in greedy]
