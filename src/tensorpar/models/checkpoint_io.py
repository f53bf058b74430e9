"""Where a model comes from: `--checkpoint DIR` / `--init-from DIR` accept a Hugging Face folder."""

from __future__ import annotations

import json
import os

from tensorpar.errors import TensorparError


def _check_folder(path: str) -> None:
    if not os.path.exists(path):
        raise TensorparError(f"checkpoint '{path}' does not exist")
    if not os.path.isdir(path):
        raise TensorparError(f"checkpoint '{path}' is not a directory")


def load_config(path: str):
    """The ModelConfig of a checkpoint folder, reading only its config (cheap: for checks before launching)."""
    from tensorpar.models.hf import config_from_hf, is_hf_folder

    _check_folder(path)
    if is_hf_folder(path):
        with open(os.path.join(path, "config.json")) as f:
            return config_from_hf(json.load(f))
    raise TensorparError(
        f"checkpoint '{path}' is not a Hugging Face model folder (config.json with model_type gpt2 or llama, "
        f"and *.safetensors weights)"
    )


def load_model_source(path: str):
    """(ModelConfig, dense state dict in tensorpar names) of a checkpoint folder."""
    from tensorpar.models.hf import load_hf_folder

    load_config(path)
    return load_hf_folder(path)
