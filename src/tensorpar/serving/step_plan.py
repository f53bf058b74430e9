"""What rank 0 sends every rank before each step, and how: a `StepPlan`, pickled, in two broadcasts.

A plan holds, for every sequence in the step, the tokens to feed, their first position, the block table, and what to
compute at the end: the next token (with the request's sampling parameters and its own step index), the log-probs of
the echoed prompt's tokens, the top alternatives. All ranks run the same model step on it; rank 0 alone keeps the
sequences, the block tables and the answers. An empty plan is a heartbeat (an idle server keeps the other ranks'
collectives within their timeout); `stop` ends the other ranks' loops.
"""

from __future__ import annotations

import dataclasses
import pickle

import torch


@dataclasses.dataclass(frozen=True)
class Sampling:
    """How one request picks its tokens: greedy, or a sample of softmax(logits / temperature) within top-k / top-p /
    min-p, drawn with noise seeded by (seed, the index of the token in its own continuation); either after the
    penalties on the tokens already seen (`tensorpar.inference.penalties`)."""

    greedy: bool = True
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0

    @property
    def penalized(self) -> bool:
        """Whether the tokens already seen change the logits."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0


@dataclasses.dataclass(frozen=True)
class StepItem:
    """One sequence's part of a step.

    `prompt_targets`: the next token of each of the chunk's first positions, whose log-probs are wanted (an echoed
    prompt); `sample`: sample the next token at the chunk's last position, the `step`-th of the continuation;
    `top_logprobs`: -1 for no log-probs, k >= 0 for the log-prob of every target and sampled token with the k most
    likely alternatives; `reach`: the span the sequence's RoPE sees (its length; `Segment.reach`); for the sample,
    where `sample.penalized`: `output_counts`, (token, times generated) of the continuation so far, and
    `prompt_tokens`, the prompt's distinct tokens (repetition_penalty's); `banned`: tokens it may not be (the EOS
    and stop tokens before `min_tokens`)."""

    tokens: tuple[int, ...]
    start: int
    blocks: tuple[int, ...]
    prompt_targets: tuple[int, ...] = ()
    sample: Sampling | None = None
    step: int = 0
    top_logprobs: int = -1
    reach: int | None = None
    output_counts: tuple[tuple[int, int], ...] = ()
    prompt_tokens: tuple[int, ...] = ()
    banned: tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True)
class StepPlan:
    items: tuple[StepItem, ...] = ()
    stop: bool = False


@dataclasses.dataclass
class TokenLogprob:
    """The log-prob of one token and the `top` most likely alternatives [(token id, log-prob)], most likely first."""

    logprob: float
    top: list[tuple[int, float]]


@dataclasses.dataclass
class ItemResult:
    token: int | None = None  # the sampled token
    logprob: TokenLogprob | None = None  # of the sampled token
    prompt_logprobs: list[TokenLogprob] = dataclasses.field(default_factory=list)  # of each prompt target


def share_plan(group, plan: StepPlan | None, device=None) -> StepPlan:
    """Broadcast rank 0's `plan` over `group` (the other ranks pass None): its length, then its pickled bytes."""
    if group.size == 1:
        return plan
    if group.rank == 0:
        payload = torch.frombuffer(bytearray(pickle.dumps(plan)), dtype=torch.uint8).to(device)
        group.broadcast(torch.tensor([payload.numel()], dtype=torch.long, device=device))
        group.broadcast(payload)
        return plan
    size = group.broadcast(torch.zeros(1, dtype=torch.long, device=device))
    payload = group.broadcast(torch.empty(int(size.item()), dtype=torch.uint8, device=device))
    return pickle.loads(payload.cpu().numpy().tobytes())
