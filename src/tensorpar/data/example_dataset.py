"""Tokenized examples laid into rows of seq_len positions: packed several to a row, or one to a row, padded.

An example of n tokens takes n - 1 positions: inputs ids[:-1], targets ids[1:] where the next token is learned
(IGNORE_INDEX elsewhere), so no position of a row ever predicts another example's token. One longer than the
row (n - 1 > seq_len) is cut to its first seq_len + 1 tokens, or left out (`long_examples`: "truncate" or
"drop"); one with nothing left to learn is left out. Both are counted in `stats`.

- "packed": examples in file order fill rows first-fit (each goes into the first of the last few open rows with
  room for it); every position carries its example's number in the row (`Batch.example`), so that attention
  stays within each example and positions restart at each, as under --document-mask. The rest of a row is
  padding: an example of its own, with nothing to learn.
- "padded": one example per row, the rest padding; causal attention alone keeps an example from seeing it.

The last `val_fraction` of the examples (at least one when it is above 0) are validation rows. Training rows
are drawn as TokenDataset draws windows: a new permutation each epoch, fixed by the seed alone.
"""

from __future__ import annotations

import numpy as np
import torch

from tensorpar.config.choices import EXAMPLE_PACKINGS, LONG_EXAMPLES
from tensorpar.data.batch import IGNORE_INDEX, Batch
from tensorpar.data.chat_template import ChatTemplate
from tensorpar.data.dataset import check_step, epoch_permutation
from tensorpar.data.examples import Examples
from tensorpar.errors import TensorparError

OPEN_ROWS = 8  # first-fit looks for room in the last this many rows


def _fit(examples: Examples, seq_len: int, long_examples: str, stats: dict) -> list[tuple[np.ndarray, np.ndarray]]:
    """(inputs, targets) of every example that can be trained on, cut or left out per `long_examples`."""
    out = []
    for ids, learn in zip(examples.ids, examples.learn):
        cut = len(ids) - 1 > seq_len
        if cut:
            if long_examples == "drop":
                stats["dropped_long"] += 1
                continue
            ids, learn = ids[: seq_len + 1], learn[: seq_len + 1]
        targets = np.where(learn[1:], ids[1:], IGNORE_INDEX)
        if len(ids) < 2 or not learn[1:].any():  # counted here only, even if it was cut first
            stats["dropped_empty"] += 1
            continue
        stats["truncated"] += cut
        out.append((ids[:-1], targets))
    return out


def _rows(pieces: list[tuple[np.ndarray, np.ndarray]], seq_len: int, packed: bool, pad_id: int):
    """[R, L] inputs, targets and (packed) example numbers of the rows the pieces fill."""
    rows: list[list[int]] = []  # the pieces in each row
    room: list[int] = []
    for i, (inputs, _) in enumerate(pieces):
        n = len(inputs)
        first = len(rows) - OPEN_ROWS if packed else len(rows)
        row = next((r for r in range(max(first, 0), len(rows)) if room[r] >= n), None)
        if row is None:
            rows.append([])
            room.append(seq_len)
            row = len(rows) - 1
        rows[row].append(i)
        room[row] -= n
    inputs = np.full((len(rows), seq_len), pad_id, dtype=np.int64)
    targets = np.full((len(rows), seq_len), IGNORE_INDEX, dtype=np.int64)
    example = np.zeros((len(rows), seq_len), dtype=np.int64)
    for r, members in enumerate(rows):
        at = 0
        for k, i in enumerate(members):
            n = len(pieces[i][0])
            inputs[r, at:at + n], targets[r, at:at + n], example[r, at:at + n] = pieces[i][0], pieces[i][1], k
            at += n
        example[r, at:] = len(members)  # the padding: an example of its own
    return inputs, targets, (example if packed else None)


class ExampleDataset:
    """Instruction examples in rows of `seq_len` positions; the interface of TokenDataset (`global_batch`,
    `describe_samples`), giving `Batch`es."""

    def __init__(self, examples: Examples, seq_len: int, packing: str = "packed", long_examples: str = "truncate",
                 val_fraction: float = 0.0, pad_id: int = 0, template: ChatTemplate | None = None):
        if packing not in EXAMPLE_PACKINGS or long_examples not in LONG_EXAMPLES:
            raise TensorparError(f"packing must be one of {EXAMPLE_PACKINGS} and long examples one of {LONG_EXAMPLES}, got "
                                 f"{packing!r} and {long_examples!r}")
        self.seq_len, self.packing, self.kind, self.template = seq_len, packing, examples.kind, template
        self.stats = {"examples": len(examples.ids), "truncated": 0, "dropped_long": 0, "dropped_empty": 0}
        pieces = _fit(examples, seq_len, long_examples, self.stats)
        num_val = int(len(pieces) * val_fraction)
        if val_fraction > 0 and num_val == 0 and len(pieces) >= 2:
            num_val = 1
        train, val = pieces[: len(pieces) - num_val], pieces[len(pieces) - num_val:]
        if not train:
            raise TensorparError(self._nothing_to_train(long_examples))
        packed = packing == "packed"
        self._train = [torch.from_numpy(a) if a is not None else None for a in _rows(train, seq_len, packed, pad_id)]
        self._val = ([torch.from_numpy(a) if a is not None else None for a in _rows(val, seq_len, packed, pad_id)]
                     if val else None)
        self.num_train_rows = len(self._train[0])
        self.num_val_rows = len(self._val[0]) if val else 0
        learned = int((self._train[1] != IGNORE_INDEX).sum())
        self.stats.update(train_examples=len(train), val_examples=len(val), train_rows=self.num_train_rows,
                          val_rows=self.num_val_rows, learned_tokens=learned,
                          fill=sum(len(p[0]) for p in train) / (self.num_train_rows * seq_len))

    def _nothing_to_train(self, long_examples: str) -> str:
        s = self.stats
        return (f"none of the {s['examples']} examples can be trained on at seq_len {self.seq_len}: {s['dropped_long']} "
                f"longer than it (--long-examples {long_examples}), {s['dropped_empty']} with nothing to learn")

    def sample_indices(self, step: int, seed: int, global_batch_size: int) -> np.ndarray:
        """Training-row indices of step `step`: positions [step*G, (step+1)*G) of the rows' endless shuffled stream."""
        check_step(step, seed, global_batch_size)
        n, start, stop = self.num_train_rows, step * global_batch_size, (step + 1) * global_batch_size
        parts = []
        for epoch in range(start // n, (stop - 1) // n + 1):
            lo, hi = max(start, epoch * n) - epoch * n, min(stop, (epoch + 1) * n) - epoch * n
            parts.append(epoch_permutation(n, seed, epoch)[lo:hi])
        return np.concatenate(parts)

    def global_batch(self, step: int, seed: int, global_batch_size: int) -> Batch:
        """The rows of optimizer step `step` (0-based)."""
        return self._batch(self._train, torch.from_numpy(self.sample_indices(step, seed, global_batch_size)))

    def val_batch(self, max_rows: int | None = None) -> Batch | None:
        """The validation rows in order (the first `max_rows`), or None without any."""
        if self._val is None:
            return None
        n = self.num_val_rows if max_rows is None else min(max(max_rows, 0), self.num_val_rows)
        return self._batch(self._val, torch.arange(n))

    @staticmethod
    def _batch(arrays, index: torch.Tensor) -> Batch:
        inputs, targets, example = arrays
        return Batch(inputs[index], targets[index], None if example is None else example[index])

    def prompt(self, text: str) -> str:
        """What a model trained on these examples is prompted with for `text`: a user's message rendered with the
        chat template and its generation prompt (conversations), or `text` itself."""
        if self.template is None:
            return text
        return self.template.render([{"role": "user", "content": text}], add_generation_prompt=True)

    def describe_samples(self, step: int, seed: int, global_batch_size: int) -> str:
        return f"rows {self.sample_indices(step, seed, global_batch_size).tolist()} ({self.packing} examples)"

    def __repr__(self) -> str:
        return (f"ExampleDataset({self.kind}, seq_len={self.seq_len}, {self.packing}, train_rows={self.num_train_rows}, "
                f"val_rows={self.num_val_rows})")
