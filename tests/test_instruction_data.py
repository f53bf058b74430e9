"""`tensorpar train` on conversations: the summary counts what became of the examples, the sample is prompted in
the chat format; what it cannot train on is refused in one line before any rank starts."""

import json

import pytest

from tensorpar.models import get_config

import chat_data
from harness import run_cli


@pytest.fixture(scope="module")
def chat(tmp_path_factory):
    root = tmp_path_factory.mktemp("chat")
    model = root / "model.json"
    model.write_text(json.dumps(get_config("tiny").replace(hidden_size=32, ffn_hidden_size=64, num_layers=2,
                                                           vocab_size=chat_data.VOCAB).to_dict()))
    return dict(root=root, model=str(model), tokenizer=chat_data.write_tokenizer_folder(root / "llama3", "llama3"),
                data=chat_data.write_chat_jsonl(root / "chat.jsonl", 200))


def test_the_summary_counts_the_examples(pools, chat):
    code, out, err = pools(1).run(run_cli, [
        "train", "--model", chat["model"], "--tokenizer", chat["tokenizer"], "--data", chat["data"], "--steps", 2,
        "--seq-len", 96, "--global-batch-size", 4, "--long-examples", "drop", "--no-progress",
        "--out-dir", chat["root"] / "run", "--sample-tokens", 2, "--sample-prompt", "hi"])[0]
    assert code == 0, err
    line = next(line for line in out.splitlines() if line.startswith("examples:"))
    assert "200 conversations" in line and "left out as too long" in line and "packed into" in line
    # the sample's prompt is a user's message in the chat format, ready for the assistant's answer
    assert "<|start_header_id|>user<|end_header_id|>\\n\\nhi<|eot_id|><|start_header_id|>assistant" in out


@pytest.mark.parametrize("extra,message", [
    (["--val-data", "{data}"], "drop --val-data"),
    (["--data", "0.5 {data} 0.5 {root}/plain.txt"], "not a weighted mixture"),
    (["--data", "{root}/plain.txt", "--chat-template", "{root}/t.jinja"], "holds none"),
    (["--tokenizer", "{root}/bare"], "has none"),
    # a missing --data is named as missing, not judged by the rows it would hold
    (["--data", "{root}/missing.jsonl", "--prompt-field", "question"], "missing.jsonl' does not exist"),
    (["--data", "{root}/missing.jsonl", "--chat-template", "{root}/t.jinja"], "missing.jsonl' does not exist"),
])
def test_what_cannot_be_trained_is_refused_in_one_line(cli, chat, extra, message):
    (chat["root"] / "plain.txt").write_text("plain text\n")
    (chat["root"] / "t.jinja").write_text("{{ messages }}")
    bare = chat["root"] / "bare"
    bare.mkdir(exist_ok=True)
    (bare / "tokenizer.json").write_text(open(f"{chat['tokenizer']}/tokenizer.json").read())
    args = ["train", "--model", chat["model"], "--tokenizer", chat["tokenizer"], "--data", chat["data"], "--steps", 1]
    code, out, err = cli(*args, *[a.format(**chat) for a in extra])
    assert code != 0 and message in err and len(err.strip().splitlines()) == 1, err


def test_a_mix_toml_of_one_conversation_source_reads_that_source(chat, tmp_path):
    """A mix.toml naming one source is that source (a mixture of several is refused): its conversations were looked
    for in the .toml file itself and the run refused with "holds neither conversations nor ...". """
    from tensorpar.data import load_tokenizer
    from tensorpar.training import TrainOptions
    from tensorpar.training.instruction_data import build_instruction_data, check_instruction_data

    mix = tmp_path / "mix.toml"
    mix.write_text(f'[mixture]\n"{chat["data"]}" = 1.0\n')
    tokenizer = load_tokenizer(chat["tokenizer"])
    rows = {}
    for data in (chat["data"], str(mix)):
        o = TrainOptions(model=chat["model"], tokenizer=chat["tokenizer"], data=data, seq_len=96)
        assert check_instruction_data(o, tokenizer, chat_data.VOCAB) == "conversations"
        dataset, _ = build_instruction_data(o, tokenizer, chat_data.VOCAB)
        rows[data] = (dataset.num_train_rows, dataset.num_val_rows, dataset.stats["examples"])
    assert rows[chat["data"]] == rows[str(mix)] and rows[str(mix)][2] == 200
