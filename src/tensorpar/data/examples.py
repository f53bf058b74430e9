"""Instruction data: rows that are conversations or prompt/completion pairs, as token ids and what to learn.

A row of a JSONL / Parquet file or a `datasets` folder is

- a conversation: `messages` (the field `--messages-field` names), a list of {"role", "content", ...} in OpenAI's
  shape, rendered with the chat template (tensorpar.data.chat_template), with the row's `tools` (the functions'
  JSON schemas, as transformers' `apply_chat_template(tools=...)` and TRL take them) where it has them; the loss
  covers the assistant's turns (each with what the template closes it with), nothing else;
- a prompt/completion pair: two text fields (`--prompt-field`, `--completion-field`), tokenized apart and joined,
  the tokenizer's EOS after the completion; the loss covers the completion and that EOS.

A source's kind is read off its first row: a messages field makes it conversations, else prompt and completion
fields make it pairs, else it holds documents (pretraining: tensorpar.data.streams).
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import os
from collections.abc import Iterator

import numpy as np

from tensorpar.data.chat_template import ChatTemplate
from tensorpar.data.documents import check_surrogates, document_files, document_kind, pyarrow_modules
from tensorpar.errors import TensorparError

CHAT, PAIRS = "conversations", "prompt/completion pairs"


@dataclasses.dataclass(frozen=True)
class ExampleFields:
    """The field names of instruction rows."""

    messages: str = "messages"
    prompt: str = "prompt"
    completion: str = "completion"


@dataclasses.dataclass
class Examples:
    """Tokenized examples: `ids[i]` (int64) and `learn[i]` (bool: the loss covers the token) of each row."""

    kind: str
    ids: list[np.ndarray]
    learn: list[np.ndarray]


def read_records(path: str) -> Iterator[tuple[str, dict]]:
    """(where, record) of every row of a JSONL / Parquet file or folder or a `datasets` folder, in order."""
    for kind, file in document_files(path):
        yield from (_jsonl_records(file) if kind == "jsonl" else _arrow_records(kind, file))


def _jsonl_records(file: str) -> Iterator[tuple[str, dict]]:
    opener = gzip.open if file.endswith(".gz") else open
    with opener(file, "rb") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"'{file}' line {number}"
            try:
                record = json.loads(line.decode("utf-8"))
            except (UnicodeDecodeError, ValueError) as e:
                raise TensorparError(f"{where}: not a UTF-8 JSON object ({e})") from None
            if not isinstance(record, dict):
                raise TensorparError(f"{where}: a JSON {type(record).__name__}, not an object")
            check_surrogates(where, line, record)
            yield where, record


def _arrow_records(kind: str, file: str) -> Iterator[tuple[str, dict]]:
    pa, pq = pyarrow_modules(file)
    try:
        batches = (pq.ParquetFile(file).iter_batches() if kind == "parquet"
                   else iter(pa.ipc.open_stream(pa.memory_map(file, "r"))))
        row = 0
        for batch in batches:
            for record in batch.to_pylist():
                yield f"'{file}' row {row}", record
                row += 1
    except TensorparError:
        raise
    except Exception as e:  # noqa: BLE001 - pyarrow raises ArrowInvalid, OSError, ... for a bad file
        raise TensorparError(f"'{file}' cannot be read as {kind}: {e}") from None


def example_kind(path: str | None, fields: ExampleFields) -> str | None:
    """CHAT or PAIRS when `path` is a row source whose first row is one, else None (documents, token files)."""
    if path is None or not os.path.exists(path) or document_kind(path) is None:
        return None  # a missing source is reported where the data is opened
    try:
        _, first = next(read_records(path))
    except StopIteration:
        return None
    if fields.messages in first:
        return CHAT
    if fields.prompt in first and fields.completion in first:
        return PAIRS
    return None


def _messages(where: str, value) -> list[dict]:
    if not isinstance(value, list) or not value:
        raise TensorparError(f"{where}: the messages must be a non-empty list of {{role, content}} objects")
    for i, m in enumerate(value):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise TensorparError(f"{where}: message {i} is not an object with a 'role' (got {m!r:.80})")
    return value


def _text(where: str, record: dict, field: str) -> str:
    value = record.get(field)
    if not isinstance(value, str):
        raise TensorparError(f"{where}: field '{field}' holds {type(value).__name__}, not text (prompt/completion "
                             f"rows are text; a conversation goes in a messages field)")
    return value


def _tools(where: str, value) -> list | None:
    if value is None:
        return None
    if isinstance(value, str):  # datasets often keep the schemas as JSON text
        try:
            value = json.loads(value)
        except ValueError:
            pass
    if not isinstance(value, list) or not all(isinstance(t, dict) for t in value):
        raise TensorparError(f"{where}: 'tools' must be a list of JSON objects (the functions' schemas), got "
                             f"{value!r:.80}")
    return value


def tokenize_conversation(template: ChatTemplate, tokenizer, messages: list[dict],
                          tools: list | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(ids, learn) of a rendered conversation (with the functions `tools` describes): a token is learned when its
    characters overlap an assistant turn (what transformers' assistant mask marks)."""
    text, spans = template.render_with_spans(messages, tools)
    ids, offsets = tokenizer.encode_with_offsets(text)
    bounds = np.asarray(offsets, dtype=np.int64).reshape(-1, 2)
    learn = np.zeros(len(ids), dtype=bool)
    for start, end in spans:
        learn |= (bounds[:, 0] < end) & (bounds[:, 1] > start)
    return np.asarray(ids, dtype=np.int64), learn


def tokenize_pair(tokenizer, prompt: str, completion: str) -> tuple[np.ndarray, np.ndarray]:
    """(ids, learn) of a prompt and its completion, tokenized apart, the EOS after the completion."""
    if tokenizer.eos_id is None:
        raise TensorparError(f"prompt/completion rows end with the tokenizer's EOS and {tokenizer!r} names none: "
                             f"give a --tokenizer whose tokenizer_config.json names its eos_token")
    head, tail = tokenizer.encode(prompt), tokenizer.encode(completion) + [tokenizer.eos_id]
    learn = np.zeros(len(head) + len(tail), dtype=bool)
    learn[len(head):] = True
    return np.asarray(head + tail, dtype=np.int64), learn


def load_examples(path: str, tokenizer, fields: ExampleFields, template: ChatTemplate | None,
                  limit: int | None = None) -> Examples:
    """The tokenized examples of `path` (its first `limit` rows), whose kind `example_kind` says."""
    kind = example_kind(path, fields)
    if kind is None:
        raise TensorparError(f"'{path}' holds neither conversations (a '{fields.messages}' field) nor prompt/"
                             f"completion pairs ('{fields.prompt}' and '{fields.completion}' fields)")
    out = Examples(kind, [], [])
    for where, record in read_records(path):
        if limit is not None and len(out.ids) >= limit:
            break
        try:
            if kind == CHAT:
                ids, learn = tokenize_conversation(template, tokenizer, _messages(where, record.get(fields.messages)),
                                                   _tools(where, record.get("tools")))
            else:
                ids, learn = tokenize_pair(tokenizer, _text(where, record, fields.prompt),
                                           _text(where, record, fields.completion))
        except TensorparError as e:
            raise TensorparError(f"{where}: {e}" if not str(e).startswith(where) else str(e)) from None
        out.ids.append(ids)
        out.learn.append(learn)
    if not out.ids:
        raise TensorparError(f"'{path}' holds no rows")
    return out
