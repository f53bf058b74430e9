"""A training run's instruction data: conversations or prompt/completion rows in --data, checked before any rank
starts and laid into rows by each rank (tensorpar.data.examples, tensorpar.data.example_dataset)."""

from __future__ import annotations

import os

from tensorpar.config.options import TrainOptions
from tensorpar.data import check_vocab, parse_data_spec
from tensorpar.data.batch import Batch
from tensorpar.data.chat_template import ChatTemplate
from tensorpar.data.example_dataset import ExampleDataset
from tensorpar.data.examples import CHAT, ExampleFields, example_kind, load_examples
from tensorpar.errors import TensorparError


def example_fields(o: TrainOptions) -> ExampleFields:
    return ExampleFields(o.messages_field, o.prompt_field, o.completion_field)


def instruction_kind(o: TrainOptions) -> str | None:
    """What instruction rows --data holds (conversations, prompt/completion pairs), or None for pretraining data.
    Refuses them in a mixture and beside --val-data."""
    sources = parse_data_spec(o.data)
    kinds = [example_kind(path, example_fields(o)) for _, path in sources]
    if len(sources) > 1 and any(kinds):
        raise TensorparError(f"--data '{o.data}': conversations and prompt/completion rows are read from one source "
                             f"(a file or folder), not a weighted mixture")
    kind = kinds[0]
    if kind is not None and o.val_data:
        raise TensorparError(f"--data '{o.data}' holds {kind}: their validation rows are its last --val-fraction; "
                             f"drop --val-data")
    if kind is None and o.chat_template:
        raise TensorparError(f"--chat-template renders conversations, and --data '{o.data}' holds none (no "
                             f"'{o.messages_field}' field in its first row)")
    return kind


def _template(o: TrainOptions, kind: str) -> ChatTemplate | None:
    if kind != CHAT:
        return None
    return ChatTemplate.load(o.tokenizer or o.init_from, o.chat_template)


def _source(o: TrainOptions) -> str:
    """The file or folder of instruction rows --data names (itself, or the one source of a mix.toml)."""
    return parse_data_spec(o.data)[0][1]


def check_instruction_data(o: TrainOptions, tokenizer, vocab_size: int) -> str | None:
    """What instruction rows --data holds (None: pretraining data); if any, its template and its first row are
    checked (rendered, tokenized, ids inside the vocabulary) here, once, before any rank starts."""
    kind = instruction_kind(o)
    if kind is None:
        return None
    examples = load_examples(_source(o), tokenizer, example_fields(o), _template(o, kind), limit=1)
    check_vocab(examples.ids[0], vocab_size, f"'{o.data}' (its first example, tokenized)")
    return kind


def build_instruction_data(o: TrainOptions, tokenizer, vocab_size: int) -> tuple[ExampleDataset, Batch | None] | None:
    """(the training rows, up to --val-windows validation rows or None) of instruction --data; None for
    pretraining data."""
    kind = instruction_kind(o)
    if kind is None:
        return None
    template = _template(o, kind)
    examples = load_examples(_source(o), tokenizer, example_fields(o), template)
    for ids in examples.ids:
        check_vocab(ids, vocab_size, f"'{os.path.basename(o.data)}' (tokenized)")
    pad = tokenizer.eos_id if getattr(tokenizer, "eos_id", None) is not None else 0
    dataset = ExampleDataset(examples, o.seq_len, o.example_packing, o.long_examples, o.val_fraction, pad, template)
    return dataset, dataset.val_batch(o.val_windows)
