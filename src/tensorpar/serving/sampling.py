"""Per-request sampling and log-probs from vocabulary-sharded logits, without gathering the logits.

Each row of a step has its own sampling parameters and its own noise: Gumbel noise seeded by (the request's seed, the
index of the token in its continuation), the draw `tensorpar generate` makes for a lone prompt. So a request's
tokens depend on its seed alone, not on what else is in the batch, and equal `tensorpar generate --seed`'s. The
pieces are generate's (`tensorpar.inference.generation`): top-k / top-p thresholds from gathered candidates, the
greedy all-gather of (value, id); min-p and the penalties on the tokens seen: `tensorpar.inference.penalties`.

Log-probs are those of the model's distribution (the raw logits, before temperature and top-k / top-p), as the
OpenAI API and lm-eval expect: log_softmax needs each row's global max and sum of exponentials; one all-gather per
step carries them with each rank's logit of the row's token and its top-k candidates.
"""

from __future__ import annotations

import torch

from tensorpar.inference.generation import gumbel_noise, keep_threshold, tp_argmax_rows
from tensorpar.inference.penalties import Penalties, apply_penalties, min_p_threshold
from tensorpar.serving.step_plan import Sampling, TokenLogprob


def sample_rows(local_logits: torch.Tensor, model, rows: list[Sampling], steps: list[int], items=None) -> torch.Tensor:
    """The next token [R] of every row of vocabulary-sharded logits [R, V_local], row r with `rows[r]` and noise of
    step `steps[r]`, penalized as `items[r]` (its `StepItem`: the tokens seen, the banned ones) asks; a
    collective over the TP group, the same on every rank."""
    group = model.tp_group
    scores = model.mask_padding(local_logits.float()).double()
    if items is not None:
        apply_penalties(scores, [penalties(it) for it in items], group.rank * scores.shape[-1])
    sampled = [r for r, s in enumerate(rows) if not s.greedy]
    if sampled:
        index = torch.tensor(sampled, device=scores.device)
        temperature = torch.tensor([rows[r].temperature for r in sampled], dtype=torch.float64, device=scores.device)
        local = scores[index] / temperature[:, None]
        by_filter: dict[tuple[int, float, float], list[int]] = {}
        for i, r in enumerate(sampled):
            key = (min(rows[r].top_k, model.cfg.vocab_size), rows[r].top_p, rows[r].min_p)
            by_filter.setdefault(key, []).append(i)
        for (top_k, top_p, min_p), members in sorted(by_filter.items()):  # the same order on every rank
            part = torch.tensor(members, device=scores.device)
            threshold = keep_threshold(local[part], group, top_k, top_p)
            if min_p > 0.0:
                floor = min_p_threshold(local[part], group, min_p)
                threshold = floor if threshold is None else torch.maximum(threshold, floor)
            if threshold is not None:
                local[part] = local[part].masked_fill(local[part] < threshold[:, None], float("-inf"))
        noise = torch.stack([gumbel_noise(model.cfg.vocab_size, local.shape[-1], group.rank, rows[r].seed, steps[r],
                                          local.device) for r in sampled])
        scores[index] = local + noise
    return tp_argmax_rows(scores, group)


def penalties(item) -> Penalties:
    """The penalties of a step item's sample (`StepItem`: its sampling, the tokens it has seen, the banned ones)."""
    s = item.sample
    return Penalties(s.presence_penalty, s.frequency_penalty, s.repetition_penalty, item.output_counts,
                     item.prompt_tokens, item.banned)


def token_logprobs(local_logits: torch.Tensor, model, targets: torch.Tensor, top: int) -> list[TokenLogprob]:
    """log_softmax(logits)[target] of every row of vocabulary-sharded logits [R, V_local], with the `top` most likely
    tokens of the row (ties: lowest id first); one all-gather over the TP group."""
    group = model.tp_group
    local = model.mask_padding(local_logits.float()).double()
    rows, width = local.shape
    start = group.rank * width
    m = local.max(dim=-1).values
    s = (local - m[:, None]).exp().sum(dim=-1)
    owned = (targets >= start) & (targets < start + width)
    picked = local.gather(1, (targets - start).clamp(0, width - 1)[:, None])[:, 0]
    picked = torch.where(owned, picked, torch.full_like(picked, float("-inf")))
    k = min(top, width)
    values, ids = local.topk(k, dim=-1) if k else (local[:, :0], local[:, :0].long())
    pack = torch.cat([m[:, None], s[:, None], picked[:, None], values, (ids + start).double()], dim=-1)
    gathered = group.all_gather(pack.unsqueeze(0), dim=0)  # [tp, R, 3 + 2k]
    top_m = gathered[..., 0].max(dim=0).values
    lse = top_m + (gathered[..., 1] * (gathered[..., 0] - top_m).exp()).sum(dim=0).log()
    chosen = gathered[..., 2].max(dim=0).values - lse
    cand_values = gathered[..., 3:3 + k].permute(1, 0, 2).reshape(rows, -1)
    cand_ids = gathered[..., 3 + k:].permute(1, 0, 2).reshape(rows, -1)
    out = []
    for r in range(rows):
        pairs = sorted(zip(cand_values[r].tolist(), cand_ids[r].tolist()), key=lambda p: (-p[0], p[1]))[:top]
        out.append(TokenLogprob(float(chosen[r]), [(int(i), v - float(lse[r])) for v, i in pairs
                                                   if v != float("-inf")]))
    return out
