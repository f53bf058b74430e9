"""Where a model comes from: `--checkpoint DIR` / `--init-from DIR` accept a Hugging Face folder or a
tensorpar checkpoint (its latest step, or a step folder)."""

from __future__ import annotations

import os

from tensorpar.checkpoints.hf import is_hf_folder, load_hf_folder, read_hf_config
from tensorpar.checkpoints.hf_config import SUPPORTED_MODEL_TYPES
from tensorpar.checkpoints.sharded import dense_model_state, is_checkpoint, read_meta
from tensorpar.errors import TensorparError
from tensorpar.models.config import ModelConfig


def _check_folder(path: str) -> None:
    if not os.path.exists(path):
        raise TensorparError(f"checkpoint '{path}' does not exist")
    if not os.path.isdir(path):
        raise TensorparError(f"checkpoint '{path}' is not a directory")


def load_config(path: str):
    """The ModelConfig of a checkpoint folder, reading only its config (cheap: for checks before launching)."""
    _check_folder(path)
    if is_checkpoint(path):
        return ModelConfig(**read_meta(path, verify=False)[1]["model"])
    if is_hf_folder(path):
        return read_hf_config(path)
    raise TensorparError(
        f"checkpoint '{path}' is not a Hugging Face model folder (config.json with model_type "
        f"{', '.join(SUPPORTED_MODEL_TYPES)}, "
        f"and *.safetensors weights) nor a tensorpar checkpoint (meta.json, or a 'latest' file)"
    )


def load_model_source(path: str):
    """(ModelConfig, dense state dict in tensorpar names) of a checkpoint folder."""
    load_config(path)
    if is_checkpoint(path):
        meta, state = dense_model_state(path)
        return ModelConfig(**meta["model"]), state
    return load_hf_folder(path)
