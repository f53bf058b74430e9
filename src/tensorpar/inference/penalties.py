"""The sampling parameters that look at a sequence's tokens so far, applied to vocabulary-sharded logits (`tensorpar
generate`'s and `tensorpar serve`'s).

Each rank changes only the logits of its own slice of the vocabulary, so no collective is needed: each row comes
with its `Penalties`, the continuation's (token, count) pairs and the prompt's distinct tokens (serve's step plan
carries them to every rank). As vLLM applies them, before the temperature, and to greedy rows too:

- `repetition` r (CTRL, transformers' `RepetitionPenaltyLogitsProcessor`): every token of the prompt or the
  continuation has its logit divided by r where positive, multiplied by r where negative;
- `frequency` f and `presence` p (OpenAI's definition, over the continuation's tokens):
  logit[j] -= f * count[j] + p * (count[j] > 0);
- `banned` tokens (serve's EOS and stop tokens while fewer than `min_tokens` are generated; transformers'
  `MinNewTokensLengthLogitsProcessor`) get -inf.

`min_p` (transformers' `MinPLogitsWarper`) keeps the tokens whose probability is at least min_p times the most
likely one's: a logit threshold of max + log(min_p) after the temperature, with the row's max from every rank
(`min_p_threshold`, one all-reduce).
"""

from __future__ import annotations

import dataclasses
import math

import torch


@dataclasses.dataclass(frozen=True)
class Penalties:
    """One row's penalties and the tokens they look at."""

    presence: float = 0.0
    frequency: float = 0.0
    repetition: float = 1.0
    output_counts: tuple[tuple[int, int], ...] = ()  # (token, times generated)
    prompt_tokens: tuple[int, ...] = ()  # the prompt's distinct tokens (repetition's)
    banned: tuple[int, ...] = ()

    @property
    def active(self) -> bool:
        return self.presence != 0.0 or self.frequency != 0.0 or self.repetition != 1.0 or bool(self.banned)


def _local(ids, start: int, width: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(positions in this rank's slice, positions in `ids`) of the ids that fall in [start, start + width)."""
    ids = torch.as_tensor(list(ids), dtype=torch.long, device=device)
    mine = (ids >= start) & (ids < start + width)
    which = mine.nonzero().flatten()
    return ids[which] - start, which


def apply_penalties(scores: torch.Tensor, rows: list[Penalties | None], start: int) -> None:
    """Penalize, in place, row r of this rank's logits [R, V_local] (vocabulary ids from `start`) as `rows[r]`
    asks (None: not at all)."""
    width = scores.shape[-1]
    for r, p in enumerate(rows):
        if p is None or not p.active:
            continue
        row = scores[r]
        if p.repetition != 1.0:
            seen = set(p.prompt_tokens) | {token for token, _ in p.output_counts}
            index, _ = _local(sorted(seen), start, width, scores.device)
            values = row[index]
            row[index] = torch.where(values > 0, values / p.repetition, values * p.repetition)
        if p.output_counts and (p.frequency or p.presence):
            index, which = _local([t for t, _ in p.output_counts], start, width, scores.device)
            counts = torch.tensor([c for _, c in p.output_counts], dtype=row.dtype, device=row.device)[which]
            row[index] -= counts * p.frequency + p.presence
        if p.banned:
            index, _ = _local(p.banned, start, width, scores.device)
            row[index] = float("-inf")


def min_p_threshold(local: torch.Tensor, group, min_p: float) -> torch.Tensor:
    """Per row of this rank's (temperature-scaled) logits [B, V_local], the smallest logit `min_p` keeps: the row's
    max over every rank + log(min_p). A collective."""
    top = group.all_reduce(local.max(dim=-1).values.clone(), op="max")
    return top + math.log(min_p)
