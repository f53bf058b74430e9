"""A continuation's text as it grows: incremental detokenization and stop strings.

Each new token re-decodes the continuation after the prompt's last tokens (`text_after`: the tokenizer decides how
bytes join into characters, and whether a token's leading space shows where it stands) and releases the
text that can no longer change: it holds back an incomplete UTF-8 character (decoded as U+FFFD) and, when the
request has stop strings, the last len(longest stop) - 1 characters, which could be the start of one. A stop string
ends the continuation before it (OpenAI's rule: the stop string is not returned). Before `min_tokens` tokens none
does: as in vLLM, a stop string counts once it ends in the text of the min_tokens-th token or later.
"""

from __future__ import annotations

from tensorpar.data.tokenizer import context_tokens, text_after


class TextStream:
    """The text of a continuation of the tokens `before` (its prompt)."""

    def __init__(self, tokenizer, stop: tuple[str, ...] = (), before: list[int] = (), min_tokens: int = 0):
        self.tokenizer, self.stop = tokenizer, tuple(s for s in stop if s)
        self.before, self.min_tokens = context_tokens(before), min_tokens  # all the prompt text_after reads
        self.holdback = max((len(s) for s in self.stop), default=1) - 1
        self.text, self.sent = "", 0
        self.floor = 0  # a stop string must end past this character: the text before the min_tokens-th token

    def add(self, ids: list[int]) -> tuple[str, bool]:
        """(the text newly released, whether a stop string ended the continuation) after the tokens `ids`."""
        text = text_after(self.tokenizer, self.before, ids)
        if len(ids) < self.min_tokens:
            self.floor = len(text)
        found = [i for i in (text.find(s, max(0, self.floor - len(s) + 1)) for s in self.stop) if i >= 0]
        if found:
            self.text = text[: min(found)]
            return self.flush(), True
        self.text = text
        safe = len(text) - self.holdback
        while safe > self.sent and text[safe - 1] == "\ufffd":
            safe -= 1
        if safe <= self.sent:
            return "", False
        delta, self.sent = text[self.sent:safe], safe
        return delta, False

    def flush(self) -> str:
        """The rest of the text, at the end of the continuation."""
        delta, self.sent = self.text[self.sent:], max(self.sent, len(self.text))
        return delta
