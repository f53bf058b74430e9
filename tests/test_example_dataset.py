"""Instruction examples in rows: packed (each example intact, its own positions, never predicting another's token)
or padded; over-long examples truncated or left out and counted; rows drawn by seed alone."""

import numpy as np
import pytest
import torch

from tensorpar.data.batch import IGNORE_INDEX, Batch
from tensorpar.data.example_dataset import ExampleDataset
from tensorpar.data.examples import Examples
from tensorpar.functional.document_mask import PackedDocuments


def _examples(lengths, seed=0):
    """Examples of the given token counts; each learns its second half."""
    rng = np.random.default_rng(seed)
    ids = [rng.integers(1, 100, n) for n in lengths]
    learn = [np.arange(n) >= n // 2 for n in lengths]
    return Examples("conversations", ids, learn)


def _pieces(batch: Batch):
    """Per row, the (inputs, targets) of each example it holds, padding left out."""
    out = []
    for r in range(len(batch)):
        index = batch.example[r]
        for k in index.unique().tolist():
            at = index == k
            if (batch.targets[r][at] != IGNORE_INDEX).any():
                out.append((batch.inputs[r][at].tolist(), batch.targets[r][at].tolist()))
    return out


def test_packed_rows_hold_every_example_intact_with_its_own_positions():
    examples = _examples([5, 9, 17, 3, 12, 8, 2, 20])
    data = ExampleDataset(examples, seq_len=20, packing="packed")
    rows = data._batch(data._train, torch.arange(data.num_train_rows))
    expected = []
    for ids, learn in zip(examples.ids, examples.learn):
        expected.append((ids[:-1].tolist(), np.where(learn[1:], ids[1:], IGNORE_INDEX).tolist()))
    assert sorted(_pieces(rows)) == sorted(expected)
    assert data.num_train_rows < len(examples.ids) and data.stats["fill"] > 0.7  # several examples share rows
    documents = PackedDocuments.from_index(rows.example)
    for r in range(len(rows)):  # positions restart at each example; the mask keeps each within itself
        starts = torch.nonzero(documents.position[r] == 0).flatten().tolist()
        assert starts == [0] + torch.nonzero(rows.example[r, 1:] != rows.example[r, :-1]).flatten().add(1).tolist()
    mask = documents.causal_mask()
    same = rows.example.unsqueeze(2) == rows.example.unsqueeze(1)
    assert not (mask[:, 0] & ~same).any()


def test_padded_rows_hold_one_example_each():
    examples = _examples([5, 9, 17])
    data = ExampleDataset(examples, seq_len=20, packing="padded", pad_id=7)
    rows = data._batch(data._train, torch.arange(3))
    assert rows.example is None and data.num_train_rows == 3
    for r, ids in enumerate(examples.ids):
        n = len(ids) - 1
        assert rows.inputs[r, :n].tolist() == ids[:-1].tolist() and (rows.inputs[r, n:] == 7).all()
        assert (rows.targets[r, n:] == IGNORE_INDEX).all()


@pytest.mark.parametrize("long_examples", ["truncate", "drop"])
def test_long_examples_are_truncated_or_dropped_and_counted(long_examples):
    # 30 tokens > 20 + 1: cut to 21 (its learned second half partly kept), or left out; 42 tokens: its learned half
    # starts at 21, so once cut it has nothing to learn: left out either way, and counted once
    data = ExampleDataset(_examples([5, 30, 42, 8]), seq_len=20, long_examples=long_examples)
    s = data.stats
    assert s["examples"] == 4 == s["train_examples"] + s["val_examples"] + s["dropped_long"] + s["dropped_empty"]
    if long_examples == "truncate":
        assert (s["truncated"], s["dropped_long"], s["dropped_empty"], s["train_examples"]) == (1, 0, 1, 3)
    else:
        assert (s["truncated"], s["dropped_long"], s["dropped_empty"], s["train_examples"]) == (0, 2, 0, 2)


def test_rows_are_drawn_by_seed_alone_and_validation_is_the_last_examples():
    data = ExampleDataset(_examples([6] * 40), seq_len=12, val_fraction=0.1)
    assert data.stats["val_examples"] == 4 and data.num_val_rows == 2
    first = data.global_batch(3, seed=5, global_batch_size=4)
    again = ExampleDataset(_examples([6] * 40), seq_len=12, val_fraction=0.1).global_batch(3, 5, 4)
    assert torch.equal(first.inputs, again.inputs) and torch.equal(first.example, again.example)
    assert not torch.equal(first.inputs, data.global_batch(3, seed=6, global_batch_size=4).inputs)
    assert data.val_batch(1).inputs.shape == (1, 12)
