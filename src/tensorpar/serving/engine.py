"""The serving engine on rank 0: requests in, one model step at a time on every rank, tokens out.

The HTTP server's thread hands requests in (`submit`, `cancel`: a thread-safe inbox); the engine's loop, on rank 0's
main thread, takes them between steps, asks the scheduler for the next step, broadcasts its plan, runs it on every
rank (`run_step`), and turns each sequence's new token into text, stop checks and events for its request (`sink`, a
callable the HTTP side gives: it is called from the engine's thread). The other ranks run `follow` until rank 0
broadcasts the stop.
"""

from __future__ import annotations

import collections
import dataclasses
import queue
import random
import time
from typing import Callable

from tensorpar.functional.dropout import mix_seed
from tensorpar.serving.server_metrics import ServerMetrics
from tensorpar.serving.model_step import run_step
from tensorpar.serving.step_plan import ItemResult, Sampling, StepItem, StepPlan, TokenLogprob, share_plan
from tensorpar.serving.scheduler import QueueFull, Scheduler, Sequence
from tensorpar.serving.text import TextStream

HEARTBEAT_S = 2.0  # an idle rank 0 broadcasts an empty plan this often: far within any collective's timeout
IDLE_POLL_S = 0.1  # an idle rank 0 looks at its inbox and the drain flag this often


@dataclasses.dataclass
class EngineRequest:
    """A validated request: its prompts as token ids and what to generate (see `tensorpar.serving.protocol`)."""

    prompts: list[list[int]]
    max_tokens: int
    n: int = 1
    sampling: Sampling = Sampling()
    seed: int | None = None
    top_logprobs: int = -1  # -1: no log-probs; k: the token's and the k most likely
    prompt_logprobs: bool = False  # echo with log-probs: those of every prompt token after the first
    stop: tuple[str, ...] = ()
    eos_ids: frozenset[int] = frozenset()  # the tokens that end a continuation (the EOS, `stop_token_ids`)
    min_tokens: int = 0  # the tokens of `eos_ids` cannot be sampled before this many are generated
    sink: Callable | None = None  # called with each ChoiceEvent, then with a RequestDone
    arrived: float = dataclasses.field(default_factory=time.perf_counter)


@dataclasses.dataclass
class ChoiceEvent:
    """New output of one choice: text, token ids and their log-probs (and, once, the echoed prompt's)."""

    index: int
    text: str = ""
    tokens: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[TokenLogprob] = dataclasses.field(default_factory=list)
    prompt_logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None


@dataclasses.dataclass
class Accepted:
    """The request joined the queue (its first event; else a RequestDone with the error comes first)."""


@dataclasses.dataclass
class RequestDone:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0  # prompt tokens whose keys and values came from the prefix cache
    error: str | None = None  # the request could not be served (the message of a 429)
    status: int = 200


@dataclasses.dataclass(eq=False)
class _Choice:
    request: EngineRequest
    index: int
    seq: Sequence
    sampling: Sampling
    text: TextStream
    last_token_at: float | None = None
    prompt_logprobs: list[TokenLogprob] = dataclasses.field(default_factory=list)
    prompt_logprobs_sent: bool = False
    done: bool = False
    counts: collections.Counter = dataclasses.field(default_factory=collections.Counter)  # generated tokens

    def penalties(self) -> dict:
        """What the sample of this choice's next token needs to know of the tokens so far (`StepItem`)."""
        out = {}
        if self.sampling.penalized:
            out["output_counts"] = tuple(self.counts.items())
            if self.sampling.repetition_penalty != 1.0:
                out["prompt_tokens"] = tuple(sorted(set(self.seq.prompt)))
        if len(self.seq.generated) < self.request.min_tokens:
            out["banned"] = tuple(sorted(self.request.eos_ids))
        return out


class Engine:
    def __init__(self, model, pool, scheduler: Scheduler, tokenizer, world_group, *, context_len: int,
                 metrics: ServerMetrics | None = None, device=None):
        self.model, self.pool, self.scheduler, self.tokenizer = model, pool, scheduler, tokenizer
        self.world, self.device, self.context_len = world_group, device, context_len
        self.metrics = metrics or ServerMetrics()
        self.inbox: queue.Queue = queue.Queue()
        self.accepting = True  # False once draining
        self.closed = False  # True once the loop has stopped: a request submitted then is refused by submit itself
        self._choices: dict[int, _Choice] = {}
        self._requests: dict[int, list[_Choice]] = {}  # id(request) -> its choices
        self._next_seq = 0

    # -- the HTTP side (any thread) ---------------------------------------------------------------------------

    def submit(self, request: EngineRequest) -> None:
        self.inbox.put(("submit", request))
        if self.closed:  # it passed the `accepting` check before a drain, and came after the loop's last look
            self._refuse_inbox()

    def _refuse_inbox(self) -> None:
        """Answer 503 to every request still in the inbox (the loop, or a late `submit`, takes each once)."""
        while True:
            try:
                kind, request = self.inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "submit":
                request.sink(RequestDone(0, 0, error="the server is shutting down", status=503))

    def cancel(self, request: EngineRequest) -> None:
        """Drop a request whose client went away: its sequences leave the batch and free their blocks."""
        self.inbox.put(("cancel", request))

    def drain(self) -> None:
        """Refuse new requests, finish those in flight, then stop every rank (on SIGTERM). A signal handler may call
        it: it sets a flag, and takes no lock the interrupted loop could hold."""
        self.accepting = False

    def metrics_text(self) -> str:
        return self.metrics.render(self.scheduler)

    # -- the loop (rank 0's main thread) ----------------------------------------------------------------------

    def serve_forever(self) -> None:
        while True:
            self._take_inbox(wait=self.scheduler.idle and self.accepting)
            if not self.accepting and self.scheduler.idle:
                break
            chunks = self.scheduler.schedule()
            plan = StepPlan(tuple(self._item(seq, n) for seq, n in chunks))
            t0 = time.perf_counter()
            results = run_step(self.model, self.pool, share_plan(self.world, plan, self.device))
            self.scheduler.advance(chunks)
            for (seq, _), result in zip(chunks, results):
                self._after_step(self._choices[seq.seq_id], result)
            self.metrics.step(time.perf_counter() - t0, sum(n for _, n in chunks))
        self.closed = True
        self._refuse_inbox()
        share_plan(self.world, StepPlan(stop=True), self.device)

    def _take_inbox(self, wait: bool) -> None:
        """Take the requests and cancellations that came in; `wait` (idle): for one, up to the heartbeat."""
        deadline = time.monotonic() + HEARTBEAT_S
        while True:
            try:
                message = self.inbox.get(timeout=IDLE_POLL_S) if wait else self.inbox.get_nowait()
                break
            except queue.Empty:
                if not wait or not self.accepting:
                    return
                if time.monotonic() >= deadline:
                    share_plan(self.world, StepPlan(), self.device)  # the heartbeat
                    return
        while True:
            kind, request = message
            if kind == "submit":
                self._admit(request)
            else:
                self._drop(request, "cancelled")
            try:
                message = self.inbox.get_nowait()
            except queue.Empty:
                return

    def _admit(self, request: EngineRequest) -> None:
        base = request.seed if request.seed is not None else random.getrandbits(62)
        choices = []
        for p, prompt in enumerate(request.prompts):
            for i in range(request.n):
                seed = base if i == 0 else mix_seed(base, i)  # every prompt as if alone
                seq = Sequence(self._next_seq, list(prompt), request.max_tokens,
                               reuse_prefix=not request.prompt_logprobs)
                self._next_seq += 1
                choices.append(_Choice(request, p * request.n + i, seq,
                                       dataclasses.replace(request.sampling, seed=seed),
                                       TextStream(self.tokenizer, request.stop, prompt, request.min_tokens)))
        try:
            self.scheduler.add([c.seq for c in choices])
        except QueueFull as e:
            self.metrics.rejected()
            request.sink(RequestDone(0, 0, error=str(e), status=e.status))
            return
        self._requests[id(request)] = choices
        for c in choices:
            self._choices[c.seq.seq_id] = c
        self.metrics.admitted(sum(len(p) for p in request.prompts))
        request.sink(Accepted())
        for c in choices:
            if c.seq.max_tokens == 0 and not request.prompt_logprobs:  # nothing to compute
                self._finish(c, "length")

    def _drop(self, request: EngineRequest, reason: str) -> None:
        for c in self._requests.get(id(request), []):
            if not c.done:
                c.done = True
                self.scheduler.remove(c.seq)
                self._choices.pop(c.seq.seq_id, None)
        if self._requests.pop(id(request), None) is not None:
            self.metrics.finished(reason)

    # -- one sequence after a step ----------------------------------------------------------------------------

    def _item(self, seq: Sequence, n: int) -> StepItem:
        c = self._choices[seq.seq_id]
        start, end = seq.computed, seq.computed + n
        if start == 0 and not c.prompt_logprobs_sent:
            c.prompt_logprobs.clear()  # a preempted sequence recomputes them
        targets = ()
        if c.request.prompt_logprobs and len(c.prompt_logprobs) < len(seq.prompt) - 1 and start < len(seq.prompt):
            targets = tuple(seq.prompt[start + 1: min(end, len(seq.prompt) - 1) + 1])
        sample = end == seq.length and len(seq.generated) < seq.max_tokens
        return StepItem(tuple(seq.tokens[start:end]), start, tuple(self.scheduler.allocator.tables[seq.seq_id]),
                        targets, c.sampling if sample else None, len(seq.generated), c.request.top_logprobs,
                        seq.length, **(c.penalties() if sample else {}))

    def _after_step(self, c: _Choice, result: ItemResult) -> None:
        if c.done:
            return
        c.prompt_logprobs.extend(result.prompt_logprobs)
        event = ChoiceEvent(c.index)
        if c.request.prompt_logprobs and not c.prompt_logprobs_sent and len(c.prompt_logprobs) >= len(c.seq.prompt) - 1:
            event.prompt_logprobs, c.prompt_logprobs_sent = c.prompt_logprobs, True
        seq = c.seq
        if result.token is None:
            if c.prompt_logprobs_sent and seq.max_tokens == 0 and seq.computed == seq.length:
                self._finish(c, "length", event)
            elif event.prompt_logprobs is not None:
                c.request.sink(event)
            return
        now = time.perf_counter()
        self.metrics.token(now - (c.last_token_at or c.request.arrived), first=c.last_token_at is None)
        c.last_token_at = now
        seq.generated.append(result.token)
        c.counts[result.token] += 1
        event.tokens.append(result.token)
        if result.logprob is not None:
            event.logprobs.append(result.logprob)
        event.text, stopped = c.text.add(seq.generated)
        reason = "stop" if stopped or result.token in c.request.eos_ids else \
            "length" if len(seq.generated) >= seq.max_tokens or seq.length >= self.context_len else None
        if reason is not None:
            self._finish(c, reason, event)
        else:
            c.request.sink(event)

    def _finish(self, c: _Choice, reason: str, event: ChoiceEvent | None = None) -> None:
        event = event or ChoiceEvent(c.index)
        event.text += c.text.flush()
        event.finish_reason = reason
        c.done = True
        self.scheduler.remove(c.seq)
        self._choices.pop(c.seq.seq_id, None)
        c.request.sink(event)
        choices = self._requests.get(id(c.request), [])
        if all(x.done for x in choices):
            self._requests.pop(id(c.request), None)
            self.metrics.finished("completed")
            firsts = choices[::c.request.n]  # a prompt's tokens count once, as in prompt_tokens
            c.request.sink(RequestDone(sum(len(p) for p in c.request.prompts),
                                       sum(len(x.seq.generated) for x in choices),
                                       sum(x.seq.cached_tokens for x in firsts)))


def follow(model, pool, world_group, device=None) -> None:
    """The loop of every rank but 0: run each step rank 0 broadcasts, until it broadcasts the stop."""
    while True:
        plan = share_plan(world_group, None, device)
        if plan.stop:
            return
        run_step(model, pool, plan)
