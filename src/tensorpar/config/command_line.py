"""What a command takes from the command line, checked before it starts. Where it will write: a folder it makes must
not be a file (nor lie under one), a file it writes must not be a folder (found at the first save, a run would have
trained until then for nothing). Text it tokenizes: UTF-8."""

from __future__ import annotations

import os

from tensorpar.errors import TensorparError


def _file_above(path: str) -> str | None:
    """The nearest existing path at or above `path`'s parent that is not a folder (None: every one is)."""
    parent = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    return None if os.path.isdir(parent) else parent


def check_output_folder(path: str | None, what: str) -> None:
    """`path`, a folder `what` writes into (made if missing), can be: it is a folder or can be made one."""
    if not path:
        return
    if os.path.exists(path) and not os.path.isdir(path):
        raise TensorparError(f"{what} '{path}' is a file, not a folder")
    blocker = _file_above(path)
    if blocker is not None:
        raise TensorparError(f"{what} '{path}' cannot be made: '{blocker}' is a file, not a folder")


def check_output_file(path: str | None, what: str) -> None:
    """`path`, a file `what` writes (its folder made if missing), can be: it is no folder, nor under a file."""
    if not path:
        return
    if os.path.isdir(path):
        raise TensorparError(f"{what} '{path}' is a folder, not a file")
    blocker = _file_above(path)
    if blocker is not None:
        raise TensorparError(f"{what} '{path}' cannot be written: '{blocker}' is a file, not a folder")


def check_text(value: str | None, what: str) -> None:
    """`value`, text given on the command line, is Unicode: bytes that are not UTF-8 reach Python as lone surrogates
    (os.fsdecode's surrogateescape), which no tokenizer takes."""
    if value is None:
        return
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raw = value[e.start:e.end].encode("utf-8", "surrogateescape")
        raise TensorparError(f"{what} is not UTF-8 text (byte {raw[:1].hex()} at character {e.start}): give it in "
                             f"UTF-8") from None
