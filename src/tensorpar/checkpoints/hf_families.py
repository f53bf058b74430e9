"""The Llama-style decoders of Hugging Face as data: for each architecture, what its config class defaults to, what
its modeling file hard-codes, which config.json fields it reads, and what its tensors are called.

One `HFFamily` per model_type (Llama; Mistral; Qwen2 / Qwen2.5; Qwen3 and Qwen3-MoE; Gemma 2 and Gemma 3 text;
Phi-3; OLMo 2). `tensorpar.checkpoints.hf_family_config` reads and writes config.json with these facts and
`tensorpar.checkpoints.hf` maps the tensors with `layer_pairs` (and Phi-3's fused projections with `fuse` /
`unfuse`). Every family shares the Llama layout: `model.embed_tokens`, `model.layers.{i}.self_attn.{q,k,v,o}_proj`,
`model.layers.{i}.mlp.{gate,up,down}_proj`, `model.norm`, `lm_head` (absent when tied). What differs:

    family        norms of a layer (tensorpar <- Hugging Face)                      q / k norms   biases
    llama         attn_norm <- input_layernorm, mlp_norm <- post_attention_layernorm  -             attention_bias, mlp_bias
    mistral       as llama                                                            -             none
    qwen2         as llama                                                            -             q, k, v
    qwen3(_moe)   as llama                                                            per head      attention_bias (q, k, v, o)
    gemma2        attn_norm <- input_layernorm, post_attn_norm <- post_attention_       -             attention_bias
                  layernorm, mlp_norm <- pre_feedforward_layernorm, post_mlp_norm <-
                  post_feedforward_layernorm
    gemma3_text   as gemma2                                                           per head      attention_bias
    phi3          as llama; q, k, v fused in self_attn.qkv_proj, gate and up in        -             none
                  mlp.gate_up_proj (rows: gate, then up)
    olmo2         post_attn_norm <- post_attention_layernorm, post_mlp_norm <-        projection    attention_bias
                  post_feedforward_layernorm
"""

from __future__ import annotations

import dataclasses

import torch

from tensorpar.checkpoints.hf_moe_config import moe_architecture
from tensorpar.models.config import ModelConfig

PREFIX = "model."

# The Llama-style decoder every family shares, and the variant fields at their plain values.
DECODER = dict(norm="rmsnorm", position="rope", gated_mlp=True)
PLAIN = dict(qk_norm="none", norm_placement="pre", norm_offset=0.0, embedding_multiplier=1.0, query_pre_attn_scalar=None,
             attn_logit_softcap=None, final_logit_softcap=None, rope_local_theta=None, partial_rotary_factor=1.0)
# Gemma reads its embedding scale, score scale, soft caps and local RoPE base from config.json.
_GEMMA = {k: v for k, v in dict(PLAIN, norm_placement="sandwich", norm_offset=1.0).items()
          if k not in ("embedding_multiplier", "query_pre_attn_scalar", "attn_logit_softcap", "final_logit_softcap",
                       "rope_local_theta")}

# tensorpar's norm name -> the Hugging Face layer norm's, by norm placement.
NORM_NAMES = {
    "pre": {"attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm"},
    "sandwich": {"attn_norm": "input_layernorm", "post_attn_norm": "post_attention_layernorm",
                 "mlp_norm": "pre_feedforward_layernorm", "post_mlp_norm": "post_feedforward_layernorm"},
    "post": {"post_attn_norm": "post_attention_layernorm", "post_mlp_norm": "post_feedforward_layernorm"},
}


@dataclasses.dataclass(frozen=True)
class HFFamily:
    """One Hugging Face architecture.

    - `defaults`: its config class's values of the fields a config.json may leave out (Hugging Face names);
    - `fixed`: the ModelConfig fields its modeling file hard-codes (besides `DECODER`): a config with other values
      has no equivalent in it;
    - `biases`: "llama" (attention_bias on q, k, v, o; mlp_bias), "attention" (attention_bias on q, k, v, o),
      "qkv" (q, k and v always), "none";
    - `windows`: "none", "uniform" (sliding_window on every layer), "switched" (on every layer when
      use_sliding_window), "qwen" (layer_types, else the layers from max_window_layers on when use_sliding_window),
      "alternating" (layer_types, else every `sliding_window_pattern`-th layer global: Gemma);
    - `activations`: the hidden_act (or `activation_field`) values it runs, as tensorpar names them;
    - `scaled_embedding`: the embedding times sqrt(hidden_size); `scores`: reads query_pre_attn_scalar and the
      soft caps; `local_rope`: RoPE parameters per layer type; `partial_rope`: partial_rotary_factor;
    - `rope_types`: the RoPE scaling types its config class accepts (None: all of transformers'); `rope_aliases`:
      the old names it reads as others (Phi-3's "su" and "yarn" are its longrope), whose original length comes
      from the top-level `original_max_position_embeddings` first (Phi-3's);
    - `fused`: q/k/v and gate/up stored fused (Phi-3);
    - `unused`: fields its config class takes and its modeling file never applies (Gemma 3's attention soft cap): read
      as transformers runs them, as unset, with a warning where one is set; an export that would need one is refused."""

    model_type: str
    architecture: str
    defaults: dict
    fixed: dict = dataclasses.field(default_factory=lambda: dict(PLAIN))
    biases: str = "none"
    windows: str = "none"
    activation_field: str = "hidden_act"
    activations: dict = dataclasses.field(default_factory=lambda: {"silu": "silu", "swish": "silu"})
    scaled_embedding: bool = False
    scores: bool = False
    local_rope: bool = False
    partial_rope: bool = False
    rope_types: tuple | None = None
    rope_aliases: dict = dataclasses.field(default_factory=dict)
    fused: bool = False
    unused: tuple = ()


def _sizes(vocab, hidden, ffn, layers, heads, kv, max_positions, eps, theta=10000.0, **more) -> dict:
    return dict(dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers,
                     num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=max_positions,
                     rms_norm_eps=eps, rope_theta=theta, tie_word_embeddings=False, hidden_act="silu"), **more)


_GELU = {"gelu_pytorch_tanh": "gelu_new", "gelu_new": "gelu_new"}
_QWEN_WINDOWS = dict(use_sliding_window=False, sliding_window=4096, max_window_layers=28)

FAMILIES: dict[str, HFFamily] = {f.model_type: f for f in (
    HFFamily("llama", "LlamaForCausalLM", _sizes(32000, 4096, 11008, 32, 32, None, 2048, 1e-6), biases="llama"),
    HFFamily("mistral", "MistralForCausalLM", _sizes(32000, 4096, 14336, 32, 32, 8, 4096 * 32, 1e-6,
                                                     sliding_window=4096), windows="uniform"),
    HFFamily("qwen2", "Qwen2ForCausalLM", _sizes(151936, 4096, 22016, 32, 32, 32, 32768, 1e-6, **_QWEN_WINDOWS),
             biases="qkv", windows="qwen"),
    HFFamily("qwen3", "Qwen3ForCausalLM", _sizes(151936, 4096, 22016, 32, 32, 32, 32768, 1e-6, head_dim=128,
                                                 **_QWEN_WINDOWS),
             fixed=dict(PLAIN, qk_norm="head"), biases="attention", windows="qwen"),
    HFFamily("qwen3_moe", "Qwen3MoeForCausalLM", _sizes(151936, 2048, 6144, 24, 32, 4, 32768, 1e-6,
                                                        use_sliding_window=False, sliding_window=4096),
             fixed=dict(PLAIN, qk_norm="head"), biases="attention", windows="switched"),
    HFFamily("gemma2", "Gemma2ForCausalLM", _sizes(256000, 2304, 9216, 26, 8, 4, 8192, 1e-6, head_dim=256,
                                                   tie_word_embeddings=True, query_pre_attn_scalar=256,
                                                   hidden_activation="gelu_pytorch_tanh",
                                                   sliding_window=4096, sliding_window_pattern=2,
                                                   final_logit_softcapping=30.0, attn_logit_softcapping=50.0),
             fixed=dict(_GEMMA, qk_norm="none", rope_local_theta=None), biases="attention", windows="alternating",
             activation_field="hidden_activation", activations=_GELU, scaled_embedding=True, scores=True),
    HFFamily("gemma3_text", "Gemma3ForCausalLM", _sizes(262208, 2304, 9216, 26, 8, 4, 131072, 1e-6, theta=1e6,
                                                        head_dim=256, tie_word_embeddings=True,
                                                        hidden_activation="gelu_pytorch_tanh",
                                                        query_pre_attn_scalar=256, sliding_window=4096,
                                                        sliding_window_pattern=6, rope_local_base_freq=10000.0),
             fixed=dict(_GEMMA, qk_norm="head"), biases="attention", windows="alternating",
             activation_field="hidden_activation", activations=_GELU, scaled_embedding=True, scores=True,
             local_rope=True, unused=("attn_logit_softcapping",)),
    HFFamily("phi3", "Phi3ForCausalLM", _sizes(32064, 3072, 8192, 32, 32, None, 4096, 1e-5, sliding_window=None),
             fixed={k: v for k, v in PLAIN.items() if k != "partial_rotary_factor"}, windows="uniform",
             partial_rope=True, rope_types=("default", "longrope"), rope_aliases={"su": "longrope", "yarn": "longrope"},
             fused=True),
    HFFamily("olmo2", "Olmo2ForCausalLM", _sizes(50304, 4096, 11008, 32, 32, None, 2048, 1e-5),
             fixed=dict(PLAIN, qk_norm="projection", norm_placement="post"), biases="attention"),
    # The decoders of Mixtral and Qwen2-MoE (a ModelConfig of family "llama" with experts; their MoE fields and
    # windows: tensorpar.checkpoints.hf_moe_config).
    HFFamily("mixtral", "MixtralForCausalLM", _sizes(32000, 4096, 14336, 32, 32, 8, 4096 * 32, 1e-5, theta=1e6)),
    HFFamily("qwen2_moe", "Qwen2MoeForCausalLM", _sizes(151936, 2048, 5632, 24, 16, 16, 32768, 1e-6), biases="qkv"),
)}


def family_of(cfg: ModelConfig) -> HFFamily:
    """The Hugging Face family of a Llama-style config (a "llama" one with experts: Mixtral's or Qwen2-MoE's)."""
    return FAMILIES[moe_architecture(cfg) if cfg.family == "llama" and cfg.is_moe else cfg.family]


def layer_pairs(cfg: ModelConfig, i: int) -> list[tuple[str, str]]:
    """(Hugging Face name, tensorpar name) of layer `i`'s norms and attention, with q, k and v unfused (`unfuse`
    splits Phi-3's), and its dense MLP unless it is an MoE layer."""
    h, t = f"{PREFIX}layers.{i}.", f"layers.{i}."
    pairs = [(f"{h}{hf}.weight", f"{t}{ours}.weight") for ours, hf in NORM_NAMES[cfg.norm_placement].items()]
    if cfg.qk_norm != "none":
        pairs += [(f"{h}self_attn.{n}.weight", f"{t}attn.{n}.weight") for n in ("q_norm", "k_norm")]
    for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
        bias = cfg.bias if proj == "o_proj" else cfg.attention_qkv_bias
        pairs += [(f"{h}self_attn.{proj}.{s}", f"{t}attn.{proj}.{s}") for s in ("weight", "bias")[:1 + bias]]
    if not cfg.is_moe_layer(i):
        for proj in ("gate_proj", "up_proj", "down_proj"):
            pairs += [(f"{h}mlp.{proj}.{s}", f"{t}mlp.{proj}.{s}") for s in ("weight", "bias")[:1 + cfg.mlp_has_bias]]
    return pairs


def _fused_parts(cfg: ModelConfig, i: int) -> list[tuple[str, list[str], list[int]]]:
    """(fused name, its parts' names, their rows) of layer `i` (Phi-3)."""
    h, hd = f"{PREFIX}layers.{i}.", cfg.head_dim
    qkv = [f"{h}self_attn.{p}_proj.weight" for p in "qkv"]
    gate_up = [f"{h}mlp.{p}_proj.weight" for p in ("gate", "up")]
    return [(f"{h}self_attn.qkv_proj.weight", qkv, [cfg.num_heads * hd, cfg.kv_heads * hd, cfg.kv_heads * hd]),
            (f"{h}mlp.gate_up_proj.weight", gate_up, [cfg.ffn_hidden_size] * 2)]


def fuse(hf_state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Phi-3's fused projections from the unfused ones (other families: `hf_state` as it is)."""
    if not family_of(cfg).fused:
        return hf_state
    out = dict(hf_state)
    for i in range(cfg.num_layers):
        for fused, parts, _ in _fused_parts(cfg, i):
            out[fused] = torch.cat([out.pop(p) for p in parts])
    return out


def unfuse(hf_state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """The inverse of `fuse` (shapes already checked): q, k, v and gate, up rows split out of Phi-3's fused ones."""
    if not family_of(cfg).fused:
        return hf_state
    out = dict(hf_state)
    for i in range(cfg.num_layers):
        for fused, parts, rows in _fused_parts(cfg, i):
            out.update(zip(parts, out.pop(fused).split(rows)))
    return out
