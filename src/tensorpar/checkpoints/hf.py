"""Hugging Face checkpoints (GPT-2; the Llama-style families of `tensorpar.checkpoints.hf_families`: Llama, Mistral,
Qwen2, Qwen3, Gemma 2 and 3, Phi-3, OLMo 2; Mixtral, Qwen2-MoE and Qwen3-MoE; safetensors) to and from tensorpar's
dense state dicts (the experts of MoE layers: `tensorpar.checkpoints.hf_moe`; DeepSeek-V3 and GLM-4.5, their
routers' balancing biases and multi-token prediction modules: `tensorpar.checkpoints.hf_deepseek`).

Configs are mapped by `tensorpar.checkpoints.hf_config`.

    is_hf_folder(path)               does `path` look like a folder of a supported model type?
    hf_to_tensorpar(hf_state, cfg)   Hugging Face tensor names -> tensorpar's dense names
    tensorpar_to_hf(state, cfg)      the inverse (bit-exact round trip)
    load_hf_folder(path)             (ModelConfig, dense state dict), ready for `load_full_state_dict`
    save_hf_folder(path, cfg, state) config.json + model.safetensors

GPT-2 stores its linears as Conv1D, [in, out]; tensorpar (like nn.Linear and Llama) keeps [out, in],
so GPT-2 weights are transposed, and the fused query/key/value matrix `c_attn` is split into
q_proj, k_proj and v_proj. The Llama-style families' names map one to one (their checkpoints already use the
rotate-half RoPE convention tensorpar uses), their norms by where they sit (`hf_families.layer_pairs`), and
Phi-3's fused qkv_proj and gate_up_proj are split on load and fused again on export. Tied models may or may not store `lm_head.weight`:
a stored copy equal to the embedding is ignored, one that differs is refused (transformers 5 would leave the two
untied), and none is written for them.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Callable

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from tensorpar.checkpoints.hf_config import SUPPORTED_MODEL_TYPES, check_representable, config_from_hf, config_to_hf
from tensorpar.checkpoints.hf_deepseek import deepseek_from_hf, deepseek_to_hf, held_mtp_layers, is_mtp_copy
from tensorpar.checkpoints.hf_deepseek_config import DEEPSEEK_MODEL_TYPES
from tensorpar.checkpoints.hf_families import fuse, layer_pairs, unfuse
from tensorpar.checkpoints.hf_moe import experts_from_hf, experts_to_hf, moe_layer_pairs, unfuse_experts
from tensorpar.data.tokenizer_files import special_token_ids, write_tokenizer
from tensorpar.distributed.sharding import shard_spec
from tensorpar.errors import TensorparError
from tensorpar.models.config import ModelConfig
from tensorpar.models.state import dense_shape, model_state
from tensorpar.models.placement import Placement
from tensorpar.models.transformer import Transformer

INDEX_FILE = "model.safetensors.index.json"
WEIGHTS_FILE = "model.safetensors"
_GPT2_PREFIX, _LLAMA_PREFIX = "transformer.", "model."
# Buffers some checkpoints carry that are not parameters: GPT-2's causal masks, old Llama's inv_freq.
_IGNORED = {
    "gpt2": re.compile(r"^transformer\.h\.\d+\.attn\.(bias|masked_bias)$"),
    "llama": re.compile(r"^model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq$"),
}


# -- names ----------------------------------------------------------------------------------------


def _dense_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """tensorpar's dense parameter names and shapes for `cfg`, from a model built on the meta device."""
    model = Transformer(cfg, Placement.on(None, device="meta"), init=False)
    return {name: dense_shape(p, shard_spec(p)) for name, p in model_state(model).items()}


def _hf_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The Hugging Face tensor names and shapes for `cfg` (what `tensorpar_to_hf` writes)."""
    meta = {name: torch.empty(shape, device="meta") for name, shape in _dense_shapes(cfg).items()}
    return {name: tuple(t.shape) for name, t in tensorpar_to_hf(meta, cfg).items() if not is_mtp_copy(name, cfg)}


def _canonical(name: str, family: str) -> str:
    """Add the base-model prefix (`transformer.` / `model.`) that checkpoints of bare base models leave out."""
    if name == "lm_head.weight":
        return name
    prefix = _GPT2_PREFIX if family == "gpt2" else _LLAMA_PREFIX
    return name if name.startswith(prefix) else prefix + name


def _gpt2_layer_names(i: int) -> list[tuple[str, str]]:
    """(Hugging Face name, tensorpar name) pairs that map one to one (after a transpose for Conv1D weights)."""
    h, t = f"{_GPT2_PREFIX}h.{i}.", f"layers.{i}."
    return [
        (h + "ln_1.weight", t + "attn_norm.weight"), (h + "ln_1.bias", t + "attn_norm.bias"),
        (h + "attn.c_proj.weight", t + "attn.o_proj.weight"), (h + "attn.c_proj.bias", t + "attn.o_proj.bias"),
        (h + "ln_2.weight", t + "mlp_norm.weight"), (h + "ln_2.bias", t + "mlp_norm.bias"),
        (h + "mlp.c_fc.weight", t + "mlp.up_proj.weight"), (h + "mlp.c_fc.bias", t + "mlp.up_proj.bias"),
        (h + "mlp.c_proj.weight", t + "mlp.down_proj.weight"), (h + "mlp.c_proj.bias", t + "mlp.down_proj.bias"),
    ]


def _llama_pairs(cfg: ModelConfig) -> list[tuple[str, str]]:
    """(Hugging Face name, tensorpar name) pairs of a Llama-style family's tensors (Phi-3's q, k, v, gate and up
    unfused), its routed experts aside."""
    pairs = [(f"{_LLAMA_PREFIX}embed_tokens.weight", "embed.weight"),
             (f"{_LLAMA_PREFIX}norm.weight", "final_norm.weight")]
    for i in range(cfg.num_layers):
        pairs += layer_pairs(cfg, i)
        if cfg.is_moe_layer(i):
            pairs += moe_layer_pairs(cfg, i)
    if not cfg.tie_embeddings:
        pairs.append(("lm_head.weight", "head.weight"))
    return pairs


def hf_linear_names(cfg: ModelConfig) -> dict[str, str]:
    """{tensorpar name: Hugging Face name} of a Llama-style model's attention and dense MLP weights (`q_proj`, ...,
    `down_proj`; Phi-3's as if unfused): what a PEFT adapter's names are made of. {} for GPT-2."""
    return {} if cfg.family == "gpt2" else {tp: hf for hf, tp in _llama_pairs(cfg) if tp.endswith("_proj.weight")}


def tensorpar_to_hf(state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """tensorpar's dense state dict -> the Hugging Face tensors of its family (full names, no lm_head for tied
    embeddings). Bit-exact inverse of `hf_to_tensorpar`."""
    check_representable(cfg)
    expected = set(_dense_shapes(cfg))
    missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
    if missing or unexpected:
        raise TensorparError(f"tensorpar state dict does not match the {cfg.family} config: missing {missing[:5]}"
                             f"{'...' if len(missing) > 5 else ''}, unexpected {unexpected[:5]}"
                             f"{'...' if len(unexpected) > 5 else ''}")
    if cfg.family in DEEPSEEK_MODEL_TYPES:
        return deepseek_to_hf(state, cfg)
    if cfg.family != "gpt2":
        out = {hf: state[tp] for hf, tp in _llama_pairs(cfg)}
        for i in filter(cfg.is_moe_layer, range(cfg.num_layers)):
            out.update(experts_to_hf(state, cfg, i))
        return fuse(out, cfg)
    out = {f"{_GPT2_PREFIX}wte.weight": state["embed.weight"], f"{_GPT2_PREFIX}wpe.weight": state["pos_embed"]}
    for i in range(cfg.num_layers):
        t, h = f"layers.{i}.attn.", f"{_GPT2_PREFIX}h.{i}.attn.c_attn."
        qkv = ("q_proj", "k_proj", "v_proj")
        out[h + "weight"] = torch.cat([state[t + p + ".weight"] for p in qkv]).t().contiguous()
        out[h + "bias"] = torch.cat([state[t + p + ".bias"] for p in qkv])
        for hf, tp in _gpt2_layer_names(i):
            out[hf] = state[tp].t().contiguous() if hf.endswith(("c_proj.weight", "c_fc.weight")) else state[tp]
    out[f"{_GPT2_PREFIX}ln_f.weight"] = state["final_norm.weight"]
    out[f"{_GPT2_PREFIX}ln_f.bias"] = state["final_norm.bias"]
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = state["head.weight"]
    return out


def _names(names, limit: int = 5) -> str:
    names = sorted(names)
    return ", ".join(names[:limit]) + (f", ... ({len(names)} in all)" if len(names) > limit else "")


_SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                       "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
                       "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
WEIGHT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)  # what a checkpoint's weights may be


def _check_tied_head(head, state: dict, family: str, where: Callable[[str], str]) -> None:
    """Tied embeddings with a stored `lm_head.weight` unlike the embedding: transformers then keeps the two untied,
    so reading the embedding as the head would compute another model; refused."""
    embed = state.get(f"{_GPT2_PREFIX}wte.weight" if family == "gpt2" else f"{_LLAMA_PREFIX}embed_tokens.weight")
    if head is None or embed is None or head.is_meta or embed.is_meta:  # a header check has no values to compare
        return
    if head.shape != embed.shape or not torch.equal(head, embed):
        raise TensorparError(f"{where('lm_head.weight')}: config.json sets tie_word_embeddings = true but "
                             f"'lm_head.weight' differs from the input embedding (transformers then keeps the two "
                             f"untied): set tie_word_embeddings to false in config.json")


def _check_tensors(state: dict, shapes: dict, origin: dict, where: Callable[[str], str]) -> None:
    """Refuse a tensor of another shape than the config's, or not of a floating-point dtype (copied into a
    parameter, an integer would be cast without a word)."""
    for key, shape in shapes.items():
        if tuple(state[key].shape) != shape:
            raise TensorparError(f"{where(origin[key])}: tensor '{origin[key]}' has shape {tuple(state[key].shape)}, "
                                 f"the config expects {shape}")
        if state[key].dtype not in WEIGHT_DTYPES:
            raise TensorparError(f"{where(origin[key])}: tensor '{origin[key]}' is {str(state[key].dtype)[6:]}; "
                                 f"weights must be float16, bfloat16, float32 or float64 (a quantized checkpoint needs "
                                 f"dequantizing first)")


def _to_tensorpar(hf_state: dict, cfg: ModelConfig, source: str, where: Callable[[str], str]) -> dict:
    check_representable(cfg)
    family = cfg.family
    state: dict[str, torch.Tensor] = {}
    origin: dict[str, str] = {}  # canonical name -> name as stored, for messages
    tied_head = None  # a tied model's stored lm_head.weight, which must equal the embedding
    for name, tensor in hf_state.items():
        key = _canonical(name, family)
        if key == "lm_head.weight" and cfg.tie_embeddings:
            tied_head = tensor
            continue
        if _IGNORED["gpt2" if family == "gpt2" else "llama"].match(key) or is_mtp_copy(key, cfg):
            continue
        if key in state:
            raise TensorparError(f"{source}: '{origin[key]}' and '{name}' are the same tensor under two names")
        state[key], origin[key] = tensor, name
    _check_tied_head(tied_head, state, family, where)
    if cfg.is_moe and family not in DEEPSEEK_MODEL_TYPES:
        unfuse_experts(state, origin, cfg)

    shapes = _hf_shapes(cfg)
    missing, unexpected = set(shapes) - set(state), set(state) - set(shapes)
    if missing:
        raise TensorparError(f"{source}: tensors missing for the config ({cfg.num_layers} layers, "
                             f"{'tied' if cfg.tie_embeddings else 'untied'} embeddings): {_names(missing)}")
    if unexpected:
        files = sorted({where(origin[k]) for k in unexpected})
        raise TensorparError(f"{', '.join(files)}: tensors the {family} config does not have: "
                             f"{_names(origin[k] for k in unexpected)}")
    _check_tensors(state, shapes, origin, where)

    if family in DEEPSEEK_MODEL_TYPES:
        return deepseek_from_hf(state, cfg, _dense_shapes(cfg))
    if family != "gpt2":
        state = unfuse(state, cfg)
        out = {tp: state[hf] for hf, tp in _llama_pairs(cfg)}
        for i in filter(cfg.is_moe_layer, range(cfg.num_layers)):
            out.update(experts_from_hf(state, cfg, i))
        return out
    out = {"embed.weight": state[f"{_GPT2_PREFIX}wte.weight"], "pos_embed": state[f"{_GPT2_PREFIX}wpe.weight"]}
    h = cfg.hidden_size
    for i in range(cfg.num_layers):
        p, t = f"{_GPT2_PREFIX}h.{i}.attn.c_attn.", f"layers.{i}.attn."
        weight = state[p + "weight"].t().contiguous()  # Conv1D [h, 3h] -> [3h, h], rows q | k | v
        for j, proj in enumerate(("q_proj", "k_proj", "v_proj")):
            out[f"{t}{proj}.weight"] = weight[j * h:(j + 1) * h]
            out[f"{t}{proj}.bias"] = state[p + "bias"][j * h:(j + 1) * h]
        for hf, tp in _gpt2_layer_names(i):
            out[tp] = state[hf].t().contiguous() if hf.endswith(("c_proj.weight", "c_fc.weight")) else state[hf]
    out["final_norm.weight"] = state[f"{_GPT2_PREFIX}ln_f.weight"]
    out["final_norm.bias"] = state[f"{_GPT2_PREFIX}ln_f.bias"]
    if not cfg.tie_embeddings:
        out["head.weight"] = state["lm_head.weight"]
    return out


def hf_to_tensorpar(hf_state: dict[str, torch.Tensor], cfg: ModelConfig,
                    source: str = "Hugging Face state dict") -> dict[str, torch.Tensor]:
    """Hugging Face tensors of a supported family -> tensorpar's dense state dict (for `load_full_state_dict`).

    Accepts names with or without the base-model prefix; ignores GPT-2's attention-mask buffers and,
    for tied embeddings, an `lm_head.weight` equal to the embedding (one that differs is refused). Missing, unknown or wrongly shaped tensors are errors.
    """
    return _to_tensorpar(hf_state, cfg, source, lambda name: source)


# -- folders --------------------------------------------------------------------------------------


def _read_json(path: Path, what: str):
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        raise TensorparError(f"{what} '{path}' does not exist") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise TensorparError(f"{what} '{path}' is not readable JSON: {e}") from None


def is_hf_folder(path) -> bool:
    """A directory with a supported (`SUPPORTED_MODEL_TYPES`) config.json and at least one *.safetensors file."""
    try:
        path = Path(path)
        if not path.is_dir() or not any(path.glob("*.safetensors")):
            return False
        with open(path / "config.json") as f:
            hf = json.load(f)
        return isinstance(hf, dict) and hf.get("model_type") in SUPPORTED_MODEL_TYPES
    except (OSError, UnicodeDecodeError, ValueError):
        return False


def _safetensors_files(folder: Path) -> list[Path]:
    index = folder / INDEX_FILE
    if index.exists():
        data = _read_json(index, "safetensors index")
        weight_map = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(weight_map, dict) or not weight_map:
            raise TensorparError(f"safetensors index '{index}' has no weight_map")
        files = [folder / name for name in sorted(set(weight_map.values()))]
        for file in files:
            if not file.is_file():
                raise TensorparError(f"'{file}', listed in '{index}', does not exist")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise no_safetensors_error(folder)
    return files


def other_weight_files(folder: Path) -> list[str]:
    """The weight files of a folder in formats tensorpar does not read (pytorch_model.bin, *.pt, *.pth)."""
    return sorted(p.name for p in folder.iterdir() if p.suffix in (".bin", ".pt", ".pth"))


def no_safetensors_error(folder: Path) -> TensorparError:
    """A Hugging Face folder without *.safetensors files, naming the weight files it has instead."""
    others = other_weight_files(folder)
    hint = (f" (found {', '.join(others)}: only safetensors checkpoints are supported; transformers' save_pretrained "
            f"writes them by default)") if others else ""
    return TensorparError(f"Hugging Face folder '{folder}' has no *.safetensors files{hint}")


def read_hf_config(path) -> ModelConfig:
    """The ModelConfig of a Hugging Face folder's config.json (`with_held_mtp_layers`)."""
    folder = Path(path)
    config_path = folder / "config.json"
    try:
        cfg = config_from_hf(_read_json(config_path, "Hugging Face config"))
    except TensorparError as e:
        raise TensorparError(f"{config_path}: {e}") from None
    return with_held_mtp_layers(cfg, folder)


def with_held_mtp_layers(cfg: ModelConfig, folder) -> ModelConfig:
    """`cfg` with as many multi-token prediction modules as the folder's weights hold (transformers saves none; their
    names are read, not the tensors)."""
    if not cfg.num_mtp_layers:
        return cfg
    names = []
    for file in _safetensors_files(Path(folder)):
        with safe_open(str(file), framework="pt") as f:
            names += list(f.keys())
    return cfg.replace(num_mtp_layers=held_mtp_layers(cfg, names))


def _header_tensors(file: str) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file as meta tensors of their stored shapes and dtypes: its header only."""
    out = {}
    with safe_open(file, framework="pt") as f:
        for name in f.keys():
            part = f.get_slice(name)
            dtype = _SAFETENSORS_DTYPES.get(part.get_dtype())
            if dtype is None:
                raise TensorparError(f"'{file}': tensor '{name}' has dtype {part.get_dtype()}, which tensorpar "
                                     f"cannot read")
            out[name] = torch.empty(part.get_shape(), dtype=dtype, device="meta")
    return out


def _read_folder(folder: Path, read: Callable[[str], dict]) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    if not folder.is_dir():
        raise TensorparError(f"Hugging Face folder '{folder}' does not exist" if not folder.exists()
                             else f"'{folder}' is not a folder (a Hugging Face checkpoint is a folder)")
    cfg = read_hf_config(folder)
    hf_state: dict[str, torch.Tensor] = {}
    where: dict[str, str] = {}
    for file in _safetensors_files(folder):
        try:
            tensors = read(str(file))
        except TensorparError:
            raise
        except Exception as e:  # noqa: BLE001 - safetensors raises its own error types for corrupt files
            detail = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise TensorparError(f"cannot read safetensors file '{file}' (truncated or corrupt?): {detail}") from None
        for name, tensor in tensors.items():
            if name in hf_state:
                raise TensorparError(f"tensor '{name}' is stored twice: in '{where[name]}' and '{file}'")
            hf_state[name], where[name] = tensor, str(file)
    state = _to_tensorpar(hf_state, cfg, f"Hugging Face folder '{folder}'", lambda name: f"'{where[name]}'")
    return cfg, state


def load_hf_folder(path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """(config, dense state dict in tensorpar's names) from a Hugging Face safetensors folder of a supported model
    type, single-file or sharded (`model.safetensors.index.json`). Tensors keep their stored dtype, on the CPU."""
    return _read_folder(Path(path), load_file)


def check_hf_folder(path) -> ModelConfig:
    """The config of a Hugging Face folder whose weights `load_hf_folder` would read, checked from the safetensors
    headers alone (names, shapes, dtypes, files complete): what the launcher runs before starting any rank, so
    that a damaged or mismatched folder is refused once. (Only a tied head's values are left to the load.)"""
    return _read_folder(Path(path), _header_tensors)[0]


def save_hf_folder(path, cfg: ModelConfig, dense_state: dict[str, torch.Tensor], tokenizer=None) -> None:
    """Write `dense_state` (tensorpar names, e.g. from `full_state_dict`) as a Hugging Face folder: config.json (its
    family's architecture) and model.safetensors; with `tokenizer` (a ByteTokenizer or an HFTokenizer), its files
    too (`tensorpar.data.tokenizer_files.write_tokenizer`: tokenizer.json, tokenizer_config.json,
    generation_config.json, ...), whose special token ids config.json names."""
    folder = Path(path)
    if folder.exists() and not folder.is_dir():
        raise TensorparError(f"'{folder}' exists and is not a folder")
    hf_state = tensorpar_to_hf(dense_state, cfg)
    if folder.is_dir():
        stale = [p.name for p in folder.glob("*.safetensors") if p.name != WEIGHTS_FILE]
        stale += [INDEX_FILE] if (folder / INDEX_FILE).exists() else []
        if stale:
            raise TensorparError(f"'{folder}' already holds another checkpoint ({', '.join(sorted(stale))}); "
                                 "save to an empty folder")
    folder.mkdir(parents=True, exist_ok=True)

    tensors, storages = {}, set()
    for name, t in hf_state.items():
        t = t.detach().to("cpu").contiguous()
        ptr = t.untyped_storage().data_ptr()
        if ptr in storages:  # safetensors refuses tensors that share memory (e.g. views of one buffer)
            t = t.clone()
        storages.add(t.untyped_storage().data_ptr())
        tensors[name] = t
    dtype = tensors[f"{_GPT2_PREFIX if cfg.family == 'gpt2' else _LLAMA_PREFIX}"
                    f"{'wte' if cfg.family == 'gpt2' else 'embed_tokens'}.weight"].dtype
    hf_config = config_to_hf(cfg, dtype, special_token_ids(tokenizer) if tokenizer is not None else None)

    # Write next to the target and rename, so that an interrupted save never leaves a truncated file behind.
    weights, config = folder / WEIGHTS_FILE, folder / "config.json"
    try:
        save_file(tensors, str(weights) + ".tmp", metadata={"format": "pt"})
        os.replace(str(weights) + ".tmp", weights)
        with open(str(config) + ".tmp", "w") as f:
            json.dump(hf_config, f, indent=2, sort_keys=True)
            f.write("\n")
        os.replace(str(config) + ".tmp", config)
        if tokenizer is not None:
            write_tokenizer(str(folder), tokenizer, cfg.max_seq_len)
    except (OSError, SafetensorError) as e:  # safetensors' writer reports an I/O error (a full disk) as its own
        raise TensorparError(f"cannot write the Hugging Face folder '{folder}': {e}") from None
