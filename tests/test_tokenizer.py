"""Tokenizers: the byte-level one and a local tokenizer.json."""

import pytest
import torch

from tensorpar.data import ByteTokenizer, HFTokenizer, load_tokenizer
from tensorpar.errors import TensorparError

TEXT = "Hello, world! Grüße, ünïcödé — 日本語 🙂\nsecond line\n"


def test_byte_tokenizer_round_trip():
    tok = ByteTokenizer()
    ids = tok.encode(TEXT)
    assert ids == list(TEXT.encode("utf-8"))
    assert max(ids) < 256 and tok.vocab_size == 257 and tok.eos_id == 256 and tok.name == "byte"
    assert tok.decode(ids) == TEXT
    assert tok.decode(ids + [tok.eos_id]) == TEXT          # EOS ignored
    assert tok.decode(torch.tensor(ids)) == TEXT
    assert tok.decode([0xFF]) == "\ufffd"                   # invalid UTF-8 replaced


def test_offsets_name_the_characters_each_id_comes_from():
    """What a chat's labels are read from: for bytes, each byte of a character points at that character."""
    ids, offsets = ByteTokenizer().encode_with_offsets("aü🙂")
    assert ids == list("aü🙂".encode("utf-8"))
    assert offsets == [(0, 1)] + [(1, 2)] * 2 + [(2, 3)] * 4


def _write_hf_tokenizer(directory):
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([TEXT * 3, "the quick brown fox"], trainer)
    tok.save(str(directory / "tokenizer.json"))


def test_hf_tokenizer_and_load_tokenizer(tmp_path):
    assert isinstance(load_tokenizer(None), ByteTokenizer)
    assert isinstance(load_tokenizer(str(tmp_path)), ByteTokenizer)   # no tokenizer.json
    _write_hf_tokenizer(tmp_path)
    tok = load_tokenizer(str(tmp_path))
    assert isinstance(tok, HFTokenizer)
    assert tok.eos_id == tok._tok.token_to_id("</s>")
    assert tok.vocab_size == tok._tok.get_vocab_size(with_added_tokens=True)
    ids = tok.encode(TEXT)
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == TEXT


@pytest.mark.parametrize("name,text,needle", [
    ("tokenizer_config.json", '{"eos_token": "</s>"', "cannot read '.*tokenizer_config.json': Expecting"),
    ("tokenizer_config.json", '["</s>"]', "tokenizer_config.json' holds a JSON list, not an object"),
    ("special_tokens_map.json", "{", "cannot read '.*special_tokens_map.json'")])
def test_a_damaged_tokenizer_config_is_refused_naming_it(tmp_path, name, text, needle):
    """The EOS was taken from a well-known name when tokenizer_config.json could not be read (a damaged file passed
    unnoticed), and the model folder's special ids failed with json's own error."""
    from tensorpar.data.tokenizer_files import special_token_ids

    _write_hf_tokenizer(tmp_path)
    tok = load_tokenizer(str(tmp_path))
    (tmp_path / name).write_text(text)
    with pytest.raises(TensorparError, match=needle):
        load_tokenizer(str(tmp_path))
    with pytest.raises(TensorparError, match=needle):
        special_token_ids(tok)


def test_hf_tokenizer_missing_file(tmp_path):
    with pytest.raises(TensorparError, match="tokenizer.json"):
        HFTokenizer(str(tmp_path / "tokenizer.json"))


def test_a_folder_whose_tokenizer_is_not_a_tokenizer_json_warns_once_that_bytes_are_used(tmp_path, capsys,
                                                                                        monkeypatch):
    """A model folder with a SentencePiece tokenizer.model (or GPT-2's vocab.json + merges.txt) and no
    tokenizer.json: the byte tokenizer is what tensorpar can use, and it says so, once, rather than silently."""
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("TENSORPAR_SPAWNED", raising=False)
    (tmp_path / "tokenizer.model").write_bytes(b"\x00")
    assert isinstance(load_tokenizer(str(tmp_path)), ByteTokenizer)
    assert isinstance(load_tokenizer(str(tmp_path)), ByteTokenizer)
    err = capsys.readouterr().err
    assert err.count("warning") == 1 and "holds tokenizer.model but no tokenizer.json" in err, err
    bare = tmp_path / "bare"
    bare.mkdir()
    assert isinstance(load_tokenizer(str(bare)), ByteTokenizer) and capsys.readouterr().err == ""
