"""PEFT LoRA adapter folders: what a LoRA run writes beside each checkpoint, and what --lora-adapter reads.

    adapter_config.json          PEFT's LoraConfig: r, lora_alpha, target_modules (q_proj, ..., down_proj),
                                 lora_dropout, task_type CAUSAL_LM
    adapter_model.safetensors    base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight [r, in],
                                 ....lora_B.weight [out, r], for every layer and target (fp32)

`peft.PeftModel.from_pretrained(model, folder)` loads it onto the transformers model of the base (LlamaForCausalLM,
Qwen2, Mixtral's attention...); scaling = lora_alpha / r, as tensorpar's. `merge_adapters` folds adapters into their
base weights as PEFT's `merge_and_unload` does: W + (B @ A) * scaling.

Read adapters must be plain LoRA on every layer: DoRA, rsLoRA, LoRA biases, per-module ranks, a subset of the
layers, modules_to_save or a regex target are refused, naming the field.
"""

from __future__ import annotations

import json
import os

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from tensorpar.checkpoints.hf import hf_linear_names
from tensorpar.checkpoints.hf_families import family_of
from tensorpar.config.choices import LORA_TARGETS
from tensorpar.distributed.sharding import shard_spec
from tensorpar.errors import TensorparError
from tensorpar.models.config import ModelConfig
from tensorpar.models.placement import Placement
from tensorpar.models.state import dense_shape
from tensorpar.models.transformer import Transformer
from tensorpar.tensor_parallel.lora import LoraSpec, is_adapter

CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
ADAPTER_FOLDER = "adapter"  # a LoRA run's checkpoint holds its adapters as a PEFT folder there
PREFIX = "base_model.model."  # PEFT's names: the PeftModel's base_model (a LoraModel) holds the transformers model
PEFT_MODULES = {t: f"{t}_proj" for t in LORA_TARGETS}  # --lora-targets name -> the linear's name in transformers
# adapter_config.json fields of LoRA variants tensorpar does not compute: (field, the value plain LoRA has)
_PLAIN = (("use_dora", False), ("use_rslora", False), ("bias", "none"), ("lora_bias", False),
          ("fan_in_fan_out", False), ("modules_to_save", None), ("rank_pattern", {}), ("alpha_pattern", {}),
          ("layers_to_transform", None), ("layers_pattern", None), ("target_parameters", None),
          ("exclude_modules", None), ("layer_replication", None), ("trainable_token_indices", None),
          ("alora_invocation_tokens", None), ("use_qalora", False), ("use_bdlora", None), ("arrow_config", None),
          ("monteclora_config", None), ("kasa_config", None), ("velora_config", None))


def check_lora_model(cfg: ModelConfig, spec: LoraSpec) -> None:
    """Refuse adapters a model cannot carry, with the reason: GPT-2's Conv1D layers and fused q/k/v (c_attn), latent
    attention's projections, Phi-3's fused q/k/v and gate/up, and the routed experts of mixture-of-experts layers."""
    if cfg.family == "gpt2":
        raise TensorparError("LoRA needs a Llama-style model (q/k/v/o and gate/up/down linears, as PEFT adapts Llama, "
                             "Qwen, Mistral, Gemma); this model is of the gpt2 family, whose q, k and v are one fused "
                             "Conv1D")
    if cfg.is_mla:
        raise TensorparError("LoRA on latent attention (DeepSeek-V3, GLM-4.5: q_a_proj, kv_a_proj_with_mqa, ...) is "
                             "not supported: tensorpar's adapters sit on q/k/v/o and gate/up/down linears")
    if cfg.family == "glm4_moe":
        raise TensorparError("LoRA on GLM-4.5 (glm4_moe) is not supported: tensorpar writes and reads PEFT adapters "
                             "for the Llama-style families (Llama, Mistral, Qwen, Gemma, Phi-3, OLMo 2, their MoEs)")
    fused = [t for t in spec.targets if t in ("q", "k", "v", "gate", "up")]
    if family_of(cfg).fused and fused:
        raise TensorparError(f"LoRA on {cfg.family}'s fused projections (--lora-targets {','.join(fused)}): PEFT adapts "
                             f"its qkv_proj and gate_up_proj whole, with one A for the parts, which tensorpar's "
                             f"per-projection adapters are not; use --lora-targets o,down")
    mlp = [t for t in spec.targets if t in ("gate", "up", "down")]
    if cfg.is_moe and mlp:
        raise TensorparError(f"LoRA on mixture-of-experts MLPs (--lora-targets {','.join(mlp)}) is not supported: "
                             f"the routed experts are stacked weights, which PEFT adapts through target_parameters "
                             f"and tensorpar does not yet; use --lora-targets q,k,v,o"
                             + (" (the default targets every linear)" if set(spec.targets) == set(LORA_TARGETS) else ""))


def adapter_shapes(cfg: ModelConfig, spec: LoraSpec) -> dict[str, tuple[int, ...]]:
    """{tensorpar name: dense shape} of the adapters `spec` puts on `cfg` (from a model built on the meta device)."""
    model = Transformer(cfg, Placement.on(None, device="meta", lora=spec), init=False)
    return {n: dense_shape(p, shard_spec(p)) for n, p in model.named_parameters() if is_adapter(n)}


def peft_names(cfg: ModelConfig, spec: LoraSpec) -> dict[str, str]:
    """{tensorpar name: PEFT name} of every adapter factor `spec` puts on `cfg`."""
    check_lora_model(cfg, spec)
    linears = hf_linear_names(cfg)
    out = {}
    for name in adapter_shapes(cfg, spec):
        module, factor = name.rsplit(".", 2)[:2]
        out[name] = f"{PREFIX}{linears[module + '.weight'][: -len('weight')]}{factor}.weight"
    return out


def write_adapter(folder: str, cfg: ModelConfig, spec: LoraSpec, state: dict[str, torch.Tensor],
                  base_model: str | None = None) -> str:
    """Write `state` (the adapters' dense tensors, tensorpar names) as a PEFT adapter folder; its path."""
    names = peft_names(cfg, spec)
    missing = sorted(set(names) - set(state))
    if missing:
        raise TensorparError(f"the adapter state lacks {missing[:3]}")
    os.makedirs(folder, exist_ok=True)
    tensors = {names[n]: state[n].detach().float().contiguous().cpu() for n in names}
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
              "r": spec.rank, "lora_alpha": spec.alpha, "lora_dropout": spec.dropout,
              "target_modules": [PEFT_MODULES[t] for t in spec.targets], "init_lora_weights": True,
              "inference_mode": True, **dict(_PLAIN)}
    save_file(tensors, os.path.join(folder, WEIGHTS_FILE), metadata={"format": "pt"})
    with open(os.path.join(folder, CONFIG_FILE), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
        f.write("\n")
    return folder


def write_checkpoint_adapter(step_dir: str, meta: dict, dense) -> str | None:
    """A LoRA run's adapters (`meta["lora"]`) as a PEFT folder in its checkpoint's step folder, `adapter/`, their dense
    tensors read from the shards by `dense(name)`; None (nothing written) for a checkpoint without adapters."""
    if not meta.get("lora"):
        return None
    cfg, spec = ModelConfig(**meta["model"]), LoraSpec.from_dict(meta["lora"])
    state = {name: dense(name) for name in adapter_shapes(cfg, spec)}
    base = (meta.get("options") or {}).get("init_from")
    return write_adapter(os.path.join(step_dir, ADAPTER_FOLDER), cfg, spec, state, base)


def _targets(modules, path: str) -> tuple[str, ...]:
    """--lora-targets of PEFT's target_modules: "all-linear", or names that end in q_proj, ..., down_proj (PEFT
    matches them as suffixes, and saves "all-linear" as every module's full name); that every layer has them is
    checked against the weights (`read_adapter`)."""
    if modules == "all-linear":
        return LORA_TARGETS
    by_module = {m: t for t, m in PEFT_MODULES.items()}
    names = [m.rsplit(".", 1)[-1] for m in modules] if isinstance(modules, list) else None
    if not names or not all(isinstance(m, str) for m in modules) or not all(n in by_module for n in names):
        raise TensorparError(f"'{path}': target_modules {modules!r} is not a list of {', '.join(by_module)} (nor "
                             f"\"all-linear\")")
    return tuple(t for t in LORA_TARGETS if PEFT_MODULES[t] in names)


def read_adapter_config(folder: str) -> LoraSpec:
    """The LoraSpec of a PEFT adapter folder (its adapter_config.json alone), refusing what tensorpar cannot
    compute."""
    path = os.path.join(folder, CONFIG_FILE)
    try:
        with open(path) as f:
            config = json.load(f)
    except FileNotFoundError:
        raise TensorparError(f"--lora-adapter '{folder}' is not a PEFT adapter folder: no {CONFIG_FILE}") from None
    except (OSError, ValueError) as e:
        raise TensorparError(f"'{path}' is not readable JSON: {e}") from None
    if not isinstance(config, dict) or config.get("peft_type") != "LORA":
        raise TensorparError(f"'{path}' is not a LoRA adapter (peft_type {config.get('peft_type')!r}, "
                             f"expected 'LORA')" if isinstance(config, dict) else f"'{path}' is not a JSON object")
    for field, plain in _PLAIN:
        value = config.get(field, plain)
        if value != plain and not (plain is None and value in ({}, [])) and not (plain == {} and value is None):
            raise TensorparError(f"'{path}': {field} = {value!r} is not supported (tensorpar computes plain LoRA on "
                                 f"every layer: {field} = {plain!r})")
    try:
        return LoraSpec(int(config["r"]), float(config["lora_alpha"]), _targets(config.get("target_modules"), path),
                        float(config.get("lora_dropout") or 0.0))
    except (KeyError, TypeError, ValueError) as e:
        raise TensorparError(f"'{path}': {type(e).__name__}: {e} (r, lora_alpha and target_modules are needed)") \
            from None


def read_adapter(folder: str, cfg: ModelConfig) -> tuple[LoraSpec, dict[str, torch.Tensor]]:
    """(its spec, its tensors in tensorpar names) of a PEFT adapter folder of the model `cfg`: every adapter the
    config names present, at the model's shapes."""
    spec = read_adapter_config(folder)
    path = os.path.join(folder, WEIGHTS_FILE)
    try:
        stored = load_file(path)
    except (OSError, SafetensorError) as e:
        raise TensorparError(f"cannot read the adapter weights '{path}': {e}") from None
    names, shapes = peft_names(cfg, spec), adapter_shapes(cfg, spec)
    # PEFT saves names without the adapter's name ("default"); an older layout may keep it
    stored = {k.replace(".default.weight", ".weight"): v for k, v in stored.items()}
    missing = [peft for peft in names.values() if peft not in stored]
    unexpected = sorted(set(stored) - set(names.values()))
    if missing or unexpected:
        raise TensorparError(f"'{path}' does not match the model and {CONFIG_FILE}: missing {missing[:3]}, "
                             f"unexpected {unexpected[:3]}")
    state = {}
    for name, peft in names.items():
        if tuple(stored[peft].shape) != shapes[name]:
            raise TensorparError(f"'{path}': '{peft}' has shape {tuple(stored[peft].shape)}, the model expects "
                                 f"{shapes[name]}")
        state[name] = stored[peft]
    return spec, state


def merge_adapters(state: dict[str, torch.Tensor], spec: LoraSpec) -> dict[str, torch.Tensor]:
    """`state` (dense, tensorpar names) with each adapter folded into its base weight and the adapters dropped: PEFT's
    merge, W + ((B @ A) * scaling) with the product in the adapter's dtype (fp32 as saved) and the sum in W's."""
    merged = {k: v for k, v in state.items() if not is_adapter(k)}
    for name in state:
        if name.endswith(".lora_A.weight"):
            module = name[: -len(".lora_A.weight")]
            w, a, b = merged[module + ".weight"], state[name], state[module + ".lora_B.weight"]
            merged[module + ".weight"] = w + ((b @ a) * spec.scaling).to(w.dtype)
    return merged
