"""Tokenizers: a byte-level one that always works, and a wrapper for a local `tokenizer.json`.

Both expose the same small interface: `vocab_size`, `eos_id`, `name`, `encode(text)`, `decode(ids)`.
Nothing here touches the network.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import warnings

from tensorpar.errors import TensorparError

# Tried in order when no tokenizer_config.json names the end-of-sequence token.
_EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|eot_id|>", "<|im_end|>")


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255, plus `eos_id = 256`; `vocab_size = 257`."""

    name = "byte"
    vocab_size = 257
    eos_id = 256

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """The UTF-8 bytes of `text`; no EOS is added (bytes have no special tokens to add)."""
        return list(text.encode("utf-8"))

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """`encode` of each text."""
        return [list(t.encode("utf-8")) for t in texts]

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """(`encode(text)`, the [start, end) characters of `text` each id comes from: a character's every byte)."""
        ids, offsets = [], []
        for i, char in enumerate(text):
            data = char.encode("utf-8")
            ids.extend(data)
            offsets.extend([(i, i + 1)] * len(data))
        return ids, offsets

    @property
    def fingerprint(self) -> str:
        """What identifies the tokenizer's ids (a cache of tokenized data is keyed by it)."""
        return "byte-v1"

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        """Bytes back to text; ids outside 0..255 (EOS, which has no text) are skipped, invalid UTF-8 becomes
        U+FFFD."""
        data = bytes(i for i in (int(x) for x in ids) if 0 <= i < 256)
        return data.decode("utf-8", errors="replace")

    def __repr__(self) -> str:
        return "ByteTokenizer(vocab_size=257)"


def read_json_object(path: str) -> dict:
    """The JSON object in the file at `path`; a file that cannot be read or holds something else is refused."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise TensorparError(f"cannot read '{path}': {e}") from None
    if not isinstance(data, dict):
        raise TensorparError(f"'{path}' holds a JSON {type(data).__name__}, not an object")
    return data


def special_token_text(value) -> str | None:
    """A special token's text: tokenizer_config.json writes it as a string or as {"content": ...}."""
    return value.get("content") if isinstance(value, dict) else value


def tokenizer_config(directory: str) -> dict:
    """A tokenizer folder's tokenizer_config.json ({} without one) with its special tokens as transformers reads
    them: a config without `added_tokens_decoder` (saved before transformers 4.34) takes them from
    special_tokens_map.json beside it, over its own. A damaged file is refused, naming it."""
    path = os.path.join(directory, "tokenizer_config.json")
    config = read_json_object(path) if os.path.isfile(path) else {}
    tokens = os.path.join(directory, "special_tokens_map.json")
    if "added_tokens_decoder" in config or not os.path.isfile(tokens):
        return config
    return {**config, **read_json_object(tokens)}


class HFTokenizer:
    """A `tokenizers.Tokenizer` read from a local `tokenizer.json` (a file or the directory holding it)."""

    def __init__(self, path: str):
        file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
        if not os.path.isfile(file):
            raise TensorparError(f"tokenizer file '{file}' does not exist")
        try:
            from tokenizers import Tokenizer
        except ImportError as e:
            raise TensorparError(
                f"cannot load '{file}': the 'tokenizers' package is not installed (pip install tokenizers)"
            ) from e
        try:
            self._tok = Tokenizer.from_file(file)
        except Exception as e:  # tokenizers raises a bare Exception on a malformed file
            raise TensorparError(f"cannot read tokenizer file '{file}': {e}") from e
        self.path = file
        self.name = f"hf:{os.path.basename(os.path.dirname(os.path.abspath(file)))}"
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.eos_id = self._find_eos(os.path.dirname(os.path.abspath(file)))

    def _find_eos(self, directory: str) -> int | None:
        """The EOS id named by tokenizer_config.json next to the file (`tokenizer_config`), else a well-known EOS
        token, else None."""
        names = list(_EOS_CANDIDATES)
        eos = special_token_text(tokenizer_config(directory).get("eos_token"))
        if isinstance(eos, str):
            names.insert(0, eos)
        for token in names:
            i = self._tok.token_to_id(token)
            if i is not None:
                return int(i)
        return None

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`, without special tokens (no BOS/EOS added) unless `add_special_tokens`: then with
        those the tokenizer's post-processor adds (a BOS, as transformers' tokenizer(text) gives)."""
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def token_to_id(self, token: str) -> int | None:
        """The id of `token` (None when the vocabulary lacks it)."""
        return self._tok.token_to_id(token)

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """(`encode(text)`, the [start, end) characters of `text` each id comes from)."""
        encoding = self._tok.encode(text, add_special_tokens=False)
        return list(encoding.ids), list(encoding.offsets)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """`encode` of each text, batched: the Rust library spreads the batch over its threads
        (RAYON_NUM_THREADS, default all cores)."""
        encode = getattr(self._tok, "encode_batch_fast", self._tok.encode_batch)  # _fast: no offsets (>= 0.20)
        return [e.ids for e in encode(texts, add_special_tokens=False)]

    @property
    def fingerprint(self) -> str:
        """The SHA-256 of the tokenizer.json and the EOS id: what identifies the ids it produces."""
        if not hasattr(self, "_fingerprint"):
            with open(self.path, "rb") as f:
                self._fingerprint = f"hf-{hashlib.sha256(f.read()).hexdigest()[:32]}-eos{self.eos_id}"
        return self._fingerprint

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        """Text of `ids`, skipping special tokens unless asked not to."""
        return self._tok.decode([int(x) for x in ids], skip_special_tokens=skip_special_tokens)

    def __repr__(self) -> str:
        return f"HFTokenizer('{self.path}', vocab_size={self.vocab_size})"


CONTEXT_TOKENS = 4  # the tokens before a continuation that `text_after` decodes it with


def context_tokens(before) -> tuple[int, ...]:
    """The tokens of `before` that `text_after` decodes a continuation with: its last `CONTEXT_TOKENS`."""
    return tuple(int(x) for x in before[-CONTEXT_TOKENS:])


def text_after(tokenizer, before, ids, skip_special_tokens: bool = True) -> str:
    """The text the tokens `ids` add after the tokens `before`: `context_tokens(before)` decoded with `ids`, their own
    text cut off (as vLLM detokenizes), so that a SentencePiece token's leading space ("_is") is kept after other
    text, as a whole sequence's decoding keeps it, where decoding `ids` alone would drop it; `ids` decoded alone where
    the context's text is not where the whole's begins (a character split between them)."""
    context = list(context_tokens(before))
    ids = [int(x) for x in ids]
    if context:
        head = tokenizer.decode(context, skip_special_tokens=skip_special_tokens)
        whole = tokenizer.decode(context + ids, skip_special_tokens=skip_special_tokens)
        if whole.startswith(head) and not head.endswith("\ufffd"):
            return whole[len(head):]
    return tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


def tokenizer_folder(folder: str) -> str:
    """The folder of `folder`'s tokenizer files: `folder` itself, or, for a tensorpar checkpoint's root without them,
    the step folder its `latest` file names (a run's checkpoints carry its tokenizer's files: tokenizer.json,
    tokenizer_config.json with the chat template, ...)."""
    try:
        with open(os.path.join(folder, "latest")) as f:
            latest = os.path.join(folder, f.read().strip())
    except OSError:
        return folder
    has = lambda d: any(os.path.isfile(os.path.join(d, n)) for n in ("tokenizer.json", "tokenizer_config.json"))  # noqa: E731
    return folder if has(folder) or not has(latest) else latest


def _tokenizer_file(folder: str) -> str:
    """`folder`'s tokenizer.json, or that of the step folder its `latest` file names (`tokenizer_folder`)."""
    return os.path.join(tokenizer_folder(folder), "tokenizer.json")


# A tokenizer in a format other than tokenizer.json (SentencePiece, GPT-2's vocabulary and merges): not read.
_OTHER_TOKENIZER_FILES = ("tokenizer.model", "spiece.model", "vocab.json", "merges.txt", "vocab.txt")
_warned: set[str] = set()


def _warn_unread_tokenizer(folder: str) -> None:
    """One warning when `folder` holds a tokenizer tensorpar does not read (its text is then tokenized as bytes,
    which that model's vocabulary does not mean): once per process, by the process the command started in (the
    ranks tensorpar starts leave it to that one) or, under torchrun, rank 0."""
    others = [n for n in _OTHER_TOKENIZER_FILES if os.path.isfile(os.path.join(folder, n))]
    spawned = os.environ.get("TENSORPAR_SPAWNED") == "1"  # a rank of tensorpar's own launcher, which warned
    if not others or folder in _warned or spawned or os.environ.get("RANK", "0") != "0":
        return
    _warned.add(folder)
    sys.stderr.write(f"tensorpar: warning: '{folder}' holds {', '.join(others)} but no tokenizer.json, the only "
                     f"tokenizer file tensorpar reads: its text is tokenized as bytes (write a tokenizer.json with "
                     f"transformers' AutoTokenizer.from_pretrained(DIR).save_pretrained(DIR), or give --tokenizer)\n")


def load_tokenizer(checkpoint_dir: str | None):
    """HFTokenizer if `checkpoint_dir` (or, for a checkpoint's root, its latest step) holds tokenizer.json and
    `tokenizers` imports, else ByteTokenizer()."""
    if checkpoint_dir is None:
        return ByteTokenizer()
    file = _tokenizer_file(checkpoint_dir)
    if not os.path.isfile(file):
        _warn_unread_tokenizer(os.path.dirname(file))
        return ByteTokenizer()
    try:
        import tokenizers  # noqa: F401
    except ImportError:
        warnings.warn(
            f"'{file}' found but the 'tokenizers' package is not installed; using the byte tokenizer",
            stacklevel=2,
        )
        return ByteTokenizer()
    return HFTokenizer(file)


def tokenizer_from(path: str | None, fallback_dir: str | None = None):
    """The tokenizer that `--tokenizer PATH` names (a tokenizer.json, or a folder holding one), else that of
    `fallback_dir` (a model folder; `load_tokenizer`'s rules), else the byte tokenizer."""
    if path is None:
        return load_tokenizer(fallback_dir)
    if os.path.isdir(path) and not os.path.isfile(os.path.join(path, "tokenizer.json")):
        raise TensorparError(f"tokenizer folder '{path}' holds no tokenizer.json (only tokenizer.json files of "
                             f"Hugging Face tokenizers are read)")
    return HFTokenizer(path)
