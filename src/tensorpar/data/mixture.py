"""Weighted mixtures of sources: the `--data` syntax, and which source each sample position draws from.

`--data "0.7 path/a 0.3 path/b"` (Megatron's syntax: weight, path, weight, path, ...) or `--data mix.toml`
with a table of path = weight (paths relative to the file):

    [mixture]
    "fineweb/" = 0.7
    "pile.jsonl.gz" = 0.3

Blending is deterministic and low-discrepancy: source i's k-th sample sits at the "ideal time"
(k + 1/2) / w_i, and sample positions take the sources' samples in order of those times (ties: the
lower source number). After any p samples each source has contributed within one sample of w_i * p,
and the counts at any position are computed directly (no replay from the start), so the sample at a
step depends only on the step, the seed and the global batch: a resumed run continues every source
exactly where the interrupted one stopped.
"""

from __future__ import annotations

import os
import sys

import numpy as np
import torch

from tensorpar.data.dataset import TokenDataset, check_step
from tensorpar.errors import TensorparError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib


def _weight(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


def parse_data_spec(spec: str | None) -> list[tuple[float, str | None]]:
    """[(weight, path)] of a `--data` value, weights normalized to sum 1; a single path (or None: the default
    corpus) has weight 1."""
    if spec is None:
        return [(1.0, None)]
    if spec.endswith(".toml") and os.path.isfile(spec):
        return _normalize(_toml_mixture(spec), spec)
    words = spec.split()
    if len(words) >= 2 and _weight(words[0]) is not None and not os.path.exists(spec):
        if len(words) % 2 or any(_weight(w) is None for w in words[::2]):
            raise TensorparError(f"data mixture '{spec}': weights and paths must alternate, as in "
                                 f"'0.7 PATH_A 0.3 PATH_B'")
        return _normalize([(_weight(w), p) for w, p in zip(words[::2], words[1::2])], spec)
    return [(1.0, spec)]


def _toml_mixture(path: str) -> list[tuple[float, str]]:
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise TensorparError(f"data mixture file '{path}' is not valid TOML: {e}") from None
    table = data.get("mixture")
    if not isinstance(table, dict) or not table:
        raise TensorparError(f"data mixture file '{path}' needs a [mixture] table of \"path\" = weight lines")
    base = os.path.dirname(os.path.abspath(path))
    out = []
    for name, weight in table.items():
        if isinstance(weight, bool) or not isinstance(weight, (int, float)):
            raise TensorparError(f"data mixture file '{path}': the weight of '{name}' must be a number, "
                                 f"got {weight!r}")
        out.append((float(weight), name if os.path.isabs(name) else os.path.join(base, name)))
    return out


def _normalize(pairs: list[tuple[float, str]], spec: str) -> list[tuple[float, str]]:
    for weight, path in pairs:
        if not weight > 0 or not np.isfinite(weight):
            raise TensorparError(f"data mixture '{spec}': the weight of '{path}' must be a positive number, "
                                 f"got {weight}")
    paths = [p for _, p in pairs]
    if len(set(paths)) != len(paths):
        raise TensorparError(f"data mixture '{spec}' names a source twice")
    total = sum(w for w, _ in pairs)
    return [(w / total, p) for w, p in pairs]


class Blend:
    """Which source each sample position of a mixture with these weights draws from."""

    def __init__(self, weights):
        self.weights = np.asarray(weights, dtype=np.float64)
        if self.weights.ndim != 1 or not len(self.weights) or np.any(self.weights <= 0):
            raise TensorparError(f"mixture weights must be positive, got {list(weights)}")

    def _key(self, i: int, k: int) -> float:
        return (k + 0.5) / self.weights[i]

    def counts_before(self, position: int) -> np.ndarray:
        """Samples drawn from each source by positions [0, position)."""
        w, k = self.weights, len(self.weights)
        counts = np.floor(w * position).astype(np.int64)
        while True:
            nxt = [(self._key(i, counts[i]), i) for i in range(k)]
            last = [(self._key(i, counts[i] - 1), i) for i in range(k) if counts[i] > 0]
            total = int(counts.sum())
            if total < position:
                counts[min(nxt)[1]] += 1
            elif total > position:
                counts[max(last)[1]] -= 1
            elif last and max(last) > min(nxt):  # not the first `position` samples in time order: swap
                counts[max(last)[1]] -= 1
                counts[min(nxt)[1]] += 1
            else:
                return counts

    def assign(self, start: int, count: int) -> tuple[np.ndarray, np.ndarray]:
        """(source, ordinal within that source) of sample positions [start, start + count)."""
        first = self.counts_before(start)
        ordinals = first[:, None] + np.arange(count)[None, :]
        keys = (ordinals + 0.5) / self.weights[:, None]
        sources = np.broadcast_to(np.arange(len(self.weights))[:, None], keys.shape)
        order = np.lexsort((sources.ravel(), keys.ravel()))[:count]
        return sources.ravel()[order], ordinals.ravel()[order]


class MixtureDataset:
    """Sources blended by weight; each source is a `TokenDataset` (its own windows, shuffle and validation
    tail). Same interface as `TokenDataset` for the training loop."""

    def __init__(self, datasets: list[TokenDataset], weights, names: list[str]):
        self.datasets, self.names = datasets, names
        self.blend = Blend(weights)
        self.seq_len = datasets[0].seq_len
        self.num_train_windows = sum(d.num_train_windows for d in datasets)
        self.num_val_windows = sum(d.num_val_windows for d in datasets)

    def consumed(self, step: int, global_batch_size: int) -> list[int]:
        """Samples drawn from each source by the first `step` steps: the position in every source."""
        return [int(c) for c in self.blend.counts_before(step * global_batch_size)]

    def sample_indices(self, step: int, seed: int, global_batch_size: int) -> list[tuple[int, int]]:
        """(source, training-window index in that source) of each sample of step `step`, in batch order."""
        check_step(step, seed, global_batch_size)
        sources, ordinals = self.blend.assign(step * global_batch_size, global_batch_size)
        out: list[tuple[int, int]] = [(0, 0)] * global_batch_size
        for i, ds in enumerate(self.datasets):
            rows = np.flatnonzero(sources == i)
            if rows.size:
                picked = ordinals[rows]
                index = ds.shuffled_indices(int(picked.min()), int(picked.max()) + 1, seed)[picked - picked.min()]
                for row, window in zip(rows, index):
                    out[row] = (i, int(window))
        return out

    def describe_samples(self, step: int, seed: int, global_batch_size: int) -> str:
        """Where step `step`'s samples come from, to look at them: each source's training-window indices."""
        by_source: dict[int, list[int]] = {}
        for source, window in self.sample_indices(step, seed, global_batch_size):
            by_source.setdefault(source, []).append(window)
        return "; ".join(f"{self.names[i]}: windows {w}" for i, w in sorted(by_source.items())) + \
            f" (seq_len {self.seq_len})"

    def global_batch(self, step: int, seed: int, global_batch_size: int) -> torch.Tensor:
        """The samples of optimizer step `step` (0-based): LongTensor [global_batch_size, seq_len + 1]."""
        check_step(step, seed, global_batch_size)
        sources, ordinals = self.blend.assign(step * global_batch_size, global_batch_size)
        out = torch.empty(global_batch_size, self.seq_len + 1, dtype=torch.long)
        for i, ds in enumerate(self.datasets):
            rows = np.flatnonzero(sources == i)
            if rows.size:
                picked = ordinals[rows]
                index = ds.shuffled_indices(int(picked.min()), int(picked.max()) + 1, seed)
                out[torch.from_numpy(rows)] = ds.windows(index[picked - picked.min()])
        return out

    def val_windows(self, max_windows: int | None = None) -> torch.Tensor:
        """Validation windows of every source, blended by weight in stream order (each source's tail once)."""
        limit = self.num_val_windows if max_windows is None else min(max(max_windows, 0), self.num_val_windows)
        sources, ordinals = self.blend.assign(0, self.num_val_windows * 2 + len(self.datasets))
        keep = np.array([k < self.datasets[i].num_val_windows for i, k in zip(sources, ordinals)], dtype=bool)
        sources, ordinals = sources[keep][:limit], ordinals[keep][:limit]
        out = torch.empty(len(sources), self.seq_len + 1, dtype=torch.long)
        for i, ds in enumerate(self.datasets):
            rows = np.flatnonzero(sources == i)
            if rows.size:
                out[torch.from_numpy(rows)] = ds.val_windows(int(ordinals[rows].max()) + 1)[ordinals[rows]]
        return out

    def __repr__(self) -> str:
        parts = ", ".join(f"{w:.3g} {n}" for w, n in zip(self.blend.weights, self.names))
        return f"MixtureDataset({parts}; train_windows={self.num_train_windows})"
