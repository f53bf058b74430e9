"""Where a model comes from: `--checkpoint DIR` / `--init-from DIR` accept a Hugging Face folder or a
tensorpar checkpoint (its latest step, or a step folder); a LoRA run's checkpoint, or a PEFT adapter given beside
the model (`--lora-adapter`), gives the model with its adapters merged into the weights."""

from __future__ import annotations

import json
import os
from pathlib import Path

from tensorpar.checkpoints.hf import (check_hf_folder, is_hf_folder, load_hf_folder, no_safetensors_error,
                                     other_weight_files)
from tensorpar.checkpoints.hf_config import SUPPORTED_MODEL_TYPES, config_from_hf
from tensorpar.checkpoints.peft_adapter import check_lora_model, merge_adapters, read_adapter, read_adapter_config
from tensorpar.checkpoints.meta_checks import check_shards
from tensorpar.checkpoints.sharded import dense_model_state, is_checkpoint, read_meta, resolve
from tensorpar.data.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer, tokenizer_folder
from tensorpar.data.tokenizer_files import source_files
from tensorpar.errors import TensorparError
from tensorpar.models.config import ModelConfig
from tensorpar.tensor_parallel.lora import LoraSpec, is_adapter


def _check_folder(path: str) -> None:
    if not os.path.exists(path):
        raise TensorparError(f"checkpoint '{path}' does not exist")
    if not os.path.isdir(path):
        raise TensorparError(f"checkpoint '{path}' is not a directory")


def load_config(path: str):
    """The ModelConfig of a checkpoint folder, reading only its config (cheap: for checks before launching)."""
    _check_folder(path)
    if is_checkpoint(path):
        step_dir, meta = read_meta(path, verify=False)
        check_shards(step_dir, meta, checksums=False)  # every shard there, at its size (the ranks check the SHA-256)
        return ModelConfig(**meta["model"])
    config = os.path.join(path, "config.json")
    if is_hf_folder(path) or (os.path.isfile(config) and any(n.endswith(".safetensors") for n in os.listdir(path))):
        try:
            with open(config) as f:
                hf = json.load(f)
        except (OSError, ValueError) as e:
            raise TensorparError(f"'{config}' is not readable JSON: {e}") from None
        try:
            # a model type it does not support: named, with the supported ones
            config_from_hf(hf)
        except TensorparError as e:
            raise TensorparError(f"{config}: {e}") from None
        return check_hf_folder(path)  # every weight file's header: names, shapes, dtypes, the file complete
    if os.path.isfile(config) and other_weight_files(Path(path)):
        raise no_safetensors_error(Path(path))
    raise TensorparError(
        f"checkpoint '{path}' is not a Hugging Face model folder (config.json with model_type "
        f"{', '.join(SUPPORTED_MODEL_TYPES)}, "
        f"and *.safetensors weights) nor a tensorpar checkpoint (meta.json, or a 'latest' file)"
    )


def _saved_lora(meta: dict) -> LoraSpec | None:
    return LoraSpec.from_dict(meta["lora"]) if meta.get("lora") else None


def check_adapter(path: str, adapter: str | None) -> None:
    """Refuse, before any rank starts, a PEFT adapter folder (`--lora-adapter`; None: none) that the model of `path`
    cannot take: an unreadable or unsupported adapter config, adapters on linears the model has not, or a LoRA run's
    checkpoint, which holds adapters of its own."""
    if adapter is None:
        return
    cfg = load_config(path)
    check_lora_model(cfg, read_adapter_config(adapter))
    read_adapter(adapter, cfg)  # every adapter the config names, at the model's shapes
    if is_checkpoint(path) and _saved_lora(read_meta(path, verify=False)[1]) is not None:
        raise TensorparError(f"'{path}' holds LoRA adapters already (a LoRA run's checkpoint): --lora-adapter would "
                             f"add a second set; merge them first (tensorpar convert --merge-lora)")


def load_unmerged(path: str, adapter: str | None = None) -> tuple[ModelConfig, dict, LoraSpec | None, dict]:
    """(ModelConfig, the base weights, the LoRA spec or None, the adapters' weights) of a checkpoint folder and, with
    `adapter`, a PEFT adapter folder of its model (a checkpoint holding adapters of its own takes none more); dense
    tensors in tensorpar names."""
    load_config(path)
    if is_checkpoint(path):
        meta, state = dense_model_state(path)
        cfg, spec = ModelConfig(**meta["model"]), _saved_lora(meta)
    else:
        (cfg, state), spec = load_hf_folder(path), None
    if adapter is not None:
        check_adapter(path, adapter)
        spec, adapters = read_adapter(adapter, cfg)
        state = {**state, **adapters}
    base = {k: v for k, v in state.items() if not is_adapter(k)}
    return cfg, base, spec, {k: v for k, v in state.items() if is_adapter(k)}


def load_model_source(path: str, adapter: str | None = None):
    """(ModelConfig, dense state dict in tensorpar names) of a checkpoint folder, LoRA adapters (a LoRA run's, or
    the PEFT folder `adapter`) merged into the weights."""
    cfg, base, spec, adapters = load_unmerged(path, adapter)
    return cfg, (merge_adapters({**base, **adapters}, spec) if spec is not None else base)


def checkpoint_tokenizer(path: str, cfg: ModelConfig):
    """The tokenizer a checkpoint folder was made with, to export with it: the files it carries (a Hugging Face
    folder's, or those a run copied into its checkpoint), else the byte tokenizer when the checkpoint says it was
    trained with it (or, from before checkpoints said, when its vocabulary is the byte tokenizer's) and its
    vocabulary holds the byte tokenizer's ids (its end-of-text id 256 included: a config.json naming an id outside
    the embedding does not load in transformers); None when unknown."""
    if is_hf_folder(path) or not is_checkpoint(path):
        tokenizer = load_tokenizer(path)
        return tokenizer if isinstance(tokenizer, HFTokenizer) else None
    step_dir = resolve(path)
    if os.path.isfile(os.path.join(step_dir, "tokenizer.json")):
        return HFTokenizer(step_dir)
    meta = read_meta(step_dir, verify=False)[1]
    byte = meta.get("tokenizer", "byte" if cfg.vocab_size == ByteTokenizer.vocab_size else None) == "byte"
    return ByteTokenizer() if byte and cfg.vocab_size >= ByteTokenizer.vocab_size else None


def tokenizer_unknown(path: str) -> bool:
    """True when the model at `path` has no tokenizer tensorpar reads and does not say it is the byte tokenizer's: a
    Hugging Face folder without tokenizer.json, or a tensorpar checkpoint carrying no tokenizer files whose meta.json
    says the tokenizer is unknown (a run on token ids without --tokenizer, a folder of the first kind converted).
    Text given to it would be tokenized as bytes, which its vocabulary does not mean."""
    if os.path.isfile(os.path.join(tokenizer_folder(path), "tokenizer.json")):  # where `load_tokenizer` reads it
        return False
    if is_hf_folder(path):
        return True
    return is_checkpoint(path) and read_meta(resolve(path), verify=False)[1].get("tokenizer") == "unknown"


def unknown_tokenizer_note(path: str) -> str:
    """Why the model at `path` (whose `tokenizer_unknown` holds) cannot take text, for a refusal or a warning."""
    why = (f"Hugging Face folder '{path}' holds no tokenizer.json (the tokenizer file tensorpar reads)"
           if is_hf_folder(path) else
           f"checkpoint '{path}' carries no tokenizer and says the tokenizer of its token ids is unknown")
    return f"{why}: text given to it would be tokenized as bytes, which its vocabulary does not mean"


def tokenizer_files(path: str) -> dict[str, str]:
    """name -> path of the tokenizer files of a model folder (a Hugging Face folder's tokenizer.json and the files
    beside it); {} when it has none."""
    return source_files(load_tokenizer(path))
