"""Documents (one text each) from JSONL, gzipped JSONL, Parquet and `datasets.Dataset.save_to_disk` folders.

Every reader streams: JSONL line by line, Parquet one row group at a time, Arrow one record batch at a
time, so a shard never has to fit in memory. Readers yield lists of texts (a batch) and report progress in
bytes of the file read so far. Bad input raises a TensorparError naming the file and the line or row.
"""

from __future__ import annotations

import gzip
import json
import os
from collections.abc import Iterator

from tensorpar.errors import TensorparError

JSONL_SUFFIXES = (".jsonl", ".jsonl.gz")
PARQUET_SUFFIXES = (".parquet",)
HF_STATE = "state.json"
BATCH_DOCUMENTS = 1024


def document_kind(path: str) -> str | None:
    """'jsonl', 'parquet' or 'hf' for a document source; None for anything else (text, token arrays)."""
    if os.path.isdir(path):
        return "hf" if os.path.isfile(os.path.join(path, HF_STATE)) else "folder"
    if path.endswith(JSONL_SUFFIXES):
        return "jsonl"
    if path.endswith(PARQUET_SUFFIXES):
        return "parquet"
    return None


def document_files(path: str) -> list[tuple[str, str]]:
    """[(kind, file)] of a source: the file itself, a saved Hugging Face dataset's Arrow files, or every
    .jsonl / .jsonl.gz / .parquet file under a folder (sorted by path)."""
    kind = document_kind(path)
    if kind in ("jsonl", "parquet"):
        return [(kind, path)]
    if kind == "hf":
        return [("arrow", f) for f in hf_arrow_files(path)]
    if kind == "folder":
        if os.path.isfile(os.path.join(path, "dataset_dict.json")):
            splits = sorted(d for d in os.listdir(path) if os.path.isdir(os.path.join(path, d)))
            raise TensorparError(f"'{path}' is a saved DatasetDict with splits {', '.join(splits)}; point --data "
                                 f"at one split's folder, e.g. '{os.path.join(path, splits[0] if splits else 'train')}'")
        files = []
        for root, dirs, names in os.walk(path):
            dirs.sort()
            for name in sorted(names):
                file = os.path.join(root, name)
                if name.endswith(JSONL_SUFFIXES):
                    files.append(("jsonl", file))
                elif name.endswith(PARQUET_SUFFIXES):
                    files.append(("parquet", file))
        if not files:
            raise TensorparError(f"data folder '{path}' holds no .jsonl, .jsonl.gz or .parquet files (nor is it a "
                                 f"folder written by datasets' save_to_disk)")
        return sorted(files, key=lambda kf: kf[1])
    raise TensorparError(f"'{path}' is not a JSONL, Parquet or Hugging Face dataset source")


def hf_arrow_files(folder: str) -> list[str]:
    """The Arrow files of a folder written by `datasets.Dataset.save_to_disk`, in order (from its state.json)."""
    state_path = os.path.join(folder, HF_STATE)
    try:
        with open(state_path, encoding="utf-8") as f:
            state = json.load(f)
        names = [entry["filename"] for entry in state["_data_files"]]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise TensorparError(f"'{state_path}' is not the state.json of a saved dataset: {e}") from None
    files = [os.path.join(folder, n) for n in names]
    for f in files:
        if not os.path.isfile(f):
            raise TensorparError(f"'{state_path}' lists '{f}', which does not exist")
    if not files:
        raise TensorparError(f"'{state_path}' lists no data files: the dataset is empty")
    return files


def read_documents(kind: str, file: str, text_field: str) -> Iterator[tuple[list[str], int]]:
    """Batches of documents of one file as (texts, bytes of the file read so far)."""
    readers = {"jsonl": _jsonl, "parquet": _parquet, "arrow": _arrow}
    count = 0
    for texts, done in readers[kind](file, text_field):
        count += len(texts)
        yield texts, done
    if count == 0:
        raise TensorparError(f"'{file}' holds no documents (an empty shard)")


def _jsonl(file: str, field: str) -> Iterator[tuple[list[str], int]]:
    raw = open(file, "rb")
    try:
        stream = gzip.open(raw) if file.endswith(".gz") else raw
        batch: list[str] = []
        number = 0
        try:
            for number, line in enumerate(stream, 1):
                if not line.strip():
                    continue
                batch.append(_jsonl_text(file, number, line, field))
                if len(batch) == BATCH_DOCUMENTS:
                    yield batch, raw.tell()
                    batch = []
        except (OSError, EOFError) as e:  # gzip: a truncated or corrupt stream
            raise TensorparError(f"'{file}' cannot be read after line {number}: {e}") from None
        if batch:
            yield batch, raw.tell()
    finally:
        raw.close()


def _jsonl_text(file: str, number: int, line: bytes, field: str) -> str:
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError as e:
        raise TensorparError(f"'{file}' line {number}: not UTF-8 (byte {e.start} of the line)") from None
    try:
        record = json.loads(text)
    except ValueError as e:
        raise TensorparError(f"'{file}' line {number}: not valid JSON ({e})") from None
    if not isinstance(record, dict):
        raise TensorparError(f"'{file}' line {number}: a JSON {type(record).__name__}, not an object")
    if field not in record:
        known = ", ".join(sorted(record)) or "none"
        raise TensorparError(f"'{file}' line {number}: no field '{field}' (fields: {known}; choose one with "
                             f"--text-field)")
    value = record[field]
    if not isinstance(value, str):
        raise TensorparError(f"'{file}' line {number}: field '{field}' holds {type(value).__name__}, not text")
    check_surrogates(f"'{file}' line {number}", line, value)
    return value


def check_surrogates(where: str, line: bytes, value) -> None:
    """Refuse a JSON line whose `value` (a text, or a record) holds a lone UTF-16 surrogate: JSON may escape one
    (`"\\ud800"`), but it is no Unicode character, and no tokenizer takes it. Only a line with such an escape is
    looked at."""
    if b"\\ud" not in line and b"\\uD" not in line:
        return
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as e:
        raise TensorparError(f"{where}: holds a lone UTF-16 surrogate ({e.object[e.start:e.end]!r}, escaped in the "
                             f"JSON), which is not Unicode text") from None


def _column_texts(file: str, batch, field: str, first_row: int) -> list[str]:
    if field not in batch.schema.names:
        raise TensorparError(f"'{file}': no column '{field}' (columns: {', '.join(batch.schema.names)}; choose "
                             f"one with --text-field)")
    column = batch.column(batch.schema.get_field_index(field))
    pa, _ = pyarrow_modules(file)
    if not (pa.types.is_string(column.type) or pa.types.is_large_string(column.type)):
        raise TensorparError(f"'{file}': column '{field}' holds {column.type}, not text")
    if column.null_count:
        row = next(i for i, v in enumerate(column.is_null().to_pylist()) if v)
        raise TensorparError(f"'{file}' row {first_row + row}: column '{field}' is null")
    return column.to_pylist()


def _parquet(file: str, field: str) -> Iterator[tuple[list[str], int]]:
    _, pq = pyarrow_modules(file)
    try:
        reader = pq.ParquetFile(file)
    except Exception as e:  # noqa: BLE001 - pyarrow raises ArrowInvalid, OSError, ... for a bad file
        raise TensorparError(f"'{file}' is not a readable Parquet file: {e}") from None
    if field not in reader.schema_arrow.names:
        raise TensorparError(f"'{file}': no column '{field}' (columns: {', '.join(reader.schema_arrow.names)}; "
                             f"choose one with --text-field)")
    size, groups, row = os.path.getsize(file), reader.num_row_groups, 0
    for g in range(groups):
        try:
            table = reader.read_row_group(g, columns=[field])
        except Exception as e:  # noqa: BLE001
            raise TensorparError(f"'{file}': row group {g} (rows from {row}) cannot be read: {e}") from None
        for batch in table.to_batches():
            texts = _column_texts(file, batch, field, row)
            row += len(texts)
            if texts:
                yield texts, size * (g + 1) // groups
    reader.close()


def _arrow(file: str, field: str) -> Iterator[tuple[list[str], int]]:
    pa, _ = pyarrow_modules(file)
    row = 0
    try:
        source = pa.memory_map(file, "r")
        reader = pa.ipc.open_stream(source)
    except Exception as e:  # noqa: BLE001
        raise TensorparError(f"'{file}' is not a readable Arrow stream (as datasets' save_to_disk writes): "
                             f"{e}") from None
    while True:
        try:
            batch = reader.read_next_batch()
        except StopIteration:
            break
        except Exception as e:  # noqa: BLE001
            raise TensorparError(f"'{file}': cannot read the record batch at row {row}: {e}") from None
        texts = _column_texts(file, batch, field, row)
        row += len(texts)
        if texts:
            yield texts, source.tell()


def pyarrow_modules(file: str):
    """(pyarrow, pyarrow.parquet), imported on first use: only runs that read these formats pay for it."""
    try:
        import pyarrow  # noqa: PLC0415
        import pyarrow.ipc  # noqa: F401, PLC0415
        import pyarrow.parquet  # noqa: PLC0415
    except ImportError:
        raise TensorparError(f"reading '{file}' needs the 'pyarrow' package (pip install pyarrow)") from None
    return pyarrow, pyarrow.parquet
