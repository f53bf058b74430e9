"""Document sources: the same text in every format gives the same token stream; bad input names the file and
the line or row; the token cache is built once and keyed by the files and the tokenizer."""

import gzip
import json
import os
import time

import numpy as np
import pytest

from tensorpar.cli import main
from tensorpar.data import ByteTokenizer, HFTokenizer, IndexedDataset, cached_tokens, open_stream, prepare_sources
from tensorpar.errors import TensorparError

from corpora import DOCS, byte_stream, write_hf_dataset, write_jsonl, write_jsonl_folder, write_parquet_folder
from test_tokenizer import _write_hf_tokenizer


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("sources")
    return {
        "jsonl-folder": write_jsonl_folder(root / "jsonl"),
        "jsonl-gz": write_jsonl(root / "docs.jsonl.gz", gz=True),
        "parquet-folder": write_parquet_folder(root / "parquet"),
        "hf-dataset": write_hf_dataset(root / "hf"),
    }


def _stream(path, tok, cache):
    return np.asarray(open_stream(path, tok, cache_dir=str(cache), progress=False).tokens, dtype=np.int64)


def test_every_format_gives_the_same_token_stream(sources, tmp_path, capsys):
    tok, cache = ByteTokenizer(), tmp_path / "cache"
    expected = byte_stream()
    for name, path in sources.items():
        np.testing.assert_array_equal(_stream(path, tok, cache), expected, err_msg=name)
    # prepare-data writes the Megatron .bin/.idx of a source; --data PREFIX reads the same stream back.
    prefix = str(tmp_path / "megatron" / "docs_text_document")
    assert main(["prepare-data", "--data", sources["jsonl-gz"], "--data-cache", str(cache), "--output", prefix,
                 "--no-progress", "--json"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["cached"] and record["documents"] == len(DOCS) and record["tokens"] == expected.size
    np.testing.assert_array_equal(_stream(prefix, tok, cache), expected)
    assert IndexedDataset(prefix).doc_lengths.tolist() == [len(d.encode()) + 1 for d in DOCS]


def test_a_hugging_face_tokenizer_gives_one_stream_across_formats(sources, tmp_path):
    _write_hf_tokenizer(tmp_path)
    tok = HFTokenizer(str(tmp_path))
    assert tok.eos_id is not None
    expected = []
    for d in DOCS:
        expected.extend(tok.encode(d) + [tok.eos_id])
    for name, path in sources.items():
        np.testing.assert_array_equal(_stream(path, tok, tmp_path / "cache"), expected, err_msg=name)


def test_the_cache_is_built_once_and_keyed_by_files_and_tokenizer(tmp_path):
    path, cache, tok = write_jsonl(tmp_path / "a.jsonl"), str(tmp_path / "cache"), ByteTokenizer()
    first = cached_tokens(path, tok, cache_dir=cache, progress=False)[1]
    again = cached_tokens(path, tok, cache_dir=cache, progress=False)[1]
    assert not first["cached"] and again["cached"] and again["prefix"] == first["prefix"]
    time.sleep(0.01)
    write_jsonl(path, DOCS[:3])  # the file changed: a new cache entry
    changed = cached_tokens(path, tok, cache_dir=cache, progress=False)
    assert not changed[1]["cached"] and changed[1]["prefix"] != first["prefix"]
    assert changed[0].num_documents == 3
    _write_hf_tokenizer(tmp_path)
    hf = HFTokenizer(str(tmp_path))
    assert cached_tokens(path, hf, cache_dir=cache, progress=False)[1]["prefix"] != changed[1]["prefix"]
    assert len([f for f in os.listdir(cache) if f.endswith(".json")]) == 3


def _refused(path, match, field="text", tmp=None):
    with pytest.raises(TensorparError, match=match):
        prepare_sources(str(path), tokenizer=ByteTokenizer(), text_field=field, cache_dir=str(tmp), progress=False)


def test_bad_input_names_the_file_and_the_line_or_row(tmp_path):
    cache = tmp_path / "cache"
    write_jsonl(tmp_path / "a.jsonl")
    _refused(tmp_path / "a.jsonl", r"a\.jsonl' line 1: no field 'content' \(fields: id, text", "content", cache)
    _refused(tmp_path / "a.jsonl", r"a\.jsonl' line 1: field 'id' holds int, not text", "id", cache)
    lines = [json.dumps({"text": "fine"}).encode(), b'{"text": "caf\xe9"}', b"{broken"]
    (tmp_path / "latin1.jsonl").write_bytes(b"\n".join(lines[:2]) + b"\n")
    _refused(tmp_path / "latin1.jsonl", r"latin1\.jsonl' line 2: not UTF-8", tmp=cache)
    (tmp_path / "broken.jsonl").write_bytes(lines[0] + b"\n" + lines[0] + b"\n" + lines[2] + b"\n")
    _refused(tmp_path / "broken.jsonl", r"broken\.jsonl' line 3: not valid JSON", tmp=cache)
    folder = write_jsonl_folder(tmp_path / "shards")
    open(os.path.join(folder, "part-01.jsonl"), "w").close()  # an empty shard is refused, not skipped
    _refused(folder, r"part-01\.jsonl' holds no documents", tmp=cache)
    with gzip.open(tmp_path / "cut.jsonl.gz", "wb") as f:
        f.write(b"".join(json.dumps({"text": d}).encode() + b"\n" for d in DOCS * 20))
    (tmp_path / "cut.jsonl.gz").write_bytes((tmp_path / "cut.jsonl.gz").read_bytes()[:200])
    _refused(tmp_path / "cut.jsonl.gz", r"cut\.jsonl\.gz' cannot be read after line \d+", tmp=cache)

    pq_folder = write_parquet_folder(tmp_path / "pq")
    (tmp_path / "pq" / "shard-1.parquet").write_bytes(b"PAR1 this is not parquet")
    _refused(pq_folder, r"shard-1\.parquet' is not a readable Parquet file", tmp=cache)
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": ["a", "b", None, "d"]}), tmp_path / "nulls.parquet", row_group_size=2)
    _refused(tmp_path / "nulls.parquet", r"nulls\.parquet' row 2: column 'text' is null", tmp=cache)
    _refused(tmp_path / "nulls.parquet", r"nulls\.parquet': no column 'body' \(columns: text", "body", cache)
    pq.write_table(pa.table({"text": pa.array([], pa.string())}), tmp_path / "empty.parquet")
    _refused(tmp_path / "empty.parquet", r"empty\.parquet' holds no documents", tmp=cache)
    hf = write_hf_dataset(tmp_path / "hf")
    _refused(hf, r"data-00000-of-00001\.arrow': no column 'body'", "body", cache)
    (tmp_path / "nothing").mkdir()
    _refused(tmp_path / "nothing", r"data folder '.*nothing' holds no \.jsonl", tmp=cache)
    _refused(tmp_path / "missing.jsonl", r"data file '.*missing\.jsonl' does not exist", tmp=cache)
    assert not [f for f in os.listdir(cache) if f.endswith((".json", ".bin"))]  # nothing half-written is kept


def test_the_command_line_names_a_missing_source_of_a_mixture_in_one_line(tmp_path, capsys):
    a = write_jsonl(tmp_path / "a.jsonl")
    assert main(["train", "--data", f"0.5 {a} 0.5 {tmp_path / 'b.parquet'}", "--no-progress", "--data-cache",
                 str(tmp_path / "cache"), "--out-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"tensorpar: error: data file '{tmp_path / 'b.parquet'}' does not exist"]
    assert main(["prepare-data", "--data", str(tmp_path / "a.jsonl"), "--text-field", "body", "--no-progress",
                 "--data-cache", str(tmp_path / "cache")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "a.jsonl' line 1: no field 'body'" in err[0]


def test_ids_that_do_not_fit_the_model_are_refused_naming_the_source(tmp_path):
    from tensorpar.data import open_corpus

    path = write_jsonl(tmp_path / "a.jsonl")
    pairs = open_corpus(path, ByteTokenizer(), 257, cache_dir=str(tmp_path / "c"), progress=False)
    assert pairs[0][1].max_id == 256
    with pytest.raises(TensorparError, match=r"a\.jsonl: token id 256 does not fit the vocabulary of size 256"):
        open_corpus(path, ByteTokenizer(), 256, cache_dir=str(tmp_path / "c"), progress=False)


def test_a_lone_surrogate_escaped_in_json_is_refused_naming_the_line(tmp_path):
    """`"\\ud800"` is valid JSON but no Unicode text (tokenizers raised a TypeError on it); a surrogate pair is an
    emoji and reads as one."""
    cache = tmp_path / "cache"
    (tmp_path / "s.jsonl").write_bytes(b'{"text": "fine"}\n{"text": "cut \\ud83d"}\n')
    _refused(tmp_path / "s.jsonl", r"s\.jsonl' line 2: holds a lone UTF-16 surrogate", tmp=cache)
    (tmp_path / "pair.jsonl").write_bytes(b'{"text": "\\ud83d\\ude00"}\n')
    data, _ = cached_tokens(str(tmp_path / "pair.jsonl"), ByteTokenizer(), cache_dir=str(cache), progress=False)
    assert bytes(data.tokens[:-1].tolist()).decode() == "\U0001F600"


@pytest.mark.parametrize("row", [
    {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b\udc80"}]},
    {"prompt": "a", "completion": "b\udc80"},
], ids=["conversation", "pair"])
def test_instruction_rows_with_a_lone_surrogate_are_refused_naming_the_line(tmp_path, row):
    from tensorpar.data.examples import read_records

    (tmp_path / "rows.jsonl").write_text(json.dumps({"prompt": "x", "completion": "y"}) + "\n" + json.dumps(row) + "\n")
    with pytest.raises(TensorparError, match=r"rows\.jsonl' line 2: holds a lone UTF-16 surrogate"):
        list(read_records(str(tmp_path / "rows.jsonl")))
