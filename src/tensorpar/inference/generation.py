"""Tensor-parallel generation with a KV cache sharded by heads: greedy, or sampled with temperature / top-k / top-p.

Every TP rank runs the same loop and ends with the same tokens; the logits stay vocabulary-sharded.

- Prefill: the prompts, left-padded to a common length, run once through `Transformer.forward_cached`,
  which fills the cache; then one token per step. Padding slots are never attended to and each
  row's positions start at 0, so a row's result does not depend on the rest of the batch.
- Greedy: every rank proposes its best (value, id); one all-gather of [B, 2]; ties -> lowest id.
- Sampling uses the Gumbel-max trick: the token is argmax(logits / T + g) with one Gumbel noise
  value g per vocabulary id, drawn from a generator seeded by (seed, step) for the whole vocabulary
  on every rank (each rank adds its slice). That is an exact sample of softmax(logits / T), found
  with the greedy all-gather; it is identical on every rank, deterministic for a seed, the same at
  every TP size, and the same for a prompt alone or in a batch (every row of a step shares the noise,
  so identical prompts in one batch get identical samples: vary the seed for variety).
- Top-k / top-p become a threshold on the logits (ties at the threshold are kept, as in transformers),
  found from candidates only: each rank's top-k values gathered; for top-p without top-k the exact
  softmax normaliser (one all-gather of a max and a sum per row) and each rank's top-C values, with C
  growing until the gathered candidates hold the nucleus. The full logits are never gathered unless
  the nucleus itself needs the whole vocabulary.
- LongRoPE (Phi-3) switches from its short to its long factors once a sequence passes its original length; as
  transformers' Phi-3 does, the step at which a row reaches it runs the whole sequence again (prefill of every row's
  tokens so far) instead of one token, so that the cached keys take the long factors too.
"""

from __future__ import annotations

import dataclasses
import numbers
import time

import torch

from tensorpar.errors import TensorparError
from tensorpar.functional.autocast import autocast_dtype
from tensorpar.functional.dropout import mix_seed
from tensorpar.inference.kv_cache import KVCache
from tensorpar.inference.penalties import Penalties, apply_penalties, min_p_threshold

TOP_P_FIRST_CANDIDATES = 64  # per rank; multiplied by 8 while the nucleus is not inside the candidates


def _gather_rows(group, t: torch.Tensor) -> torch.Tensor:
    """[B, ...] on every rank -> [tp, B, ...] in rank order."""
    return group.all_gather(t.unsqueeze(0), dim=0)


def tp_argmax_rows(local_logits: torch.Tensor, group) -> torch.Tensor:
    """Row-wise global argmax [B] of vocabulary-sharded logits [B, V_local] (ties -> lowest id), like `tp_argmax`."""
    value, index = local_logits.max(dim=-1)
    proposal = torch.stack([value.double(), (index + group.rank * local_logits.shape[-1]).double()], dim=-1)
    proposals = _gather_rows(group, proposal)  # [tp, B, 2]
    best = proposals[..., 0].max(dim=0).values
    ids = torch.where(proposals[..., 0] == best, proposals[..., 1], torch.full_like(proposals[..., 1], float("inf")))
    return ids.min(dim=0).values.long()


def _top_values(local: torch.Tensor, group, count: int) -> torch.Tensor:
    """The `count` largest values of every row over the whole vocabulary, descending [B, count]; all of them
    when `count` reaches the shard size. Gathers count values per rank and row, never the logits."""
    per_rank = min(count, local.shape[-1])
    union = _gather_rows(group, local.topk(per_rank, dim=-1).values)  # [tp, B, per_rank]
    union = union.permute(1, 0, 2).reshape(local.shape[0], -1)
    keep = union.shape[-1] if per_rank == local.shape[-1] else count
    return union.topk(keep, dim=-1).values


def _nucleus_threshold(values: torch.Tensor, probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """The smallest value kept by top-p, given descending candidate values and their probabilities [B, n]."""
    cum = probs.cumsum(dim=-1)
    last = (torch.isfinite(values).sum(dim=-1) - 1).clamp(min=0)
    m = torch.minimum((cum < top_p).sum(dim=-1), last)  # the token that crosses top_p is kept
    return values.gather(1, m[:, None])[:, 0]


def keep_threshold(local: torch.Tensor, group, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor | None:
    """Per row, the smallest logit that top-k then top-p keep (over the whole vocabulary), or None (keep all).

    `local` [B, V_local] are this rank's (temperature-scaled, padding-masked) logits; a collective."""
    threshold = None
    if top_k > 0:
        values = _top_values(local, group, top_k)  # [B, k]
        threshold = values[:, -1]
        if top_p < 1.0:  # transformers' order: top-p on the distribution renormalised over the top k
            threshold = _nucleus_threshold(values, torch.softmax(values.double(), dim=-1), top_p)
    elif top_p < 1.0:
        # Exact normaliser of the full softmax: each rank's max and sum of exp, one all-gather.
        m = local.max(dim=-1).values.double()
        s = torch.where(torch.isfinite(m), (local.double() - m[:, None]).exp().sum(dim=-1), torch.zeros_like(m))
        stats = _gather_rows(group, torch.stack([m, s], dim=-1))  # [tp, B, 2]
        top = stats[..., 0].max(dim=0).values
        z = (stats[..., 1] * (stats[..., 0] - top).exp()).sum(dim=0)
        count = TOP_P_FIRST_CANDIDATES
        while True:  # every rank sees the same candidates, so all take the same branch
            values = _top_values(local, group, count)
            probs = (values.double() - top[:, None]).exp() / z[:, None]
            if bool((probs.sum(dim=-1) >= top_p).all()) or count >= local.shape[-1]:
                break
            count *= 8
        threshold = _nucleus_threshold(values, probs, top_p)
    return threshold


def gumbel_noise(vocab_size: int, padded_local: int, rank: int, seed: int, step: int, device) -> torch.Tensor:
    """This rank's slice [V_local] of the Gumbel noise for the whole vocabulary at `step` (0 on padding)."""
    generator = torch.Generator(device=device).manual_seed(mix_seed(seed, step))
    u = torch.rand(vocab_size, generator=generator, device=device, dtype=torch.float64)
    noise = -torch.log(-torch.log(u.clamp(min=1e-300)))
    start = rank * padded_local
    out = torch.zeros(padded_local, dtype=torch.float64, device=device)
    part = noise[start:start + padded_local]
    out[: part.numel()] = part
    return out


def select_tokens(local_logits: torch.Tensor, model, *, greedy: bool = True, temperature: float = 1.0,
                  top_k: int = 0, top_p: float = 1.0, seed: int = 0, step: int = 0, min_p: float = 0.0,
                  penalties: list[Penalties] | None = None) -> torch.Tensor:
    """The next token of every row [B] from vocabulary-sharded logits [B, V_local], row r penalized as
    `penalties[r]` asks (`tensorpar.inference.penalties`); the same on every TP rank."""
    group = model.tp_group
    local = model.mask_padding(local_logits.float())
    if penalties is not None and any(p.active for p in penalties):
        local = local.double()
        apply_penalties(local, penalties, group.rank * local.shape[-1])
    if greedy:
        return tp_argmax_rows(local, group)
    local = local.double() / temperature
    threshold = keep_threshold(local, group, top_k, top_p)
    if min_p > 0.0:
        floor = min_p_threshold(local, group, min_p)
        threshold = floor if threshold is None else torch.maximum(threshold, floor)
    if threshold is not None:
        local = local.masked_fill(local < threshold[:, None], float("-inf"))
    noise = gumbel_noise(model.cfg.vocab_size, local.shape[-1], group.rank, seed, step, local.device)
    return tp_argmax_rows(local + noise, group)


MIN_TEMPERATURE = 1e-5  # the logits divided by less overflow; the server samples below it greedily, as vLLM does


def check_generate_args(prompts, max_new_tokens: int, vocab_size: int, max_positions: int | None = None, *,
                        temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0,
                        repetition_penalty: float = 1.0, presence_penalty: float = 0.0,
                        frequency_penalty: float = 0.0) -> None:
    """Raise TensorparError (one line) for input that generation cannot take."""
    if not isinstance(prompts, (list, tuple)):
        hint = " (pass ids.tolist())" if hasattr(prompts, "tolist") else ""
        raise TensorparError(f"prompts must be a list of prompts, each a list of token ids such as [[1, 2, 3]]; got "
                             f"{type(prompts).__name__}{hint}")
    if not prompts:
        raise TensorparError("no prompts given")
    if max_new_tokens < 0:
        raise TensorparError(f"max-new-tokens must be >= 0, got {max_new_tokens}")
    if not (temperature >= MIN_TEMPERATURE and temperature != float("inf")):
        raise TensorparError(f"temperature must be a number of at least {MIN_TEMPERATURE:g}, got {temperature} (use "
                             f"greedy decoding for 0)")
    if top_k < 0:
        raise TensorparError(f"top-k must be >= 0 (0: off), got {top_k}")
    if not (0 < top_p <= 1):
        raise TensorparError(f"top-p must be in (0, 1], got {top_p}")
    if not 0 <= min_p <= 1:
        raise TensorparError(f"min-p must be in [0, 1], got {min_p}")
    if not (0 < repetition_penalty < float("inf")):
        raise TensorparError(f"repetition-penalty must be a positive number (1: none), got {repetition_penalty}")
    for name, value in (("presence-penalty", presence_penalty), ("frequency-penalty", frequency_penalty)):
        if not -2 <= value <= 2:
            raise TensorparError(f"{name} must be in [-2, 2], got {value}")
    _check_prompts(prompts, vocab_size)
    longest = max(len(p) for p in prompts)
    if max_positions is not None and longest + max_new_tokens - 1 > max_positions:
        raise TensorparError(f"prompt length {longest} + {max_new_tokens} new tokens exceeds the model's "
                             f"{max_positions} learned positions")


def _check_prompts(prompts, vocab_size: int) -> None:
    for i, prompt in enumerate(prompts):
        if not isinstance(prompt, (list, tuple)):
            hint = "pass ids.tolist()" if hasattr(prompt, "tolist") else "one prompt [1, 2, 3] is passed as [[1, 2, 3]]"
            raise TensorparError(f"prompt {i} is {type(prompt).__name__} {str(prompt)[:40]}, not a list of token ids: "
                                 f"prompts is a list of prompts ({hint})")
        if len(prompt) == 0:
            raise TensorparError(f"prompt {i} is empty: generation needs at least one token")
        if not all(isinstance(t, numbers.Integral) and not isinstance(t, bool) for t in prompt):
            raise TensorparError(f"prompt {i} holds other values than integer token ids: {list(prompt)[:5]}")
        bad = [t for t in prompt if not 0 <= t < vocab_size]
        if bad:
            raise TensorparError(f"prompt {i} has token ids outside the vocabulary [0, {vocab_size}): {bad[:5]}")


class _Batch:
    """The prompts left-padded into one batch, the token ids so far and their KV cache."""

    def __init__(self, model, prompts: list[list[int]], max_new_tokens: int):
        param = next(model.parameters())
        self.model, self.dtype = model, autocast_dtype(param)
        width = max(len(p) for p in prompts)
        self.pad = [width - len(p) for p in prompts]
        self.ids = torch.tensor([[0] * p + [int(t) for t in prompt] for p, prompt in zip(self.pad, prompts)],
                                device=param.device)
        self.max_len = width + max_new_tokens - 1
        self.switch = model.rope_switch_length()  # the position at which the cache is computed again, or None

    def prefill(self) -> torch.Tensor:
        """Every row's sequence so far through a new cache: the logits of its last position."""
        self.cache = KVCache.for_model(self.model, len(self.pad), self.max_len, dtype=self.dtype, pad=self.pad)
        return self.model.forward_cached(self.ids, self.cache)

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """The logits after each row's new token (`tokens` [B]); when a row reaches longrope's long factors, every
        row's sequence again, from the start."""
        self.ids = torch.cat([self.ids, tokens[:, None]], dim=1)
        if self.switch is not None and bool((torch.as_tensor(self.cache.start_positions()) == self.switch).any()):
            return self.prefill()
        return self.model.forward_cached(tokens[:, None], self.cache)


def _penalties(prompts, presence: float, frequency: float, repetition: float) -> list[Penalties]:
    """Each prompt's penalties before its first new token."""
    return [Penalties(presence, frequency, repetition,
                      prompt_tokens=tuple(sorted(set(map(int, p)))) if repetition != 1.0 else ()) for p in prompts]


def _seen_one_more(p: Penalties, token: int) -> Penalties:
    counts = dict(p.output_counts)
    counts[token] = counts.get(token, 0) + 1
    return dataclasses.replace(p, output_counts=tuple(counts.items()))


@torch.no_grad()
def generate(model, prompts: list[list[int]], max_new_tokens: int, *, greedy: bool = True, temperature: float = 1.0,
             top_k: int = 0, top_p: float = 1.0, seed: int = 0, min_p: float = 0.0, repetition_penalty: float = 1.0,
             presence_penalty: float = 0.0, frequency_penalty: float = 0.0, eos_id=None, stats: dict | None = None,
             replica_group=None) -> list[list[int]]:
    """The new token ids of every prompt (not the prompt), stopping a row after an `eos_id` (an int or several;
    the EOS token is included) or after `max_new_tokens`. Call on every TP rank: all get the same result. The
    penalties look at each row's tokens so far (`tensorpar.inference.penalties`: as `tensorpar serve` applies them).

    `stats`, if given, receives new_tokens, seconds, prefill_seconds and tokens_per_s (new tokens of all rows
    per second, prefill included). Under torch.autocast the cache takes the autocast dtype.

    `replica_group`: ranks running the same prompts as replicas of the TP group (whose expert-parallel all-to-alls
    span them); each step they take the tokens of its first rank (a broadcast), so that rounding differences
    between replicas can never make them pick different tokens or stop at different steps."""
    cfg = model.cfg
    check_generate_args(prompts, max_new_tokens, cfg.vocab_size,
                        cfg.max_seq_len if cfg.position == "learned" else None,
                        temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                        repetition_penalty=repetition_penalty, presence_penalty=presence_penalty,
                        frequency_penalty=frequency_penalty)
    top_k = min(top_k, cfg.vocab_size)
    seen = _penalties(prompts, presence_penalty, frequency_penalty, repetition_penalty)
    penalized = seen[0].active
    eos = set() if eos_id is None else {int(eos_id)} if isinstance(eos_id, int) else {int(e) for e in eos_id}
    new: list[list[int]] = [[] for _ in prompts]
    if max_new_tokens == 0:
        return new
    batch = _Batch(model, prompts, max_new_tokens)
    sampling = dict(greedy=greedy, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, min_p=min_p)

    was_training = model.training
    model.eval()
    try:
        t0 = time.perf_counter()
        logits = batch.prefill()
        done = [False] * len(prompts)
        prefill_s = None
        for step in range(max_new_tokens):
            tokens = select_tokens(logits, model, step=step, penalties=seen if penalized else None, **sampling)
            if replica_group is not None:
                replica_group.broadcast(tokens)
            for row, token in enumerate(tokens.tolist()):  # .tolist() waits for the device
                if not done[row]:
                    new[row].append(token)
                    done[row] = token in eos
                    if penalized:
                        seen[row] = _seen_one_more(seen[row], token)
            if prefill_s is None:
                prefill_s = time.perf_counter() - t0
            if all(done) or step == max_new_tokens - 1:
                break
            logits = batch.step(tokens)  # finished rows run on, ignored
        seconds = time.perf_counter() - t0
    finally:
        model.train(was_training)
    if stats is not None:
        count = sum(len(n) for n in new)
        stats.update(new_tokens=count, seconds=seconds, prefill_seconds=prefill_s,
                     tokens_per_s=count / seconds if seconds > 0 else float("inf"))
    return new
