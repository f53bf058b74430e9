"""What --lora-rank, --lora-alpha, --lora-targets, --lora-dropout and --lora-adapter make of a training run: its
`LoraSpec`, checked against the model, the optimizer and the checkpoint it resumes before any rank starts."""

from __future__ import annotations

import dataclasses

from tensorpar.checkpoints.peft_adapter import check_lora_model, read_adapter, read_adapter_config
from tensorpar.config.lora_options import LoraOptions
from tensorpar.config.options import TrainOptions
from tensorpar.errors import TensorparError
from tensorpar.models.config import ModelConfig
from tensorpar.tensor_parallel.lora import LoraSpec, shape_flags_given

_DEFAULTS = LoraOptions()


def _from_adapter(o: TrainOptions, cfg: ModelConfig) -> LoraSpec:
    """The spec of the PEFT adapter --lora-adapter continues (its --lora-dropout may be changed); its tensors are
    checked against the model here, once."""
    if not o.init_from:
        raise TensorparError("--lora-adapter continues an adapter of the model --init-from names: give --init-from "
                             "with the base model it was trained on")
    spec = read_adapter_config(o.lora_adapter)
    check_lora_model(cfg, spec)
    read_adapter(o.lora_adapter, cfg)
    asked = LoraSpec.parse(o.lora_rank or spec.rank, o.lora_alpha if o.lora_alpha is not None else spec.alpha,
                           o.lora_targets if o.lora_targets != _DEFAULTS.lora_targets else ",".join(spec.targets),
                           spec.dropout)
    if (asked.rank, asked.alpha, asked.targets) != (spec.rank, spec.alpha, spec.targets):
        raise TensorparError(f"--lora-adapter '{o.lora_adapter}' has rank {spec.rank}, alpha {spec.alpha:g} and "
                             f"targets {','.join(spec.targets)}: drop --lora-rank, --lora-alpha and --lora-targets "
                             f"or give those")
    given = shape_flags_given(o)
    return dataclasses.replace(spec, dropout=o.lora_dropout if "--lora-dropout" in given else spec.dropout)


def lora_spec(o: TrainOptions, cfg: ModelConfig, resume_meta: dict | None) -> LoraSpec | None:
    """The run's adapters (None: every weight trains), refusing what cannot run with one line naming it: flags
    without --lora-rank, a model or optimizer adapters do not fit, a checkpoint saved with other adapters."""
    if o.lora_rank < 0:
        raise TensorparError(f"--lora-rank must be 0 (no adapters) or at least 1, got {o.lora_rank}")
    spec = _from_adapter(o, cfg) if o.lora_adapter else LoraSpec.of_options(o)
    if resume_meta is not None:
        saved = LoraSpec.from_dict(resume_meta["lora"]) if resume_meta.get("lora") else None
        shape = lambda s: None if s is None else (s.rank, s.alpha, s.targets)  # noqa: E731
        if shape(saved) != shape(spec):
            was = "no LoRA adapters" if saved is None else (
                f"LoRA adapters (--lora-rank {saved.rank} --lora-alpha {saved.alpha:g} --lora-targets "
                f"{','.join(saved.targets)})")
            raise TensorparError(f"checkpoint '{o.resume}' was trained with {was}: resume it with the same flags")
    if spec is not None:
        check_lora_model(cfg, spec)
        if o.optimizer == "muon":
            raise TensorparError("--optimizer muon orthogonalises whole weight matrices, and LoRA trains low-rank "
                                 "factors (r x in, out x r) of them instead: use --optimizer adamw with --lora-rank")
    return spec
