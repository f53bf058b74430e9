"""The rows of a training step as the model takes them: inputs, targets, and where each example lies.

Pretraining windows of seq_len + 1 tokens become inputs [:, :-1] and targets [:, 1:] (every target counts).
Instruction data (tensorpar.data.examples) gives targets of its own: IGNORE_INDEX wherever a position is not
to be learned (prompts, system and user turns, padding), and, when several examples share a row, the example
each position belongs to, so that no example attends to another.
"""

from __future__ import annotations

import dataclasses

import torch

IGNORE_INDEX = -100  # a target the loss skips (the convention of torch's cross_entropy and the model's loss)


@dataclasses.dataclass
class Batch:
    """`inputs` and `targets` [B, L] (int64); `example` [B, L]: the example each position belongs to, counted from
    0 in each row and never decreasing along it (None: each row is one sequence)."""

    inputs: torch.Tensor
    targets: torch.Tensor
    example: torch.Tensor | None = None

    @classmethod
    def from_windows(cls, windows: torch.Tensor) -> "Batch":
        """Token windows [B, L + 1]: inputs the first L tokens, targets the last L."""
        return cls(windows[:, :-1], windows[:, 1:])

    def __len__(self) -> int:
        return self.inputs.shape[0]

    def __getitem__(self, rows: slice) -> "Batch":
        """The rows `rows` (a slice), as slicing a tensor of token windows gives its rows."""
        return Batch(self.inputs[rows], self.targets[rows], None if self.example is None else self.example[rows])

    def rows(self, start: int, stop: int) -> "Batch":
        return self[start:stop]

    def split(self, rows: int) -> list["Batch"]:
        """Consecutive batches of `rows` rows."""
        return [self.rows(i, i + rows) for i in range(0, len(self), rows)]

    def to(self, device) -> "Batch":
        return Batch(self.inputs.to(device), self.targets.to(device),
                     None if self.example is None else self.example.to(device))

    def padded(self, rows: int) -> "Batch":
        """These rows, then copies of the first up to `rows` rows, the copies' targets all IGNORE_INDEX: a batch of
        a fixed size whose loss (the mean over its valid targets) is this one's."""
        extra = rows - len(self)
        if extra <= 0:
            return self
        repeat = lambda t: torch.cat([t, t[:1].expand(extra, -1)])  # noqa: E731
        ignored = torch.full_like(self.targets[:1], IGNORE_INDEX).expand(extra, -1)
        return Batch(repeat(self.inputs), torch.cat([self.targets, ignored]),
                     None if self.example is None else repeat(self.example))

    def valid_targets(self) -> int:
        """How many targets the loss counts."""
        return int((self.targets != IGNORE_INDEX).sum())


def as_batch(rows) -> Batch:
    """A `Batch` as it is, or token windows [B, L + 1] as one."""
    return rows if isinstance(rows, Batch) else Batch.from_windows(rows)
