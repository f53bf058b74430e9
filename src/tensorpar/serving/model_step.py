"""One step of the model on every rank: the plan's tokens through the paged cache, then tokens and log-probs."""

from __future__ import annotations

import torch

from tensorpar.serving.paged_cache import PagedKVPool, Segment
from tensorpar.serving.step_plan import ItemResult, StepPlan
from tensorpar.serving.sampling import sample_rows, token_logprobs


def _logit_rows(plan: StepPlan) -> tuple[list[int], list[tuple[int, int | None]]]:
    """(packed token index of every row that needs logits, (item, prompt target or None: sampled) per row)."""
    rows, owners, offset = [], [], 0
    for i, item in enumerate(plan.items):
        for j, target in enumerate(item.prompt_targets):
            rows.append(offset + j)
            owners.append((i, target))
        if item.sample is not None:
            rows.append(offset + len(item.tokens) - 1)
            owners.append((i, None))
        offset += len(item.tokens)
    return rows, owners


@torch.no_grad()
def run_step(model, pool: PagedKVPool, plan: StepPlan) -> list[ItemResult]:
    """Run `plan` (the same on every rank; collectives inside); the result of each item, the same on every rank."""
    results = [ItemResult() for _ in plan.items]
    if not plan.items:
        return results
    view = pool.step([Segment(item.start, len(item.tokens), item.blocks, item.reach) for item in plan.items])
    ids = torch.tensor([t for item in plan.items for t in item.tokens], device=pool.device)[None]
    h = model.cached_hidden(ids, view, view.positions)[0]
    rows, owners = _logit_rows(plan)
    if not rows:
        return results
    logits = model.logits(model.final_norm(h[torch.tensor(rows, device=h.device)]))  # [R, V_local]
    sampled = [r for r, (_, target) in enumerate(owners) if target is None]
    targets = [target if target is not None else 0 for _, target in owners]
    if sampled:
        items = [plan.items[owners[r][0]] for r in sampled]
        tokens = sample_rows(logits[torch.tensor(sampled, device=h.device)], model, [it.sample for it in items],
                             [it.step for it in items], items).tolist()
        for r, token in zip(sampled, tokens):
            results[owners[r][0]].token = token
            targets[r] = token
    wanted = [r for r, (i, _) in enumerate(owners) if plan.items[i].top_logprobs >= 0]
    if wanted:
        top = max(plan.items[owners[r][0]].top_logprobs for r in wanted)
        index = torch.tensor(wanted, device=h.device)
        found = token_logprobs(logits[index], model, torch.tensor(targets, device=h.device)[index], top)
        for r, lp in zip(wanted, found):
            i, target = owners[r]
            lp.top = lp.top[: plan.items[i].top_logprobs]
            if target is None:
                results[i].logprob = lp
            else:
                results[i].prompt_logprobs.append(lp)
    return results
