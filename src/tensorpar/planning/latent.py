"""What the planner knows of the DeepSeek-V3 class: multi-head latent attention's activations, communication and
KV cache, and the multi-token prediction modules' activations (their parameters: `tensorpar.planning.params`).

Latent attention (tensorpar.layers.latent_attention) on a rank of TP t, b sequences of s tokens (s_n = s / t under
sequence parallelism, else s), a latent of W = q_lora_rank + kv_lora_rank + qk_rope_head_dim values a token, h_t =
heads / t heads of key width d_k = qk_nope + qk_rope and value width d_v; A the residual stream's bytes, M the
matmul outputs' (2 under bf16 autocast or bf16 parameters), saves for its backward (`latent_attention_activations`,
checked against the tensors autograd keeps in tests/test_planning_memory.py):

- the down-projections' input, A b s_n h (under autocast, one bf16 copy per down-projection, 2 b s_n h each);
- the latent norms: with fp32 inputs the kv projection's whole output 4 b s_n (kv_lora + qk_rope), and each norm's
  fp32 normalised values and inverse RMS; with bf16 inputs each norm's fp32 copy, its bf16 normalised values and
  inverse RMS: (4 + 2) b s_n r + 4 b s_n;
- the latent the up-projections read, A-wide b s W over the full sequence (autocast: bf16 copies of the query and
  kv latents, 2 b s (q_lora + kv_lora));
- the attention core's q, k, v and output, M b h_t s d_k each (the values zero-padded to d_k, so that SDPA's fused
  kernel runs, `_widened`; with d_v = d_k, v is a view of the kv up-projection, M b s h_t (nope + d_v)) and its fp32
  log-sum-exp 4 b h_t s; the output projection's input M b s h_t d_v.

Its TP collectives per layer (`latent_collectives`): without SP, the backward all-reduce of the latent's gradient
(b s W in the latent's dtype) where ordinary attention all-reduces its input's (b s h), and the output projection's
all-reduce; under SP the latent's all-gather forward and reduce-scatter backward instead of the hidden states', the
output's reduce-scatter, and one all-reduce per replicated down-projection and latent norm for their gradients.
The KV cache holds kv_lora_rank + qk_rope_head_dim values a token and layer on every TP rank (`kv_cache_bytes`).
"""

from __future__ import annotations

from tensorpar.layout.rules import kv_heads_per_rank
from tensorpar.planning.collective_cost import Collective


def latent_width(cfg) -> int:
    """Values a token's latents take: [c_q | c_kv | k_rope], as they enter the TP region."""
    return (cfg.q_lora_rank or 0) + cfg.kv_lora_rank + cfg.qk_rope_head_dim


def key_value_widths(cfg) -> tuple[int, int]:
    """(key, value) width of one attention head."""
    if cfg.is_mla:
        return cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.v_head_dim
    return cfg.head_dim, cfg.head_dim


def _rms_norm(width: int, storage: int, rows: int, input_bytes: int) -> int:
    """Bytes an RMSNorm of `rows` x `width` saves when its input (a view of `storage` values a row) has
    `input_bytes`: fp32, the input's storage and the normalised values; else its fp32 copy and bf16 normalised
    values; and the inverse RMS."""
    per_row = 4 * storage + 4 * width if input_bytes == 4 else 6 * width
    return rows * (per_row + 4)


def latent_attention_activations(cfg, tp: int, sp: bool, b: int, s: int, recompute: str, autocast: bool,
                                 act_bytes: int = 4) -> int:
    """Bytes latent attention saves for backward for one micro-batch, its norm excluded (see the module docstring)."""
    A, M = act_bytes, (2 if autocast or act_bytes == 2 else 4)
    h, heads = cfg.hidden_size, cfg.num_heads // tp
    sn = s // tp if sp else s
    q, kv, r = cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    dk, dv = key_value_widths(cfg)
    downs = 2 if q is not None else 1
    out = (downs * 2 if autocast else A) * b * sn * h
    if q is None:  # the plain query projection enters from x as ordinary attention's q/k/v do
        out += (2 if autocast else A) * b * s * h if (sp or autocast) else 0
    out += _rms_norm(kv, kv + r, b * sn, M) + (_rms_norm(q, q, b * sn, M) if q is not None else 0)
    out += 2 * b * s * ((q or 0) + kv) if autocast else A * b * s * latent_width(cfg)
    if recompute == "selective":  # the core's inputs: q and k after RoPE (fp32 under autocast), the kv projection
        qk_bytes = 4 if autocast else M
        return out + 2 * qk_bytes * b * heads * s * dk + M * b * s * heads * (cfg.qk_nope_head_dim + dv) \
            + M * b * s * heads * dv
    v = M * b * s * heads * (cfg.qk_nope_head_dim + dv) if dv == dk else M * b * heads * s * dk
    return out + 3 * M * b * heads * s * dk + v + 4 * b * heads * s + M * b * s * heads * dv


def kv_cache_bytes(cfg, tp: int, dtype_bytes: int = 2) -> int:
    """Bytes one token's KV cache takes on one TP rank over all layers: latent attention's compressed latent and
    rotary key (whole on every rank), or this rank's share of the KV heads' keys and values."""
    if cfg.is_mla:
        per_layer = cfg.kv_lora_rank + cfg.qk_rope_head_dim
    else:
        per_layer = 2 * kv_heads_per_rank(cfg.kv_heads, tp)[0] * cfg.head_dim
    return cfg.num_layers * per_layer * dtype_bytes


def latent_playbook_bytes(cfg, b: int, s: int, nbytes: int) -> int:
    """The Playbook's model of latent attention's q, k and v: per head a key of d_k and a value of d_v, and the latent
    they come from."""
    dk, dv = key_value_widths(cfg)
    return nbytes * b * s * (cfg.num_heads * (2 * dk + dv) + latent_width(cfg))


def mtp_activations(cfg, layout, b: int, s: int, prec, layer: int, head: int) -> int:
    """Bytes the multi-token prediction modules save for one micro-batch on the last stage: per module its two input
    norms, the projection's input (the two halves, entered into the TP region: 2 h values a token over the full
    sequence), its block (`layer`, one MoE or dense layer's activations), its output norm and the head and loss
    (`head`, as the model's own); and the shifted token ids."""
    A, tp = prec.act_bytes, layout.tp
    sn = s // tp if layout.sequence_parallel else s
    norm = _rms_norm(cfg.hidden_size, cfg.hidden_size, b * sn, A)
    entered = (2 * 2 * b * s * cfg.hidden_size // tp) if prec.autocast else A * b * s * 2 * cfg.hidden_size
    return cfg.num_mtp_layers * (3 * norm + entered + layer + head + 8 * b * s)


def latent_collectives(cfg, layout, n_layers: int, b: int, s: int, act_bytes: int, grad_bytes: int) -> list:
    """The TP collectives of `n_layers` latent attentions' entries for one micro-batch (their exits are ordinary
    attention's, counted with it): see the module docstring. Full recomputation repeats the forward gather."""
    out, L, h = [], n_layers, cfg.hidden_size
    latent = b * s * latent_width(cfg) * act_bytes
    if layout.sequence_parallel:
        again = 2 if layout.recompute == "full" else 1
        out += [Collective("all_gather", "tp", latent, again * L, "forward", "latents (SP gather)"),
                Collective("reduce_scatter", "tp", latent, L, "backward", "latent gradients")]
        q, kv, r = cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_rope_head_dim
        bias = cfg.attention_qkv_bias
        replicated = [(kv + r) * h, kv] + ([kv + r] if bias else []) + ([q * h, q] + ([q] if bias else []) if q else [])
        out += [Collective("all_reduce", "tp", n * grad_bytes, L, "backward", "down-projection / latent norm "
                                                                              "gradients (SP)") for n in replicated]
        if q is None:  # the plain query projection enters from x
            out += [Collective("all_gather", "tp", b * s * h * act_bytes, again * L, "forward", "query input (SP)"),
                    Collective("reduce_scatter", "tp", b * s * h * act_bytes, L, "backward", "query input gradient")]
    else:
        out.append(Collective("all_reduce", "tp", latent, L, "backward", "latent gradients"))
        if cfg.q_lora_rank is None:
            out.append(Collective("all_reduce", "tp", b * s * h * act_bytes, L, "backward", "query input gradient"))
    return out


def mtp_collectives(cfg, layout, b: int, s: int, act_bytes: int, mm: int, grad_bytes: int) -> list:
    """The TP collectives of the multi-token prediction modules' own parts for one micro-batch (their blocks, output
    norms, head and embedding lookups are counted as the model's): each module's projection input (2 h a token)
    entering the region and its output leaving, and under SP its two input norms' gradients."""
    k, h = cfg.num_mtp_layers, cfg.hidden_size
    bsh = b * s * h
    if layout.sequence_parallel:
        return [Collective("all_gather", "tp", 2 * bsh * act_bytes, k, "forward", "MTP projection input (SP gather)"),
                Collective("reduce_scatter", "tp", bsh * mm, k, "forward", "MTP projection output"),
                Collective("reduce_scatter", "tp", 2 * bsh * act_bytes, k, "backward", "MTP projection input gradient"),
                Collective("all_gather", "tp", bsh * mm, k, "backward", "MTP projection output gradient"),
                Collective("all_reduce", "tp", h * grad_bytes, 2 * k, "backward", "MTP input norm gradients (SP)")]
    return [Collective("all_reduce", "tp", bsh * mm, k, "forward", "MTP projection output"),
            Collective("all_reduce", "tp", 2 * bsh * act_bytes, k, "backward", "MTP projection input gradient")]
