"""The files a tokenizer travels as, so that a checkpoint's tokenizer goes wherever its weights go.

A Hugging Face tokenizer is its folder's files (tokenizer.json, tokenizer_config.json with the special tokens, the
chat template, ...): a run's checkpoints carry copies of them, and an exported folder copies them again. The
byte-level default has no files: an exported folder gets it written as a tokenizer.json that `tokenizers` and
transformers (`AutoTokenizer`, `pipeline`) load with tensorpar's ids (UTF-8 bytes 0..255, EOS 256: a byte-level BPE
without merges over GPT-2's byte alphabet), and a tokenizer_config.json naming its EOS. generation_config.json holds
the special token ids generation stops at and pads with.
"""

from __future__ import annotations

import json
import os
import shutil

from tensorpar.data.tokenizer import ByteTokenizer, special_token_text, tokenizer_config

# What a tokenizer folder may hold, in the names transformers reads; generation_config.json travels with them.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "chat_template.jinja", "chat_template.json", "tokenizer.model", "vocab.json", "merges.txt",
                   "generation_config.json")
BYTE_EOS = "<|endoftext|>"


def _byte_alphabet() -> list[str]:
    """GPT-2's printable stand-in for each byte value (`bytes_to_unicode`), in byte order: the ByteLevel
    pre-tokenizer of `tokenizers` maps byte b to the b-th of these."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def byte_tokenizer_json() -> str:
    """tensorpar's byte tokenizer as a tokenizer.json (ids: the UTF-8 bytes, then 256 = EOS `<|endoftext|>`)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {char: b for b, char in enumerate(_byte_alphabet())}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([BYTE_EOS])
    return tok.to_str()


def source_files(tokenizer) -> dict[str, str]:
    """name -> path of the files `tokenizer` (an `HFTokenizer`) came with; {} for the byte tokenizer."""
    if isinstance(tokenizer, ByteTokenizer) or not hasattr(tokenizer, "path"):
        return {}
    folder = os.path.dirname(os.path.abspath(tokenizer.path))
    files = {name: os.path.join(folder, name) for name in TOKENIZER_FILES if os.path.isfile(os.path.join(folder, name))}
    files["tokenizer.json"] = tokenizer.path  # whatever its own file is called
    return files


def copy_files(files: dict[str, str], folder: str) -> list[str]:
    """Copy `files` (name -> path) into `folder`; the names copied."""
    for name, path in files.items():
        shutil.copyfile(path, os.path.join(folder, name))
    return sorted(files)


def special_token_ids(tokenizer) -> dict:
    """bos_token_id, eos_token_id and pad_token_id of `tokenizer` (None where it names none; pad: its own, else EOS:
    what generation pads finished rows with)."""
    ids = dict(bos_token_id=None, eos_token_id=getattr(tokenizer, "eos_id", None), pad_token_id=None)
    files = source_files(tokenizer)
    if files:  # the tokenizer_config.json and special_tokens_map.json beside its tokenizer.json
        names = tokenizer_config(os.path.dirname(files["tokenizer.json"]))
        for field in ("bos", "pad"):
            token = special_token_text(names.get(f"{field}_token"))
            if isinstance(token, str):
                ids[f"{field}_token_id"] = tokenizer.token_to_id(token)
    if ids["pad_token_id"] is None:
        ids["pad_token_id"] = ids["eos_token_id"]
    return ids


def write_tokenizer(folder: str, tokenizer, max_length: int) -> list[str]:
    """Write `tokenizer` into the model folder `folder`: an HF tokenizer's own files copied, the byte tokenizer's
    generated (tokenizer.json, tokenizer_config.json); generation_config.json from its special tokens unless its
    files hold one. The names written."""
    files = source_files(tokenizer)
    if files:
        written = copy_files(files, folder)
    else:
        with open(os.path.join(folder, "tokenizer.json"), "w", encoding="utf-8") as f:
            f.write(byte_tokenizer_json())
        config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": BYTE_EOS, "model_max_length": max_length,
                  "clean_up_tokenization_spaces": False}
        with open(os.path.join(folder, "tokenizer_config.json"), "w", encoding="utf-8") as f:
            json.dump(config, f, indent=2)
        written = ["tokenizer.json", "tokenizer_config.json"]
    if "generation_config.json" not in written:
        ids = special_token_ids(tokenizer)
        with open(os.path.join(folder, "generation_config.json"), "w", encoding="utf-8") as f:
            json.dump({k: v for k, v in ids.items() if v is not None}, f, indent=2)
        written.append("generation_config.json")
    return sorted(written)
