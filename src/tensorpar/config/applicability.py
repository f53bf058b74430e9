"""Options that mean something only beside others: one given where it cannot apply is refused, naming what it
needs, instead of being silently ignored (`--fp8-recipe rowwise` on an fp32 run would otherwise train in fp32 while
its user believes it trains in fp8).

An option counts as given when its value differs from its default: options reach a command from flags, a --config
file or Python, and a default value changes nothing (a run's resolved config.toml holds every field, and must load
again). Each rule is (option, when it applies, what it needs). Options checked elsewhere with their own messages
are not repeated here: the LoRA shape without --lora-rank (`tensorpar.training.adapters`), --ep and --expert-tp on a
dense model (`tensorpar.layout.rules`), --save-every and --async-save without --save, --wandb-run without --wandb.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Callable

from tensorpar.config.fields import cli_specs
from tensorpar.errors import TensorparError


@dataclasses.dataclass(frozen=True)
class Needs:
    option: str  # the field
    applies: Callable  # (options, model config) -> whether the field can have an effect
    needs: str  # what it needs, as the user writes it


def _moe(o, cfg) -> bool:
    return cfg is not None and cfg.is_moe


def _may_hold(*suffixes: str) -> Callable:
    """Whether --data (or --val-data) may name a file ending in one of `suffixes` (a mixture file or a folder may
    hold one)."""
    def check(o, cfg) -> bool:
        parts = f"{o.data or ''} {getattr(o, 'val_data', None) or ''}".split()
        return any(p.endswith((*suffixes, ".toml")) or os.path.isdir(p) for p in parts)
    return check


RULES = (
    Needs("fp8_recipe", lambda o, cfg: o.dtype == "fp8", "--dtype fp8"),
    Needs("loss_scale", lambda o, cfg: o.dtype == "fp16", "--dtype fp16 (its dynamic loss scaling)"),
    Needs("loss_scale_window", lambda o, cfg: o.dtype == "fp16", "--dtype fp16 (its dynamic loss scaling)"),
    Needs("on_nan", lambda o, cfg: o.dtype != "fp16", "fp32, bf16 or fp8 (fp16's loss scale skips its overflowed "
                                                      "steps itself)"),
    Needs("decay_fraction", lambda o, cfg: o.lr_schedule == "wsd", "--lr-schedule wsd"),
    Needs("decay_shape", lambda o, cfg: o.lr_schedule == "wsd", "--lr-schedule wsd"),
    Needs("muon_momentum", lambda o, cfg: o.optimizer == "muon", "--optimizer muon"),
    Needs("expert_gemm", _moe, "a mixture-of-experts model"),
    Needs("sequence_parallel", lambda o, cfg: o.tp > 1, "--tp 2 or more (it shards along the sequence what the TP "
                                                        "ranks would otherwise all hold)"),
    Needs("tp_overlap", lambda o, cfg: o.tp > 1, "--tp 2 or more (there is no TP collective to overlap)"),
    Needs("schedule", lambda o, cfg: o.pp > 1, "--pp 2 or more"),
    Needs("virtual_stages", lambda o, cfg: o.pp > 1, "--pp 2 or more"),
    Needs("pipeline_layers", lambda o, cfg: o.pp > 1, "--pp 2 or more"),
    Needs("cp_impl", lambda o, cfg: o.cp > 1, "--cp 2 or more"),
    Needs("cp_split", lambda o, cfg: o.cp > 1, "--cp 2 or more"),
    Needs("zero3_reshard_after_forward", lambda o, cfg: o.zero == 3, "--zero 3"),
    Needs("bucket_mb", lambda o, cfg: o.zero != 3, "--zero 0, 1 or 2 (ZeRO-3 reduces each block's gradients as "
                                                   "they come)"),
    Needs("bin_dtype", _may_hold(".bin"), "a raw .bin token file in --data (a Megatron .idx names its own dtype)"),
    Needs("text_field", _may_hold(".jsonl", ".jsonl.gz", ".parquet"), "JSONL, Parquet or a datasets folder in "
                                                                       "--data"),
    Needs("document_attention", lambda o, cfg: o.document_mask, "--document-mask"),
    Needs("keep_last", lambda o, cfg: bool(o.save), "--save DIR"),
    Needs("world_size", lambda o, cfg: o.dry_run, "--dry-run"),
    Needs("rank", lambda o, cfg: o.dry_run, "--dry-run"),
    Needs("sample_prompt", lambda o, cfg: o.sample_tokens > 0, "--sample-tokens N"),
)


def _shown(spec, value) -> str:
    if spec.kind is bool:
        return spec.flag
    return f"{spec.flag} {','.join(map(str, value)) if isinstance(value, list) else value}"


def check_applicable(options, cfg=None) -> None:
    """Refuse the first option of `options` that is given (not its default) where it cannot apply. `cfg`: the
    model's config, for the rules about the model (None: those are not checked)."""
    specs = {s.name: s for s in cli_specs(type(options))}
    for rule in RULES:
        spec = specs.get(rule.option)
        if spec is None or getattr(options, rule.option) == spec.default:
            continue
        if rule.applies is _moe and cfg is None:
            continue
        if not rule.applies(options, cfg):
            raise TensorparError(f"{_shown(spec, getattr(options, rule.option))} needs {rule.needs}; it would have "
                                 f"no effect here: drop it")
