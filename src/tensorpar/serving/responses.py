"""The OpenAI API's answers: completions and chat completions, whole or as server-sent-event chunks, with log-probs
in each endpoint's format (completions: tokens / token_logprobs / top_logprobs / text_offset; chat: content[])."""

from __future__ import annotations

import dataclasses
import json
import time
import uuid

from tensorpar.data.tokenizer import CONTEXT_TOKENS, context_tokens, text_after
from tensorpar.serving.engine import ChoiceEvent, RequestDone
from tensorpar.serving.step_plan import TokenLogprob


def new_id(kind: str) -> str:
    return f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"


def sse(payload) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


def usage(done: RequestDone) -> dict:
    return {"prompt_tokens": done.prompt_tokens, "completion_tokens": done.completion_tokens,
            "total_tokens": done.prompt_tokens + done.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": done.cached_tokens}}


class TokenText:
    """The text of a token where it stands, after the tokens `before` it (log-prob entries name tokens by their
    text): `text_after`, so that a SentencePiece token's leading space shows as it does in the continuation's text;
    special tokens by their own text (the EOS as `</s>`, say), as vLLM names them."""

    def __init__(self, tokenizer):
        self.tokenizer, self._cache = tokenizer, {}

    def __call__(self, token: int, before: list[int] = ()) -> str:
        key = (context_tokens(before), token)
        if key not in self._cache:
            self._cache[key] = text_after(self.tokenizer, key[0], [token], skip_special_tokens=False)
        return self._cache[key]


def completion_logprobs(tokens: list[int], entries: list[TokenLogprob | None], text: TokenText, before: list[int],
                        offset: int = 0) -> tuple[dict, int]:
    """(the completions endpoint's log-probs of `tokens`, which follow the tokens `before` and start at character
    `offset` of the answer's text; the offset after them). An entry None: the first prompt token, which has none;
    the top alternatives include the token itself, as OpenAI's do."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    context = list(before)
    for token, entry in zip(tokens, entries):
        piece = text(token, context)
        out["tokens"].append(piece)
        out["text_offset"].append(offset)
        offset += len(piece)
        if entry is None:
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
        else:
            out["token_logprobs"].append(entry.logprob)
            top = {}
            for t, lp in entry.top:
                top.setdefault(text(t, context), lp)
            top.setdefault(piece, entry.logprob)
            out["top_logprobs"].append(top)
        context.append(token)
    return out, offset


def chat_logprobs(tokens: list[int], entries: list[TokenLogprob], text: TokenText, before: list[int]) -> dict:
    """The chat endpoint's log-probs of `tokens`, which follow the tokens `before`."""
    def one(token, lp, context):
        piece = text(token, context)
        return {"token": piece, "logprob": lp, "bytes": list(piece.encode("utf-8"))}

    context, content = list(before), []
    for token, e in zip(tokens, entries):
        content.append(dict(one(token, e.logprob, context), top_logprobs=[one(t, lp, context) for t, lp in e.top]))
        context.append(token)
    return {"content": content}


@dataclasses.dataclass
class ChoiceState:
    """One choice's answer so far."""

    index: int
    text: str = ""
    tokens: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[TokenLogprob] = dataclasses.field(default_factory=list)
    prompt_logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None
    logprobs_offset: int = 0  # where the next streamed log-prob entry's text starts in the answer's text

    def add(self, event: ChoiceEvent) -> None:
        self.text += event.text
        self.tokens += event.tokens
        self.logprobs += event.logprobs
        if event.prompt_logprobs is not None:
            self.prompt_logprobs = event.prompt_logprobs
        self.finish_reason = event.finish_reason or self.finish_reason


class Answer:
    """Builds one request's answer: `chunk(event)` for a stream, `whole(done)` at the end."""

    def __init__(self, kind: str, model: str, request, options: dict, tokenizer, prompt_texts: list[str]):
        self.kind, self.model, self.request, self.options = kind, model, request, options
        self.id, self.created = new_id(kind), int(time.time())
        self.text = TokenText(tokenizer)
        self.prompt_texts = prompt_texts
        n = request.n
        self.choices = [ChoiceState(i) for i in range(len(request.prompts) * n)]
        self.started: set[int] = set()

    def _head(self, chunk: bool) -> dict:
        obj = "chat.completion" + (".chunk" if chunk else "") if self.kind == "chat" else "text_completion"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def _prompt(self, index: int) -> list[int]:
        return self.request.prompts[index // self.request.n]

    def _echo(self, index: int) -> tuple[str, list[int], list]:
        """(text, tokens, log-prob entries) the choice starts with: its prompt when echoing."""
        if not self.options["echo"]:
            return "", [], []
        prompt = self._prompt(index)
        state = self.choices[index]
        entries = [None] + list(state.prompt_logprobs or [])
        return self.prompt_texts[index // self.request.n], prompt, entries[: len(prompt)]

    def _before(self, state: ChoiceState, tokens) -> list[int]:
        """The last tokens before `tokens`, the last of the choice's tokens so far (of its prompt and what came
        earlier): as many as `text_after` reads, not the whole sequence, copied at every streamed chunk."""
        end = len(state.tokens) - len(tokens)
        return self._prompt(state.index)[-CONTEXT_TOKENS:] + state.tokens[max(0, end - CONTEXT_TOKENS):end]

    def _completion_choice(self, state: ChoiceState, text: str, tokens, entries, first: bool) -> dict:
        logprobs = None
        if self.options["logprobs"]:
            head_text, head_tokens, head_entries = self._echo(state.index) if first else ("", [], [])
            before = [] if head_tokens else self._before(state, tokens)
            offset = 0 if first else state.logprobs_offset
            logprobs, state.logprobs_offset = completion_logprobs(head_tokens + tokens, head_entries + entries,
                                                                  self.text, before, offset)
            text = head_text + text
        elif first:
            text = self._echo(state.index)[0] + text
        return {"index": state.index, "text": text, "logprobs": logprobs, "finish_reason": state.finish_reason}

    def chunk(self, event: ChoiceEvent) -> list[str]:
        """The server-sent events for one engine event."""
        state = self.choices[event.index]
        state.add(event)
        first = event.index not in self.started
        self.started.add(event.index)
        if self.kind == "chat":
            out = []
            if first:
                delta = {"role": "assistant", "content": ""}
                out.append(sse({**self._head(True), "choices": [{"index": event.index, "delta": delta,
                                                                  "logprobs": None, "finish_reason": None}]}))
            if not (event.text or event.tokens or event.finish_reason):
                return out
            lp = (chat_logprobs(event.tokens, event.logprobs, self.text, self._before(state, event.tokens))
                  if self.options["logprobs"] else None)
            delta = {"content": event.text} if event.text or not event.finish_reason else {}
            choice = {"index": event.index, "delta": delta, "logprobs": lp, "finish_reason": event.finish_reason}
            return out + [sse({**self._head(True), "choices": [choice]})]
        if not (event.text or event.tokens or event.finish_reason or first):
            return []
        choice = self._completion_choice(state, event.text, event.tokens, event.logprobs, first)
        choice["finish_reason"] = event.finish_reason
        return [sse({**self._head(True), "choices": [choice]})]

    def end(self, done: RequestDone) -> list[str]:
        """The stream's last events: usage (if asked for), then [DONE]."""
        out = []
        if self.options["include_usage"]:
            out.append(sse({**self._head(True), "choices": [], "usage": usage(done)}))
        return out + [sse("[DONE]")]

    def whole(self, done: RequestDone) -> dict:
        """The whole answer (not streamed), once every choice has finished."""
        if self.kind == "chat":
            choices = [{"index": s.index, "message": {"role": "assistant", "content": s.text},
                        "logprobs": chat_logprobs(s.tokens, s.logprobs, self.text, self._prompt(s.index))
                        if self.options["logprobs"] else None, "finish_reason": s.finish_reason} for s in self.choices]
        else:
            choices = [self._completion_choice(s, s.text, s.tokens, s.logprobs, True) for s in self.choices]
        return {**self._head(False), "choices": choices, "usage": usage(done)}
