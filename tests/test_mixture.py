"""Weighted mixtures: the --data syntax, proportions, and sample order that is a function of the step alone."""

import numpy as np
import pytest
import torch

from tensorpar.data import Blend, MixtureDataset, TokenDataset, parse_data_spec
from tensorpar.errors import TensorparError


def test_megatron_syntax_and_toml_table(tmp_path):
    a, b = tmp_path / "a.jsonl", tmp_path / "b"
    a.write_text("{}\n")
    assert parse_data_spec(f"0.7 {a} 0.3 {b}") == [(0.7, str(a)), (0.3, str(b))]
    assert parse_data_spec(f"2 {a} 6 {b}") == [(0.25, str(a)), (0.75, str(b))]
    assert parse_data_spec(str(a)) == [(1.0, str(a))] and parse_data_spec(None) == [(1.0, None)]
    (tmp_path / "mix.toml").write_text('[mixture]\n"a.jsonl" = 1\n"/abs/b" = 3.0\n')
    assert parse_data_spec(str(tmp_path / "mix.toml")) == [(0.25, str(a)), (0.75, "/abs/b")]
    with pytest.raises(TensorparError, match="weight of '.*b' must be a positive number, got 0.0"):
        parse_data_spec(f"1 {a} 0 {b}")
    with pytest.raises(TensorparError, match="weights and paths must alternate"):
        parse_data_spec(f"0.7 {a} 0.3")
    with pytest.raises(TensorparError, match="names a source twice"):
        parse_data_spec(f"1 {a} 1 {a}")
    (tmp_path / "bad.toml").write_text('[mixture]\n"a" = "lots"\n')
    with pytest.raises(TensorparError, match=r"bad\.toml': the weight of 'a' must be a number"):
        parse_data_spec(str(tmp_path / "bad.toml"))
    (tmp_path / "none.toml").write_text('a = 1\n')
    with pytest.raises(TensorparError, match=r"none\.toml' needs a \[mixture\] table"):
        parse_data_spec(str(tmp_path / "none.toml"))


@pytest.mark.parametrize("weights", [[0.7, 0.3], [0.5, 0.3, 0.2], [0.01, 0.99], [1 / 3, 1 / 3, 1 / 3]])
def test_proportions_within_one_percent_over_10000_samples(weights):
    blend = Blend(weights)
    sources, ordinals = blend.assign(0, 10_000)
    counts = np.bincount(sources, minlength=len(weights))
    assert np.all(np.abs(counts - 10_000 * np.array(weights)) <= 0.01 * 10_000 * np.array(weights)), counts
    assert np.all(np.abs(counts - 10_000 * np.array(weights)) <= 1)  # in fact within one sample
    for i in range(len(weights)):  # each source's samples are its ordinals 0, 1, 2, ... in order
        assert ordinals[sources == i].tolist() == list(range(counts[i]))


def test_any_position_is_computed_directly_and_agrees_with_the_sequence():
    blend = Blend([0.5, 0.3, 0.2])
    sources, _ = blend.assign(0, 3000)
    for p in (0, 1, 7, 999, 1000, 2999):
        assert blend.counts_before(p).tolist() == np.bincount(sources[:p], minlength=3).tolist()
        s, _ = blend.assign(p, 1)
        assert s[0] == sources[p]
    late = blend.counts_before(10**12)
    assert late.sum() == 10**12 and np.all(np.abs(late - 10**12 * blend.weights) <= 1)


def _mixture():
    a = TokenDataset(np.arange(0, 400), seq_len=7, val_fraction=0.1, stream_id=0)          # 45 + 5 windows
    b = TokenDataset(np.arange(10_000, 10_160), seq_len=7, val_fraction=0.1, stream_id=1)  # 18 + 2 windows
    return MixtureDataset([a, b], [0.75, 0.25], ["a", "b"])


def test_mixture_batches_depend_on_step_seed_and_batch_only():
    ds = _mixture()
    batches = [ds.global_batch(s, seed=3, global_batch_size=8) for s in range(20)]
    assert torch.equal(_mixture().global_batch(13, 3, 8), batches[13])     # random access, a fresh object
    assert not torch.equal(ds.global_batch(0, 4, 8), batches[0])
    rows = torch.cat(batches)
    from_b = (rows[:, 0] >= 10_000).sum().item()
    assert from_b == 40 and ds.consumed(20, 8) == [120, 40]
    assert (rows[:, 1:] - rows[:, :-1] == 1).all()                          # whole windows of one source
    first_epoch_b = [r for r in rows[:, 0].tolist() if r >= 10_000][:18]
    assert sorted(first_epoch_b) == list(range(10_000, 10_144, 8))          # each window of b once per epoch
    val = ds.val_windows()
    assert val.shape == (7, 8) and sorted(val[:, 0].tolist()) == [360, 368, 376, 384, 392, 10_144, 10_152]


def test_sample_indices_name_the_windows_of_each_batch_row():
    """What a loss-spike line reports: (source, window) of every row, which are the rows global_batch returns."""
    ds = _mixture()
    for step in (0, 7, 13):
        batch = ds.global_batch(step, seed=3, global_batch_size=8)
        picked = ds.sample_indices(step, seed=3, global_batch_size=8)
        assert torch.equal(torch.stack([ds.datasets[i].windows([w])[0] for i, w in picked]), batch)
    text = ds.describe_samples(7, 3, 8)
    assert text.startswith("a: windows [") and "; b: windows [" in text
