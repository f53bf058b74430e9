"""A model without its tokenizer is not given the byte one: a run on token ids (.npy, .bin, a Megatron dataset)
without --tokenizer, for a vocabulary that is not the byte tokenizer's, records its tokenizer as unknown (as does a
Hugging Face folder without tokenizer.json); what would read text as bytes is refused, naming why. In process (the
`cli` fixture): one rank, tiny models."""

import json
import os

import numpy as np
import pytest

from tensorpar.data.tokenizer_files import byte_tokenizer_json


@pytest.fixture
def files(tmp_path):
    from tensorpar.models import get_config

    (tmp_path / "model.json").write_text(json.dumps(get_config("tiny").replace(vocab_size=512, num_layers=1).to_dict()))
    np.save(tmp_path / "ids.npy", (np.arange(4000) * 7 % 512).astype(np.uint16))
    (tmp_path / "text.txt").write_text("some text " * 400)
    return tmp_path


def train_args(root, *flags):
    return ["train", "--model", root / "model.json", "--steps", "1", "--seq-len", "16", "--global-batch-size", "2",
            "--no-progress", "--out-dir", root / "run", *flags]


def recorded(checkpoint) -> str | dict:
    """What the latest step of `checkpoint` says its tokenizer is."""
    step = (checkpoint / "latest").read_text().strip()
    return json.loads((checkpoint / step / "meta.json").read_text())["tokenizer"]


def test_a_run_on_token_ids_without_their_tokenizer_records_none(tmp_path, cli):
    """.npy ids for a vocabulary of 512 and no --tokenizer: the run's checkpoint says its tokenizer is unknown, its
    export carries none, and what would read text as bytes (a sample, the documents' EOS, a text prompt, text to
    evaluate) is refused naming why."""
    import numpy as np

    from tensorpar.models import get_config

    model = tmp_path / "model.json"
    model.write_text(json.dumps(get_config("tiny").replace(vocab_size=512, num_layers=1).to_dict()))
    np.save(tmp_path / "ids.npy", (np.arange(4000) * 7 % 512).astype(np.uint16))
    (tmp_path / "text.txt").write_text("some text " * 50)
    train = ["train", "--model", model, "--data", tmp_path / "ids.npy", "--steps", "1", "--seq-len", "16",
             "--global-batch-size", "2", "--no-progress", "--out-dir", tmp_path / "run"]
    code, _, err = cli(*train, "--save", tmp_path / "ckpt")
    assert code == 0, err
    assert json.loads((tmp_path / "ckpt" / "step-000001" / "meta.json").read_text())["tokenizer"] == "unknown"
    code, out, err = cli("convert", tmp_path / "ckpt", tmp_path / "hf")
    assert code == 0 and "no tokenizer" in out and not (tmp_path / "hf" / "tokenizer.json").exists(), err
    refusals = {
        ("--sample-tokens", "4"): "--sample-tokens 4 needs the tokenizer that made the token ids of --data",
        ("--document-mask",): "--document-mask needs the tokenizer that made the token ids of --data",
    }
    for flags, needle in refusals.items():
        code, _, err = cli(*train, *flags)
        assert code == 2 and needle in err and "give it with --tokenizer" in err, err
    for folder in ("ckpt", "hf"):
        code, _, err = cli("generate", "--checkpoint", tmp_path / folder, "--prompt", "Hello", "--max-new-tokens", "2")
        assert code == 2 and "would be tokenized as bytes" in err and "give --prompt-ids" in err, err
        code, _, err = cli("eval", "--checkpoint", tmp_path / folder, "--data", tmp_path / "text.txt", "--seq-len", "8")
        assert code == 2 and "would be tokenized as bytes" in err and "give --data token ids" in err, err
    code, out, err = cli("eval", "--checkpoint", tmp_path / "ckpt", "--data", tmp_path / "ids.npy", "--seq-len", "16")
    assert code == 0 and json.loads(out.strip().splitlines()[-1])["tokens"] > 0, err
    generate = ["generate", "--checkpoint", tmp_path / "ckpt", "--prompt-ids", "1,2", "--max-new-tokens", "3"]
    code, out, err = cli(*generate, "--json")
    line = json.loads(out.strip().splitlines()[-1])
    assert code == 0 and len(line["ids"]) == 3 and line["text"] is None, (out, err)  # ids without a text
    code, out, err = cli(*generate)
    assert code == 0 and out.strip() == ",".join(map(str, line["ids"])), (out, err)


def test_only_the_training_data_decides(files, cli):
    """Text validation data beside training ids: the weights learnt ids of an unknown tokenizer all the same."""
    code, _, err = cli(*train_args(files, "--data", files / "ids.npy", "--val-data", files / "text.txt",
                                   "--save", files / "ckpt"))
    assert code == 0 and recorded(files / "ckpt") == "unknown", err


def test_text_from_a_model_without_its_tokenizer_is_refused_and_a_resumed_run_keeps_its_tokenizer(files, cli):
    """--init-from a checkpoint whose tokenizer is unknown, on text: refused (as eval is). A run that took its
    tokenizer from --init-from keeps it when resumed (it took the byte tokenizer, and said "unknown")."""
    code, _, err = cli(*train_args(files, "--data", files / "ids.npy", "--save", files / "unknown"))
    assert code == 0 and recorded(files / "unknown") == "unknown", err
    base = ["train", "--seq-len", "16", "--global-batch-size", "2", "--no-progress", "--out-dir", files / "run2"]
    code, _, err = cli(*base, "--init-from", files / "unknown", "--data", files / "text.txt", "--steps", "1")
    assert code == 2 and "tokenized as bytes" in err and "or that tokenizer with --tokenizer" in err, err

    tokenizer = files / "tok" / "tokenizer.json"
    tokenizer.parent.mkdir()
    tokenizer.write_text(byte_tokenizer_json())
    code, _, err = cli(*train_args(files, "--data", files / "ids.npy", "--tokenizer", tokenizer, "--save",
                                   files / "known"))
    assert code == 0 and recorded(files / "known") == ["tokenizer.json"], err
    base += ["--data", files / "ids.npy", "--save", files / "tuned"]
    code, _, err = cli(*base, "--init-from", files / "known", "--steps", "1")
    assert code == 0 and recorded(files / "tuned") == ["tokenizer.json"], err
    code, _, err = cli(*base, "--resume", files / "tuned", "--steps", "2")
    assert code == 0 and recorded(files / "tuned") == ["tokenizer.json"], (err, recorded(files / "tuned"))


def test_ids_prepare_data_made_with_the_byte_tokenizer_are_its(files, cli):
    """prepare-data --output writes PREFIX.json naming the tokenizer: bytes' ids keep --document-mask and the
    sample (EOS 256 and the prompt mean what they say), and the run records the byte tokenizer."""
    (files / "docs.jsonl").write_text("".join(json.dumps({"text": f"document {i} " * 20}) + "\n" for i in range(40)))
    code, _, err = cli("prepare-data", "--data", files / "docs.jsonl", "--output", files / "prep" / "docs",
                       "--data-cache", files / "cache")
    assert code == 0 and (files / "prep" / "docs.json").exists(), err
    code, out, err = cli(*train_args(files, "--data", files / "prep" / "docs", "--document-mask", "--sample-tokens",
                                     "2", "--save", files / "ckpt"))
    assert code == 0 and "sample (greedy)" in out and recorded(files / "ckpt") == "byte", err


def test_the_decision_is_taken_once_and_found_where_the_tokenizer_is_read(files, cli, monkeypatch):
    """A data file removed after the run read it does not fail a later save (each save used to look at --data again:
    a collective that one rank could fail); a tokenizer.json in a checkpoint's root, where `load_tokenizer` reads
    it, is the checkpoint's tokenizer; an asynchronous save records "unknown" too."""
    import tensorpar.training.session as session
    from tensorpar.checkpoints.sources import tokenizer_unknown
    from tensorpar.data.tokenizer import HFTokenizer, load_tokenizer

    real = session.build_data

    def build_then_remove(run, tokenizer):
        out = real(run, tokenizer)
        os.remove(files / "text.txt")
        return out

    monkeypatch.setattr(session, "build_data", build_then_remove)
    code, _, err = cli(*train_args(files, "--data", files / "text.txt", "--save", files / "text-run", "--steps", "2",
                                   "--save-every", "1"))
    assert code == 0 and recorded(files / "text-run") == "byte", err
    monkeypatch.setattr(session, "build_data", real)

    code, _, err = cli(*train_args(files, "--data", files / "ids.npy", "--save", files / "ckpt", "--async-save",
                                   "--steps", "2", "--save-every", "1"))
    assert code == 0, err
    steps = sorted(d for d in os.listdir(files / "ckpt") if d.startswith("step-"))
    assert [json.loads((files / "ckpt" / d / "meta.json").read_text())["tokenizer"] for d in steps] == \
        ["unknown", "unknown"]
    assert tokenizer_unknown(str(files / "ckpt"))
    (files / "ckpt" / "tokenizer.json").write_text(byte_tokenizer_json())
    assert isinstance(load_tokenizer(str(files / "ckpt")), HFTokenizer) and not tokenizer_unknown(str(files / "ckpt"))
