"""Exact loss normalisation: with prompts masked out of the loss (of very different lengths), DP with gradient
accumulation, TP + SP, CP and PP train exactly what one process trains on the same examples; the old per-micro-
batch mean, substituted, does not."""

import json

import pytest

from tensorpar.data.batch import Batch
from tensorpar.models import get_config
from tensorpar.training import loss_weights

import chat_data
from layout_runs import reference, run

# One process takes the whole global batch of 8 rows in one micro-batch; each layout cuts it differently.
LAYOUTS = [dict(dp=2, micro_batch_size=2), dict(tp=2, sequence_parallel=True), dict(cp=2),
           dict(pp=2, micro_batch_size=2)]


@pytest.fixture(scope="module")
def chat_run(tmp_path_factory):
    """The settings of a 10-step chat fine-tuning run: a Qwen-style tokenizer folder, 240 conversations, a small
    Llama-style model whose vocabulary is the tokenizer's."""
    root = tmp_path_factory.mktemp("chat")
    model = root / "model.json"
    model.write_text(json.dumps(get_config("tiny").replace(hidden_size=64, ffn_hidden_size=176, num_layers=4,
                                                           vocab_size=chat_data.VOCAB).to_dict()))
    return dict(model=str(model), tokenizer=chat_data.write_tokenizer_folder(root / "qwen", "qwen"),
                data=chat_data.write_chat_jsonl(root / "chat.jsonl", 240), steps=10, seq_len=128,
                warmup_steps=2, micro_batch_size=None)


def _world(layout):
    return layout.get("tp", 1) * layout.get("cp", 1) * layout.get("pp", 1) * layout.get("dp", 1)


def _differences(result, ref):
    """(the largest relative loss difference over the steps, the largest relative weight difference)."""
    loss = max(abs(a - b) / b for (a, _), (b, _) in zip(result["trajectory"], ref["trajectory"], strict=True))
    weights = max(float((result["state"][k] - v).norm() / v.norm()) for k, v in ref["state"].items())
    return loss, weights


def per_micro_batch_mean(batches, global_valid, dp_size):
    return [1.0 / len(batches)] * len(batches)


def run_with_old_mean(model, **settings):
    """`run` with the weights the trainer used before exact normalisation: each micro-batch's mean weighs 1 / M."""
    from tensorpar.training import loop

    exact = loop.micro_batch_weights
    loop.micro_batch_weights = per_micro_batch_mean
    try:
        return run(model, **settings)
    finally:
        loop.micro_batch_weights = exact


@pytest.mark.parametrize("layout", LAYOUTS, ids=["dp2-accum2", "tp2-sp", "cp2", "pp2"])
def test_layouts_train_what_one_process_trains_on_masked_prompts(pools, chat_run, layout):
    settings = dict(chat_run)
    model = settings.pop("model")
    ref = reference(pools, model, **settings)
    results = pools(_world(layout)).run(run, model, **{**settings, **layout})
    assert all(r["trajectory"] == results[0]["trajectory"] for r in results), "ranks disagree on the trajectory"
    loss, weights = _differences(results[0], ref)
    assert loss <= 1e-5 and weights <= 1e-4, f"losses differ by {loss:.1e}, weights by {weights:.1e}"


def test_the_per_micro_batch_mean_fails_the_comparison(pools, chat_run):
    """Substituted in the trainer, the old mean weighs a micro-batch of few learned tokens like one of many: DP 2
    with 2 micro-batches then trains something else than one process."""
    settings = dict(chat_run)
    model = settings.pop("model")
    ref = reference(pools, model, **settings)
    old = pools(2).run(run_with_old_mean, model, **{**settings, **LAYOUTS[0]})[0]
    loss, weights = _differences(old, ref)
    assert loss > 1e-3 and weights > 1e-4, f"the old mean was not caught: losses {loss:.1e}, weights {weights:.1e}"


def test_pretraining_weights_are_the_per_micro_batch_mean_of_before():
    """Every target valid: w_i = n_i * dp / N is 1 / M, the same float."""
    import torch

    for m, dp in ((1, 1), (3, 2), (4, 4), (6, 1), (7, 2)):
        batches = [Batch.from_windows(torch.zeros(2, 17, dtype=torch.long)) for _ in range(m)]
        weights = loss_weights.micro_batch_weights(batches, 2 * 16 * m * dp, dp)
        assert weights == [1.0 / m] * m
