"""A checkpoint of dense weights in one shard, without optimizer state: what `tensorpar convert` writes from a
Hugging Face folder, in the format `tensorpar.checkpoints.sharded` reads (any layout resumes or evaluates it)."""

from __future__ import annotations

import json
import os
import shutil

import torch
from safetensors import SafetensorError
from safetensors.torch import save_file

from tensorpar.checkpoints.meta_checks import VERSION, sha256
from tensorpar.checkpoints.sharded import FORMAT, fsync_path, shard_file_name, step_folder, write_atomic
from tensorpar.data.tokenizer_files import copy_files
from tensorpar.errors import TensorparError


def write_dense_checkpoint(root: str, cfg, state: dict[str, torch.Tensor], step: int = 0,
                           tokenizer_files: dict | None = None, tokenizer_unknown: bool = False) -> str:
    """A single-shard checkpoint of dense weights (no optimizer state): what `tensorpar convert` writes, with the
    files of its tokenizer (name -> path; none: the byte tokenizer, or, with `tokenizer_unknown`, none known, as
    for a Hugging Face folder without tokenizer files: recorded as "unknown", claiming none). Refuses a folder that
    already holds a checkpoint."""
    if os.path.exists(root) and os.listdir(root):
        raise TensorparError(f"'{root}' exists and is not empty: refusing to overwrite it")
    os.makedirs(root, exist_ok=True)
    tmp, final = os.path.join(root, f".tmp-step-{step:06d}"), step_folder(root, step)
    os.makedirs(tmp)
    tensors = {f"param/{k}": v.contiguous() for k, v in state.items()}
    for kind in ("exp_avg", "exp_avg_sq"):
        tensors.update({f"{kind}/{k}": torch.zeros_like(v, dtype=torch.float32) for k, v in state.items()})
    file_name = shard_file_name(0, 0)
    path = os.path.join(tmp, file_name)
    try:  # a failed write (a full disk) leaves DST as it was, for the same command again
        save_file(tensors, path, metadata={"format": FORMAT, "step": str(step)})
        fsync_path(path)
        meta = {"format": FORMAT, "version": VERSION, "step": step, "optimizer_step": 0, "model": cfg.to_dict(),
                "layout": {"tp": 1, "pp": 1, "dp": 1, "zero": 0, "virtual_stages": 1, "schedule": None,
                           "sequence_parallel": False},
                "train": {}, "rng": "none needed", "tokenizer": ("unknown" if tokenizer_unknown
                                                             else copy_files(tokenizer_files or {}, tmp) or "byte"),
                "tensors": {k: {"shape": list(v.shape), "dim": None, "full_size": None, "padded_size": None,
                                "replicas": 1, "pp_rank": 0} for k, v in state.items()},
                "files": {file_name: {"bytes": os.path.getsize(path), "sha256": sha256(path), "tp_rank": 0,
                                      "pp_rank": 0}}}
        write_atomic(os.path.join(tmp, "meta.json"), json.dumps(meta, indent=1))
        fsync_path(tmp)
        os.replace(tmp, final)
        write_atomic(os.path.join(root, "latest"), os.path.basename(final) + "\n")
        fsync_path(root)
    except (OSError, SafetensorError) as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise TensorparError(f"writing the checkpoint '{root}' failed: {type(e).__name__}: {e}") from None
    return final
