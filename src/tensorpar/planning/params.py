"""The parameters tensorpar's Transformer holds on one rank of any layout: names, sizes, counts.

These equal `model.named_parameters()` of the real model (tests/test_planning_communication.py builds it and
compares): the vocabulary padded to a multiple of tp, KV heads replicated when fewer than tp, norms
and row-parallel biases replicated (q/k/v biases alone with `qkv_bias`), a tied embedding on the first stage and (as the head's copy) on
the last. In a mixture-of-experts layer the MLP is a router (replicated), num_experts / ep routed experts
(stacked [E / ep, ...] tensors, no biases; each expert's width split over the expert-TP ranks) and the shared
experts, a tensor-parallel MLP of num_shared_experts times the expert width (tensorpar.expert_parallel). Latent attention
(tensorpar.layers.latent_attention) holds its down-projections and latent norms whole and its up- and output
projections split by heads; multi-token prediction modules (tensorpar.models.mtp) follow the layers on the last
stage, which then holds the embedding too. The routers' balancing biases are buffers, not parameters: not here.
"""

from __future__ import annotations

import dataclasses

from tensorpar.distributed.sharding import padded
from tensorpar.layout import ParallelLayout, divide
from tensorpar.layout.rules import expert_width_per_rank, experts_per_rank, kv_heads_per_rank
from tensorpar.planning.lora_adapters import frozen, with_adapters
from tensorpar.tensor_parallel.lora import LoraSpec

_PARAM_CACHE: dict = {}
_CFG_KEYS: dict = {}


def _cfg_key(cfg) -> str:
    """A cache key for a config (its repr, computed once per config object: the search asks thousands of times)."""
    hit = _CFG_KEYS.get(id(cfg))
    if hit is None or hit[0] is not cfg:
        hit = _CFG_KEYS[id(cfg)] = (cfg, repr(cfg))
    return hit[1]


def local_parameters(cfg, tp: int, pp: int = 1, stage: int = 0, virtual_stages: int = 1,
                     ep: int = 1, pipeline_layers: tuple[int, ...] | None = None,
                     schedule: str | None = None) -> list[tuple[str, int, int]]:
    """(name, numel, ndim) of every parameter tensorpar's Transformer holds on one rank of pipeline rank `stage` of
    the layout these fields make (`layout_parameters`)."""
    layout = ParallelLayout(tp=tp, pp=pp, ep=ep, virtual_stages=virtual_stages, pipeline_layers=pipeline_layers,
                            schedule=schedule)
    return layout_parameters(cfg, layout, stage)


def layout_parameters(cfg, layout, stage: int | None = 0, lora: LoraSpec | None = None) -> list[tuple[str, int, int]]:
    """(name, numel, ndim) of every parameter tensorpar's Transformer holds on one rank of pipeline rank `stage`
    of `layout` (a ParallelLayout or a planner's Candidate), in `named_parameters()` order: vocabulary padded to a
    multiple of tp, KV heads replicated when fewer than tp, norms and row-parallel biases replicated. A tied
    embedding is held by the rank of the first stage and, as the head's copy, by the rank of the last (both rank 0
    in zbv's V); each rank holds its chunks' layers (`tensorpar.layout.PipelineSplit`). `lora`: with the adapters'
    factors (`tensorpar.planning.lora_adapters.with_adapters`)."""
    stage = 0 if stage is None or layout.pp == 1 else stage
    split = layout.split(cfg.num_layers) if layout.pp > 1 else None
    key = (_cfg_key(cfg), layout.tp, layout.ep, layout.expert_tp, stage, split, lora)
    if key not in _PARAM_CACHE:
        _PARAM_CACHE[key] = with_adapters(cfg, _local_parameters(cfg, layout.tp, layout.ep, stage, split,
                                                                 layout.expert_tp), lora)
    return _PARAM_CACHE[key]


def is_expert(name: str) -> bool:
    """Whether a parameter is a routed expert's weight (split over EP, its gradient reduced over expert-DP)."""
    return ".mlp.experts." in name


def _local_parameters(cfg, tp: int, ep: int, stage: int, split, expert_tp: int = 1) -> list[tuple[str, int, int]]:
    ParallelLayout(tp=tp).check(cfg)
    h = cfg.hidden_size
    heads = cfg.num_heads // tp
    kv_local, _ = kv_heads_per_rank(cfg.kv_heads, tp)
    f = cfg.ffn_hidden_size // tp
    vocab = padded(cfg.vocab_size, tp) // tp
    first, last = split.holds_ends(stage) if split is not None else (True, True)
    layers = split.layers_of(stage) if split is not None else range(cfg.num_layers)
    out: list[tuple[str, int, int]] = []
    if first and cfg.position == "learned":
        out.append(("pos_embed", cfg.max_seq_len * h, 2))
    if first or (last and (cfg.tie_embeddings or cfg.num_mtp_layers)):
        out.append(("embed.weight", vocab * h, 2))
    for i in layers:
        out += _layer_parameters(cfg, i, heads, kv_local, f, tp, ep, expert_tp=expert_tp)
    if last:
        for i in range(cfg.num_layers, cfg.num_blocks):  # the multi-token prediction modules
            p = f"layers.{i}"
            out += _norm_parameters(cfg, f"{p}.enorm") + _norm_parameters(cfg, f"{p}.hnorm")
            out.append((f"{p}.eh_proj.weight", h * 2 * h // tp, 2))
            out += _layer_parameters(cfg, i, heads, kv_local, f, tp, ep, f"{p}.block", expert_tp)
            out += _norm_parameters(cfg, f"{p}.norm")
        out += _norm_parameters(cfg, "final_norm")
        if not cfg.tie_embeddings:
            out.append(("head.weight", vocab * h, 2))
    return out


def _layer_parameters(cfg, i: int, heads: int, kv_local: int, f: int, tp: int,
                      ep: int, p: str | None = None, expert_tp: int = 1) -> list[tuple[str, int, int]]:
    """(name, numel, ndim) of layer `i`'s parameters (named under `p`, default `layers.{i}`) on one rank holding
    `heads` query heads, `kv_local` KV heads and `f` of the MLP's width, in the block's order: the norm before
    attention, its projections and q / k norms (latent attention's own), the norm after it, then the MLP's norms
    around a dense MLP or a mixture of experts (norms where `norm_placement` puts them)."""
    h, hd, p = cfg.hidden_size, cfg.head_dim, p or f"layers.{i}"
    qkv_bias, before = cfg.attention_qkv_bias, cfg.norm_placement in ("pre", "sandwich")
    after = cfg.norm_placement in ("sandwich", "post")
    out = _norm_parameters(cfg, f"{p}.attn_norm") if before else []
    if cfg.is_mla:
        out += latent_attention_parameters(cfg, f"{p}.attn", heads)
    else:
        out += _linear_parameters(f"{p}.attn.q_proj", heads * hd, h, heads * hd, qkv_bias)
        out += _linear_parameters(f"{p}.attn.k_proj", kv_local * hd, h, kv_local * hd, qkv_bias)
        out += _linear_parameters(f"{p}.attn.v_proj", kv_local * hd, h, kv_local * hd, qkv_bias)
        out += _linear_parameters(f"{p}.attn.o_proj", h, heads * hd, h, cfg.bias)
    if cfg.qk_norm != "none":
        q, k = (hd, hd) if cfg.qk_norm == "head" else (heads * hd, kv_local * hd)
        out += [(f"{p}.attn.q_norm.weight", q, 1), (f"{p}.attn.k_norm.weight", k, 1)]
    out += _norm_parameters(cfg, f"{p}.post_attn_norm") if after else []
    out += _norm_parameters(cfg, f"{p}.mlp_norm") if before else []
    if cfg.is_moe_layer(i):
        out += _moe_parameters(cfg, f"{p}.mlp", tp, ep, expert_tp)
    else:
        bias = cfg.mlp_has_bias
        if cfg.gated_mlp:
            out += _linear_parameters(f"{p}.mlp.gate_proj", f, h, f, bias)
        out += _linear_parameters(f"{p}.mlp.up_proj", f, h, f, bias)
        out += _linear_parameters(f"{p}.mlp.down_proj", h, f, h, bias)
    return out + (_norm_parameters(cfg, f"{p}.post_mlp_norm") if after else [])


def latent_attention_parameters(cfg, p: str, heads: int) -> list[tuple[str, int, int]]:
    """Latent attention's parameters on a rank holding `heads` heads: the whole down-projections (with biases when
    the q/k/v have them) and latent norms, the up- and output projections' rows or columns of those heads."""
    h, qk, q, kv, r = (cfg.hidden_size, cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.q_lora_rank,
                       cfg.kv_lora_rank, cfg.qk_rope_head_dim)
    bias = cfg.attention_qkv_bias
    if q is None:
        out = _linear_parameters(f"{p}.q_proj", heads * qk, h, 0, False)
    else:
        out = _linear_parameters(f"{p}.q_a_proj", q, h, q, bias) + [(f"{p}.q_a_norm.weight", q, 1)]
        out += _linear_parameters(f"{p}.q_b_proj", heads * qk, q, 0, False)
    out += _linear_parameters(f"{p}.kv_a_proj", kv + r, h, kv + r, bias) + [(f"{p}.kv_a_norm.weight", kv, 1)]
    out += _linear_parameters(f"{p}.kv_b_proj", heads * (cfg.qk_nope_head_dim + cfg.v_head_dim), kv, 0, False)
    return out + _linear_parameters(f"{p}.o_proj", h, heads * cfg.v_head_dim, h, cfg.bias)


def _norm_parameters(cfg, prefix: str) -> list[tuple[str, int, int]]:
    """A norm's weight, and its bias for LayerNorm."""
    out = [(f"{prefix}.weight", cfg.hidden_size, 1)]
    if cfg.norm == "layernorm":
        out.append((f"{prefix}.bias", cfg.hidden_size, 1))
    return out


def _linear_parameters(prefix: str, rows: int, cols: int, bias_size: int, bias: bool) -> list[tuple[str, int, int]]:
    """A linear layer's [rows, cols] weight, and its bias of `bias_size` when it has one."""
    out = [(f"{prefix}.weight", rows * cols, 2)]
    if bias:
        out.append((f"{prefix}.bias", bias_size, 1))
    return out


def _moe_parameters(cfg, prefix: str, tp: int, ep: int, expert_tp: int = 1) -> list[tuple[str, int, int]]:
    """A mixture-of-experts MLP's parameters on one rank: Qwen2-MoE's shared-expert gate, the router, this EP
    rank's routed experts (stacked; each one's width split over `expert_tp` ranks) and the shared experts as a
    tensor-parallel MLP."""
    h = cfg.hidden_size
    local, fe = experts_per_rank(cfg.num_experts, ep), cfg.expert_ffn_size
    out = []
    if cfg.shared_expert_gate:  # Qwen2-MoE's gate, [1, H] replicated: the layer's own parameter comes first
        out.append((f"{prefix}.shared_expert_gate", h, 2))
    out.append((f"{prefix}.router.weight", cfg.num_experts * h, 2))
    for proj in ("gate_proj", "up_proj", "down_proj") if cfg.gated_mlp else ("up_proj", "down_proj"):
        out.append((f"{prefix}.experts.{proj}", local * expert_width_per_rank(fe, expert_tp) * h, 3))
    if cfg.num_shared_experts:
        fs = divide(cfg.num_shared_experts * fe, tp, "the shared experts' width")
        bias = cfg.mlp_has_bias
        if cfg.gated_mlp:
            out += _linear_parameters(f"{prefix}.shared_experts.gate_proj", fs, h, fs, bias)
        out += _linear_parameters(f"{prefix}.shared_experts.up_proj", fs, h, fs, bias)
        out += _linear_parameters(f"{prefix}.shared_experts.down_proj", h, fs, h, bias)
    return out


@dataclasses.dataclass(frozen=True)
class ParamSummary:
    numel: int
    tensors: int
    per_layer: int  # elements of one layer
    layer_matmul_weights: int  # elements of the layers' matmul weights (all layers of the stage)
    head_matmul_weights: int  # the head's (or tied embedding's) weight, on the last stage
    expert_numel: int = 0  # of `numel`, the routed experts' (MoE): reduced and ZeRO-sharded over expert-DP
    expert_tensors: int = 0
    frozen_numel: int = 0  # of `numel`, the frozen parameters' (LoRA's base): no gradient, master or state
    frozen_tensors: int = 0
    frozen_expert_numel: int = 0  # of `frozen_numel`, the routed experts'
    frozen_expert_tensors: int = 0
    frozen_per_layer: int = 0  # of `per_layer`, the frozen parameters'

    @property
    def trained_numel(self) -> int:
        return self.numel - self.frozen_numel

    @property
    def trained_tensors(self) -> int:
        return self.tensors - self.frozen_tensors

    @property
    def trained_expert_numel(self) -> int:
        return self.expert_numel - self.frozen_expert_numel

    @property
    def trained_expert_tensors(self) -> int:
        return self.expert_tensors - self.frozen_expert_tensors


_SUMMARY_CACHE: dict = {}


def parameter_summary(cfg, tp: int, pp: int = 1, stage: int = 0, ep: int = 1,
                      pipeline_layers: tuple[int, ...] | None = None, virtual_stages: int = 1,
                      schedule: str | None = None) -> ParamSummary:
    """Totals of `local_parameters` (`layout_summary` of the layout these fields make)."""
    layout = ParallelLayout(tp=tp, pp=pp, ep=ep, virtual_stages=virtual_stages, pipeline_layers=pipeline_layers,
                            schedule=schedule)
    return layout_summary(cfg, layout, stage)


def layout_summary(cfg, layout, stage: int | None = 0, lora: LoraSpec | None = None) -> ParamSummary:
    """Totals of `layout_parameters` (`lora`: with the adapters, every other parameter frozen)."""
    stage = 0 if stage is None or layout.pp == 1 else stage
    split = layout.split(cfg.num_layers) if layout.pp > 1 else None
    key = (_cfg_key(cfg), layout.tp, layout.ep, layout.expert_tp, stage, split, lora)
    if key not in _SUMMARY_CACHE:
        params = layout_parameters(cfg, layout, stage, lora)
        layers = [p for p in params if p[0].startswith("layers.")  # the decoder's (not the MTP modules')
                  and int(p[0].split(".")[1]) < cfg.num_layers]
        n_layers = len({p[0].split(".")[1] for p in layers}) or 1
        base, in_layers = frozen(params, lora), {p[0] for p in layers}
        _SUMMARY_CACHE[key] = ParamSummary(
            sum(n for _, n, _ in params), len(params), sum(n for _, n, _ in layers) // n_layers,
            _matmul_weight_count(cfg, layers),
            _matmul_weight_count(cfg, [p for p in params if p not in layers]),
            sum(n for name, n, _ in params if is_expert(name)), sum(is_expert(name) for name, _, _ in params),
            sum(n for _, n, _ in base), len(base), sum(n for name, n, _ in base if is_expert(name)),
            sum(is_expert(name) for name, _, _ in base),
            sum(n for name, n, _ in base if name in in_layers) // n_layers)
    return _SUMMARY_CACHE[key]


def parameter_count(cfg, tp: int, pp: int = 1, stage: int = 0, ep: int = 1) -> int:
    """Elements of the parameters one rank of `stage` holds (exactly `sum(p.numel() for p in model.parameters())`)."""
    return sum(n for _, n, _ in local_parameters(cfg, tp, pp, stage, ep=ep))


def _matmul_weight_count(cfg, params) -> int:
    """Elements of the weights that enter a matmul (for autocast's bf16 copies): every 2-D weight (and the
    stacked 3-D experts) but the positional table, and the embedding only when it is also the (tied) head."""
    skip = {"pos_embed"} | (set() if cfg.tie_embeddings else {"embed.weight"})
    return sum(n for name, n, ndim in params if ndim >= 2 and name not in skip)
