"""Chat templates: rendered exactly as transformers renders them (text and token ids) from the same local tokenizer
folder, and the loss covers exactly the assistant's turns, token by token."""

import json

import pytest

from tensorpar.data import HFTokenizer
from tensorpar.data.chat_template import ChatTemplate
from tensorpar.data.examples import CHAT, PAIRS, ExampleFields, example_kind, load_examples, tokenize_conversation
from tensorpar.errors import TensorparError

import chat_data

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("tokenizers")
    return {style: chat_data.write_tokenizer_folder(root / style, style) for style in chat_data.STYLES}


CONVERSATIONS = chat_data.conversations(40, seed=1) + [
    [{"role": "user", "content": "  padded  "}, {"role": "assistant", "content": "ünïcödé 🙂 answer\n"}],
    [{"role": "system", "content": "s"}, {"role": "user", "content": "q"},
     {"role": "assistant", "content": "a", "tool_calls": None}],  # a null key is dropped, as transformers does
    [{"role": "assistant", "content": " Hello, what shall I add?"}, {"role": "user", "content": "2 and 3"},
     {"role": "assistant", "content": "5"}],  # opens with the assistant: no messages before it to render
]


@pytest.mark.parametrize("style", ["llama3", "qwen"])
def test_the_rendered_text_and_ids_equal_transformers_apply_chat_template(folders, style):
    hf = transformers.AutoTokenizer.from_pretrained(folders[style])
    template, tokenizer = ChatTemplate.load(folders[style]), HFTokenizer(folders[style])
    for conversation in CONVERSATIONS:
        for prompt in (False, True):
            assert template.render(conversation, prompt) == hf.apply_chat_template(
                conversation, tokenize=False, add_generation_prompt=prompt)
        ids, _ = tokenize_conversation(template, tokenizer, conversation)
        expected = hf.apply_chat_template(conversation, tokenize=True)
        assert ids.tolist() == list(getattr(expected, "input_ids", None) or expected)


# What each assistant turn is in the rendered text: its content and what the template closes the turn with.
TURN = {"llama3": lambda content: content.strip() + "<|eot_id|>", "qwen": lambda content: content + "<|im_end|>\n",
        "marked": lambda content: content + "<|im_end|>"}


@pytest.mark.parametrize("style", ["llama3", "qwen", "marked"])
def test_the_loss_covers_exactly_the_assistant_turns(folders, style):
    """Token by token: the learned tokens are exactly those that overlap an assistant turn of the rendered text
    (found here independently, by searching for each turn after the previous one), and together they spell the
    turns: each answer and its end-of-turn token, nothing of the system or user messages."""
    template, tokenizer = ChatTemplate.load(folders[style]), HFTokenizer(folders[style])
    for conversation in CONVERSATIONS:
        text = template.render(conversation)
        ids, learn = tokenize_conversation(template, tokenizer, conversation)
        spans, start = [], 0
        for message in conversation:
            if message["role"] == "assistant":
                start = text.index(TURN[style](message["content"]), start)
                spans.append((start, start + len(TURN[style](message["content"]))))
                start = spans[-1][1]
        _, offsets = tokenizer.encode_with_offsets(text)
        expected = [any(a < e and b > s for s, e in spans) for a, b in offsets]
        assert learn.tolist() == expected
        learned = tokenizer._tok.decode(ids[learn].tolist(), skip_special_tokens=False)
        assert learned == "".join(TURN[style](m["content"]) for m in conversation if m["role"] == "assistant")


def test_generation_markers_give_transformers_assistant_mask(folders):
    hf = transformers.AutoTokenizer.from_pretrained(folders["marked"])
    template, tokenizer = ChatTemplate.load(folders["marked"]), HFTokenizer(folders["marked"])
    assert template.marked
    for conversation in CONVERSATIONS:
        out = hf.apply_chat_template(conversation, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        ids, learn = tokenize_conversation(template, tokenizer, conversation)
        assert ids.tolist() == list(out["input_ids"]) and learn.astype(int).tolist() == list(out["assistant_masks"])


def test_a_template_that_rewrites_earlier_turns_is_refused(folders, tmp_path):
    """Without generation markers the turns are found by rendering prefixes; a template that renders the last
    assistant turn unlike the others (so a prefix is not a prefix of the whole) is refused, naming the way out."""
    rewriting = tmp_path / "rewrites.jinja"
    rewriting.write_text("{% for m in messages %}{% if m['role'] == 'assistant' and not loop.last %}[old]"
                         "{% else %}<{{ m['role'] }}>{{ m['content'] }}{% endif %}{% endfor %}"
                         "{% if add_generation_prompt %}<assistant>{% endif %}")
    template = ChatTemplate.load(folders["qwen"], str(rewriting))
    messages = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                {"role": "user", "content": "c"}, {"role": "assistant", "content": "d"}]
    with pytest.raises(TensorparError, match=r"message 1 \(assistant\).*generation %\}"):
        template.render_with_spans(messages)


def test_a_missing_template_and_bad_rows_are_refused_in_one_line(folders, tmp_path):
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "tokenizer.json").write_text(open(f"{folders['qwen']}/tokenizer.json").read())
    with pytest.raises(TensorparError, match="has none.*--chat-template FILE"):
        ChatTemplate.load(str(bare))
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"messages": [{"role": "user", "content": "x"}]}) + "\n"
                    + json.dumps({"messages": "not a list"}) + "\n")
    tokenizer = HFTokenizer(folders["qwen"])
    with pytest.raises(TensorparError, match=r"rows.jsonl' line 2: the messages must be a non-empty list"):
        load_examples(str(rows), tokenizer, ExampleFields(), ChatTemplate.load(folders["qwen"]))


def test_prompt_completion_rows_learn_the_completion_and_eos(folders, tmp_path):
    rows = tmp_path / "pairs.jsonl"
    rows.write_text(json.dumps({"question": "2 plus 2?", "answer": " 4"}) + "\n")
    fields = ExampleFields(prompt="question", completion="answer")
    assert example_kind(str(rows), fields) == PAIRS and example_kind(str(rows), ExampleFields()) is None
    tokenizer = HFTokenizer(folders["qwen"])
    examples = load_examples(str(rows), tokenizer, fields, None)
    ids, learn = examples.ids[0], examples.learn[0]
    prompt = tokenizer.encode("2 plus 2?")
    assert ids.tolist() == prompt + tokenizer.encode(" 4") + [tokenizer.eos_id]
    assert learn.tolist() == [False] * len(prompt) + [True] * (len(ids) - len(prompt))
    assert example_kind(chat_data.write_chat_jsonl(tmp_path / "c.jsonl", 2), ExampleFields()) == CHAT


def test_a_checkpoint_root_gives_its_latest_steps_template(folders, tmp_path):
    """`train --init-from CKPT` and `serve --checkpoint CKPT` on a run's --save folder: the tokenizer files (and the
    chat template) are in its step folders, not at its root."""
    root = tmp_path / "ckpt"
    step = root / "step-000010"
    step.mkdir(parents=True)
    (root / "latest").write_text("step-000010")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (step / name).write_text(open(f"{folders['qwen']}/{name}").read())
    conversation = CONVERSATIONS[0]
    expected = ChatTemplate.load(folders["qwen"]).render(conversation, True)
    assert ChatTemplate.load(str(root)).render(conversation, True) == expected
    assert ChatTemplate.of_folder(str(root)).render(conversation, True) == expected


def test_a_template_that_fails_with_a_python_error_is_refused_in_one_line(folders, tmp_path):
    """A template error other than Jinja's own (a TypeError: a message's content that is not text, say) names the
    row and the template, as raise_exception's message does, instead of a traceback."""
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}{{ m['role'] + m['content'] }}{% endfor %}")
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]})
                    + "\n" + json.dumps({"messages": [{"role": "user", "content": 5}]}) + "\n")
    with pytest.raises(TensorparError, match=r"rows.jsonl' line 2: chat template of .*t.jinja'.*TypeError"):
        load_examples(str(rows), HFTokenizer(folders["qwen"]), ExampleFields(),
                      ChatTemplate.load(folders["qwen"], str(template)))


@pytest.mark.parametrize("modern", [False, True], ids=["legacy", "added_tokens_decoder"])
def test_special_tokens_come_from_special_tokens_map_as_transformers_reads_them(folders, tmp_path, modern):
    """A folder saved before transformers 4.34 keeps its special tokens in special_tokens_map.json, which
    transformers reads when tokenizer_config.json has no added_tokens_decoder (and ignores otherwise): the
    template's eos_token and the tokenizer's EOS id follow it."""
    folder = tmp_path / "legacy"
    folder.mkdir()
    (folder / "tokenizer.json").write_text(open(f"{folders['qwen']}/tokenizer.json").read())
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": "{% for m in messages %}{{ m['role'] }}: "
              "{{ m['content'] }}{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}\n{% endfor %}"}
    if modern:
        config["added_tokens_decoder"] = {}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    (folder / "special_tokens_map.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    hf = transformers.AutoTokenizer.from_pretrained(str(folder))
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    assert ChatTemplate.load(str(folder)).render(messages) == hf.apply_chat_template(messages, tokenize=False)
    assert HFTokenizer(str(folder)).eos_id == (hf.eos_token_id if not modern else 0)  # else <|endoftext|>'s
    assert ("a<|im_end|>" in ChatTemplate.load(str(folder)).render(messages)) != modern


TOOLS = [{"type": "function", "function": {"name": "add", "description": "Add two numbers",
                                           "parameters": {"type": "object", "properties": {"a": {"type": "number"}}}}}]
TOOL_CHAT = [{"role": "user", "content": "2 and 3?"},
             {"role": "assistant", "content": "", "tool_calls": [
                 {"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}]},
             {"role": "tool", "content": "5"}, {"role": "assistant", "content": "It is 5."}]


def test_a_rows_tools_reach_the_template_as_transformers_passes_them(folders, tmp_path):
    """A row's `tools` (the functions' schemas, as a list or as JSON text) render as apply_chat_template(tools=...)
    renders them, and the loss still covers exactly the assistant's turns."""
    hf = transformers.AutoTokenizer.from_pretrained(folders["qwen"])
    template, tokenizer = ChatTemplate.load(folders["qwen"]), HFTokenizer(folders["qwen"])
    path = tmp_path / "tools.jsonl"
    path.write_text("".join(json.dumps({"messages": TOOL_CHAT, "tools": t}) + "\n" for t in (TOOLS, json.dumps(TOOLS))))
    examples = load_examples(str(path), tokenizer, ExampleFields(), template)
    expected = hf.apply_chat_template(TOOL_CHAT, tools=TOOLS, tokenize=True)
    assert "# Tools" in template.render(TOOL_CHAT, tools=TOOLS)
    for ids, learn in zip(examples.ids, examples.learn):
        assert ids.tolist() == list(getattr(expected, "input_ids", None) or expected)
        learned = tokenizer._tok.decode(ids[learn].tolist(), skip_special_tokens=False)
        assert learned.endswith("</tool_call><|im_end|>\nIt is 5.<|im_end|>\n") and "Tools" not in learned
    path.write_text(json.dumps({"messages": TOOL_CHAT, "tools": {"name": "add"}}) + "\n")
    with pytest.raises(TensorparError, match="line 1: 'tools' must be a list of JSON objects"):
        load_examples(str(path), tokenizer, ExampleFields(), template)
