"""The sampling parameters that look at a sequence's tokens so far, applied to vocabulary-sharded logits.

Each rank changes only the logits of its own slice of the vocabulary, so no collective is needed: the step plan
carries, for each penalized row, the continuation's (token, count) pairs and the prompt's distinct tokens
(`StepItem.output_counts`, `StepItem.prompt_tokens`). As vLLM applies them, before the temperature, and for greedy
rows too:

- `repetition_penalty` r (CTRL, transformers' `RepetitionPenaltyLogitsProcessor`): every token of the prompt or the
  continuation has its logit divided by r where positive, multiplied by r where negative;
- `frequency_penalty` f and `presence_penalty` p (OpenAI's definition, over the continuation's tokens):
  logit[j] -= f * count[j] + p * (count[j] > 0);
- `banned` tokens (the EOS and stop tokens while fewer than `min_tokens` are generated; transformers'
  `MinNewTokensLengthLogitsProcessor`) get -inf.

`min_p` (transformers' `MinPLogitsWarper`) keeps the tokens whose probability is at least min_p times the most
likely one's: a logit threshold of max + log(min_p) after the temperature, with the row's max from every rank
(`min_p_threshold`, one all-reduce).
"""

from __future__ import annotations

import math

import torch


def _local(ids, start: int, width: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(positions in this rank's slice, positions in `ids`) of the ids that fall in [start, start + width)."""
    ids = torch.as_tensor(list(ids), dtype=torch.long, device=device)
    mine = (ids >= start) & (ids < start + width)
    which = mine.nonzero().flatten()
    return ids[which] - start, which


def apply_penalties(scores: torch.Tensor, items, start: int) -> None:
    """Penalize, in place, row r of this rank's logits [R, V_local] (vocabulary ids from `start`) as `items[r]` (a
    `StepItem` with its `sample`) asks."""
    width = scores.shape[-1]
    for r, item in enumerate(items):
        sampling, row = item.sample, scores[r]
        if sampling.repetition_penalty != 1.0:
            seen = set(item.prompt_tokens) | {token for token, _ in item.output_counts}
            index, _ = _local(sorted(seen), start, width, scores.device)
            values = row[index]
            row[index] = torch.where(values > 0, values / sampling.repetition_penalty,
                                     values * sampling.repetition_penalty)
        if item.output_counts and (sampling.frequency_penalty or sampling.presence_penalty):
            index, which = _local([t for t, _ in item.output_counts], start, width, scores.device)
            counts = torch.tensor([c for _, c in item.output_counts], dtype=row.dtype, device=row.device)[which]
            row[index] -= counts * sampling.frequency_penalty + sampling.presence_penalty
        if item.banned:
            index, _ = _local(item.banned, start, width, scores.device)
            row[index] = float("-inf")


def min_p_threshold(local: torch.Tensor, group, min_p: float) -> torch.Tensor:
    """Per row of this rank's (temperature-scaled) logits [B, V_local], the smallest logit `min_p` keeps: the row's
    max over every rank + log(min_p). A collective."""
    top = group.all_reduce(local.max(dim=-1).values.clone(), op="max")
    return top + math.log(min_p)
