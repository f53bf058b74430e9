"""A checkpoint's meta.json against its shards: the format version, the shard file of each position, the shape of
each rebuilt tensor, each shard file's size and SHA-256. A meta.json that does not match its shards (edited by hand, or of another run's files) is
refused naming the file and what differs, instead of failing inside the load."""
from __future__ import annotations

import hashlib
import os

import torch

from tensorpar.errors import TensorparError

VERSION = 1  # the meta.json layout this code writes and reads


# The fields every reader of a checkpoint takes, and their JSON types; each file entry's, and the layout's.
_FIELDS = {"step": int, "optimizer_step": int, "model": dict, "layout": dict, "tensors": dict, "files": dict}
_FILE_FIELDS = {"bytes": int, "sha256": str, "pp_rank": int}


def check_version(meta: dict, meta_path: str) -> None:
    """`meta` is of this code's format version and holds the fields the readers take: a meta.json edited by hand
    or damaged is refused naming what is wrong, not a KeyError inside the load."""
    if meta.get("version") != VERSION:
        raise TensorparError(f"'{meta_path}' is of checkpoint format version {meta.get('version')!r}; this "
                             f"tensorpar reads version {VERSION}")
    wrong = [k for k, kind in _FIELDS.items() if not isinstance(meta.get(k), kind)]
    if not wrong and not isinstance(meta["layout"].get("tp"), int):
        wrong = ["layout.tp"]
    if not wrong:
        wrong = [f"files.{name}.{k}" for name, f in meta["files"].items() for k, kind in _FILE_FIELDS.items()
                 if not isinstance(f, dict) or not isinstance(f.get(k), kind)][:1]
    if wrong:
        raise TensorparError(f"'{meta_path}' is damaged: its field {wrong[0]!r} is missing or of the wrong type")


def sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def check_shards(step_dir: str, meta: dict, checksums: bool = True) -> None:
    """Refuse a checkpoint whose shard files (`meta`'s) are missing, of another size or, with `checksums`, whose
    SHA-256 differs from meta.json's (reading every byte)."""
    for name, f in meta["files"].items():
        file_path = os.path.join(step_dir, name)
        if not os.path.isfile(file_path):
            raise TensorparError(f"checkpoint shard '{file_path}' is missing")
        size = os.path.getsize(file_path)
        if size != f["bytes"]:
            raise TensorparError(f"checkpoint shard '{file_path}' has {size} bytes, expected {f['bytes']}: "
                                 f"truncated or replaced")
        if checksums and sha256(file_path) != f["sha256"]:
            raise TensorparError(f"checkpoint shard '{file_path}' is corrupted: its SHA-256 does not match "
                                 f"meta.json")


def shard_file(step_dir: str, meta: dict, files: dict, position: tuple[int, int], what: str) -> str:
    """The shard file of (tp or ep rank, pp rank) in `files`, or an error saying meta.json does not match."""
    if position not in files:
        layout = meta.get("layout", {})
        raise TensorparError(f"'{os.path.join(step_dir, 'meta.json')}' lists no shard file of {what} rank "
                             f"{position[0]}, pp rank {position[1]} (its layout: tp {layout.get('tp')}, pp "
                             f"{layout.get('pp')}, ep {layout.get('ep', 1)}; its files: "
                             f"{', '.join(sorted(meta['files']))}): the metadata does not match the shards")
    return files[position]


def checked_shard(shard: torch.Tensor, p: torch.Tensor, name: str, step_dir: str) -> torch.Tensor:
    """`shard` if it has the shape of this rank's parameter `p`, else an error naming the tensor (a meta.json whose
    model or layout does not match its shards)."""
    if shard.shape != p.shape:
        raise TensorparError(f"checkpoint '{step_dir}': tensor '{name}' rebuilt from the shards gives this rank "
                             f"{tuple(shard.shape)}, the model's shard is {tuple(p.shape)}: meta.json's model or "
                             f"layout does not match the shards")
    return shard
