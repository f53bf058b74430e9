"""The kernels of one micro-batch through one pipeline stage, timed on the cluster's device.

One rank of a stage (TP size t, CP size c) runs, per layer, for its T = b s / c tokens (the full sequence
chunk: under sequence parallelism the GEMMs see the gathered tokens too):

- the GEMMs, each ``(m, n, k)`` = (rows, output columns, reduction) timed by `devices.gemm_time`:
  forward QKV (T, (a + 2 kv) d / t, h) - KV heads replicated when fewer than t -, output (T, h, a d / t),
  MLP up (T, f / t, h; gate and up fused: 2 f / t) and down (T, h, f / t); backward, for each, the input
  gradient (m, k, n) and the weight gradient (n, k, m). A mixture-of-experts MLP: the router (T / t, E, h),
  the shared experts as a TP MLP, and the local experts as E / ep grouped GEMMs of ``T k ep / (t E)`` rows each
  (balanced routing) plus the permutation (reading and writing the routed rows twice).
- attention: flash-style (`devices.flash_attention_time`: causal, the c ranks of a zigzag ring each doing
  1/c of the causal pairs), or without flash attention the two batched GEMMs (QK^T and PV) and ten passes of
  the bf16 score matrix (scale-mask-softmax, dropout and their backward) through memory.
- element-wise and norm kernels, bounded by memory bandwidth: per layer and token, the two norms (read +
  write), the two residual adds (read 2, write 1; bias and dropout fused in, + a 1-byte mask with dropout)
  over h elements - per rank all h of them without SP (replicated over TP), h / t with SP -, RoPE on q and k,
  the activation (SwiGLU reads 2 f / t writes f / t; GeLU reads and writes f / t); backward twice the
  forward traffic. tensorpar's own layers are not fused: each of their operators (`OPS_PER_LAYER`, counted)
  reads and writes about one activation, and pays one launch; under SP only those outside the TP regions
  (`OPS_OUTSIDE_TP`: norms and residual adds) work on the sequence shard. fp8 GEMMs (``Precision.gemm_dtype`` = "fp8") add the fused cast-transposes of their inputs
  (read 2 bytes, write 1 + 1) forward and of the output gradients backward.
- the head on the last stage: (T, V / t, h) forward and its two backward GEMMs, and the loss's softmax.

Recomputation: "full" runs every layer's forward again (tensorpar without dropout stops before the MLP's
down projection, `compute.stage_flops`), "selective" the attention core's forward.
"""

from __future__ import annotations

from tensorpar.distributed.sharding import padded
from tensorpar.planning.devices import flash_attention_time, gemm_time, memory_time
from tensorpar.planning.candidates import Candidate, stage_layer_indices, stage_layers

_CACHE: dict = {}

# Kernels (operator calls) per layer besides the GEMMs and attention, forward and backward, each paying the device's
# launch / dispatch time: tensorpar's layer runs 68 aten operators forward and 133 backward (counted with a
# TorchDispatchMode over a Llama-style layer, no dropout); a fused framework (Megatron-Core / Transformer Engine:
# fused norms, bias-dropout-add, SwiGLU, RoPE) about 10 and 20.
OPS_PER_LAYER = {"tensorpar": (68, 133), "fused": (10, 20)}
# Of tensorpar's, those outside the TP regions, on the sequence shard under SP: the two RMSNorms (7 aten operators
# forward and 19 backward each, counted with a TorchDispatchMode) and the two residual adds (and their gradients'
# sums). The rest run on full-sequence tensors inside the regions, which SP does not shrink.
OPS_OUTSIDE_TP = (2 * 7 + 2, 2 * 19 + 2)


def gemms_time(gemms, cluster, dtype, nbytes) -> tuple[float, float]:
    """(forward, input-gradient, weight-gradient) seconds of GEMMs given as forward (m, n, k, count)."""
    spec, curve = cluster.gpu, cluster.curve
    peak, hbm = spec.peak(dtype if dtype in spec.peak_flops else "bf16"), spec.hbm_bandwidth
    fwd = dgrad = wgrad = 0.0
    for m, n, k, count in gemms:
        if count <= 0:
            continue
        fwd += count * gemm_time(m, n, k, peak, hbm, curve, dtype, nbytes)
        dgrad += count * gemm_time(m, k, n, peak, hbm, curve, dtype, nbytes)
        wgrad += count * gemm_time(n, k, m, peak, hbm, curve, dtype, nbytes)
    return fwd, dgrad, wgrad


def _cast_bytes(gemms) -> tuple[float, float]:
    """fp8: bytes Transformer Engine's fused cast-transpose moves (read 2, write the fp8 tensor and its transpose,
    1 + 1), forward for the inputs (m x k, the transpose kept for the weight gradient) and backward for the
    output gradients (m x n)."""
    fwd = sum(4.0 * m * k * c for m, n, k, c in gemms)
    bwd = sum(4.0 * m * n * c for m, n, k, c in gemms)
    return fwd, bwd


def layer_parts(cfg, layout: Candidate, b: int, s: int, prec, cluster, moe: bool, flash: bool = True) -> dict:
    """Seconds of one layer's parts for one micro-batch on one rank: gemm_fwd/bwd, attn_fwd/bwd, elem_fwd/bwd,
    and down_fwd (the MLP's output projection, which tensorpar's full recomputation skips)."""
    key = (id(cfg), layout.tp, layout.cp, layout.ep, layout.sequence_parallel, b, s, prec.name, id(cluster), moe, flash)
    hit = _CACHE.get(key)
    if hit is not None and hit[0] is cfg and hit[1] is cluster:
        return hit[2]
    if len(_CACHE) > 100_000:
        _CACHE.clear()
    t, c = layout.tp, layout.cp
    h, d = cfg.hidden_size, cfg.head_dim
    T = b * s // c
    heads = cfg.num_heads // t
    kv = max(cfg.kv_heads // t, 1)
    dtype, nb = prec.gemm_dtype, prec.matmul_bytes
    gemm_bytes = 1 if dtype == "fp8" else nb
    attn_gemms = [(T, (heads + 2 * kv) * d, h, 1), (T, h, heads * d, 1)]
    rope = 2 * T * (heads + kv) * cfg.rotary_dim * nb if cfg.position == "rope" else 0
    if cfg.is_mla:
        attn_gemms, d = _latent_gemms(cfg, layout, T, heads)
        rope = 2 * T * (heads + 1) * cfg.qk_rope_head_dim * nb
    mlp_gemms, down, mlp_act, permute = _mlp_parts(cfg, layout, T, nb, moe)
    g_fwd, g_dgrad, g_wgrad = gemms_time(attn_gemms + mlp_gemms, cluster, dtype, gemm_bytes)
    down_fwd = gemms_time(down, cluster, dtype, gemm_bytes)[0]
    # A soft cap runs outside SDPA (it has none): the two batched GEMMs and the score passes, as without flash.
    a_fwd, a_bwd = _attention_time(b, s, c, heads, d, prec, cluster, flash and cfg.attn_logit_softcap is None)
    e_fwd, e_bwd = _elementwise_time(cfg, layout, T, rope, mlp_act, permute, attn_gemms + mlp_gemms, prec, cluster)
    out = {"gemm_fwd": g_fwd, "gemm_bwd": g_dgrad + g_wgrad, "wgrad": g_wgrad, "attn_fwd": a_fwd, "attn_bwd": a_bwd,
           "elem_fwd": e_fwd, "elem_bwd": e_bwd, "down_fwd": down_fwd}
    _CACHE[key] = (cfg, cluster, out)
    return out


def _latent_gemms(cfg, layout: Candidate, T: int, heads: int) -> tuple[list, float]:
    """(latent attention's GEMMs as (m, n, k, count), the head width whose square-attention FLOPs equal its own) for T
    tokens on one rank of `heads` heads: the replicated down-projections (on T / tp tokens under SP, T without), the
    query and kv up-projections and the output projection, each split by heads."""
    h, q, kv, r = cfg.hidden_size, cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    dk, dv = cfg.qk_nope_head_dim + r, cfg.v_head_dim
    down_tokens = T // layout.tp if layout.sequence_parallel else T
    gemms = [(down_tokens, (q or 0) + kv + r, h, 1), (T, heads * (cfg.qk_nope_head_dim + dv), kv, 1),
             (T, h, heads * dv, 1), (T, heads * dk, h if q is None else q, 1)]
    return gemms, (dk + dv) / 2


def _mlp_parts(cfg, layout: Candidate, T: int, nb: int, moe: bool) -> tuple[list, list, float, float]:
    """(the MLP's forward GEMMs as (m, n, k, count), those of its down projections, the elements its activation
    function reads per input, the bytes a mixture-of-experts layer's permutation moves) for T tokens on one rank:
    a dense TP MLP, or a router, the local experts' grouped GEMMs (balanced routing) and the shared experts."""
    t, h = layout.tp, cfg.hidden_size
    if not moe:
        f = cfg.ffn_hidden_size // t
        return [(T, (2 if cfg.gated_mlp else 1) * f, h, 1), (T, h, f, 1)], [(T, h, f, 1)], T * f, 0.0
    e, k_top, fe = cfg.num_experts, cfg.experts_per_token, cfg.expert_ffn_size
    rows = T * k_top / t  # rows this rank routes; balanced: also the rows its local experts receive
    local = e // layout.ep
    per_expert = rows / local
    up = (2 if cfg.gated_mlp else 1) * fe
    mlp_gemms = [(T / t, e, h, 1), (per_expert, up, h, local), (per_expert, h, fe, local)]
    down = [(per_expert, h, fe, local)]
    if cfg.num_shared_experts:
        fs = cfg.num_shared_experts * fe // t
        mlp_gemms += [(T, (2 if cfg.gated_mlp else 1) * fs, h, 1), (T, h, fs, 1)]
        down.append((T, h, fs, 1))
    mlp_act = rows * fe + (T * cfg.num_shared_experts * fe / t)
    return mlp_gemms, down, mlp_act, 4.0 * rows * h * nb


def _attention_time(b: int, s: int, c: int, heads: int, d: int, prec, cluster, flash: bool) -> tuple[float, float]:
    """(forward, backward) seconds of the attention core of b sequences of s tokens, `heads` heads of size d on
    this rank, split over c context-parallel ranks: flash attention, or the two batched GEMMs and the passes of
    the score matrix through memory."""
    spec, curve = cluster.gpu, cluster.curve
    attn_peak = spec.peak(prec.compute_dtype)  # attention runs in the compute dtype (bf16 under fp8 recipes)
    if flash:
        # zigzag CP: each of the c ranks computes 1/c of the causal pairs of its b x heads sequences
        fa_f, fa_b = flash_attention_time(b * heads, s, s, d, attn_peak, curve)
        return fa_f / c, fa_b / c
    nb = prec.matmul_bytes
    sq = s // c
    bmm = [(sq, s, d, b * heads), (sq, d, s, b * heads)]
    a_fwd, a_dgrad, a_wgrad = gemms_time(bmm, cluster, prec.compute_dtype, nb)
    a_bwd = a_dgrad + a_wgrad
    scores = b * heads * sq * s * nb
    a_fwd += memory_time(4 * scores, spec.hbm_bandwidth, curve, 2)
    a_bwd += memory_time(6 * scores, spec.hbm_bandwidth, curve, 2)
    return a_fwd, a_bwd


def _elementwise_time(cfg, layout: Candidate, T: int, rope: float, mlp_act: float, permute: float, gemms: list, prec,
                      cluster) -> tuple[float, float]:
    """(forward, backward) seconds of a layer's memory-bound kernels on T tokens: norms, residual adds, RoPE
    (`rope` bytes), the MLP's activation (`mlp_act` elements) and MoE permutation (`permute` bytes), fp8's
    cast-transposes of `gemms`, each operator paying a launch; tensorpar's unfused operators each read and write
    about one activation."""
    h, t, nb, A = cfg.hidden_size, layout.tp, prec.matmul_bytes, prec.act_bytes
    tok_h = T * h / (t if layout.sequence_parallel else 1)
    passes = 4 + 6 + (1 if cfg.dropout > 0 else 0)  # norms, residual adds (+ masks)
    act = (3 if cfg.gated_mlp else 2) * mlp_act * nb
    elem = passes * tok_h * A + rope + act + permute
    cast_f = cast_b = 0.0
    if prec.gemm_dtype == "fp8":
        cast_f, cast_b = _cast_bytes(gemms)
    k_fwd, k_bwd = OPS_PER_LAYER["tensorpar" if prec.activations == "tensorpar" else "fused"]
    if prec.activations == "tensorpar":  # unfused: every operator reads and writes about one activation
        (o_fwd, o_bwd), full_h = OPS_OUTSIDE_TP, T * h
        elem_f = max(elem, 2 * (o_fwd * tok_h + (k_fwd - o_fwd) * full_h) * A)
        elem_b = max(2 * elem, 2 * (o_bwd * tok_h + (k_bwd - o_bwd) * full_h) * A)
    else:
        elem_f, elem_b = elem, 2 * elem
    hbm, curve = cluster.gpu.hbm_bandwidth, cluster.curve
    return memory_time(elem_f + cast_f, hbm, curve, k_fwd), memory_time(elem_b + cast_b, hbm, curve, k_bwd)


def head_time(cfg, layout: Candidate, b: int, s: int, prec, cluster) -> tuple[float, float, float]:
    """(forward, backward, weight-gradient) seconds of the LM head and loss on the last stage (one micro-batch,
    one rank)."""
    t = layout.tp
    T = b * s // layout.cp
    vocab = padded(cfg.vocab_size, t) // t
    dtype = prec.gemm_dtype
    f, dg, wg = gemms_time([(T, vocab, cfg.hidden_size, 1)], cluster, "bf16" if dtype == "fp8" else dtype,
                            prec.matmul_bytes)
    softmax = memory_time(4.0 * T * vocab * 4, cluster.gpu.hbm_bandwidth, cluster.curve, 4)
    return f + softmax / 2, dg + wg + softmax / 2, wg


def stage_compute_time(cfg, layout: Candidate, b: int, s: int, stage, prec, cluster,
                       flash: bool = True) -> tuple[float, float, float, float, float]:
    """(forward, backward, weight-gradient part of the backward, recomputation, attention) seconds of one
    micro-batch on one rank of `stage`."""
    first, last, n = stage_layers(cfg, layout, stage)
    if cfg.is_moe:
        n_moe = sum(cfg.is_moe_layer(i) for i in stage_layer_indices(cfg, layout, stage))
    else:
        n_moe = 0
    fwd = bwd = wgrad = recompute = attention = 0.0
    mtp = cfg.num_mtp_layers if last else 0  # each multi-token prediction module: a block, and the head again
    mtp_moe = mtp if cfg.is_moe_layer(cfg.num_layers) else 0
    for count, moe in ((n - n_moe + mtp - mtp_moe, False), (n_moe + mtp_moe, True)):
        if count <= 0:
            continue
        p = layer_parts(cfg, layout, b, s, prec, cluster, moe, flash)
        f = p["gemm_fwd"] + p["attn_fwd"] + p["elem_fwd"]
        fwd += count * f
        bwd += count * (p["gemm_bwd"] + p["attn_bwd"] + p["elem_bwd"])
        wgrad += count * p["wgrad"]
        attention += count * (p["attn_fwd"] + p["attn_bwd"])
        if layout.recompute == "full":
            again = f - (p["down_fwd"] if prec.activations == "tensorpar" and cfg.dropout == 0 else 0.0)
            recompute += count * again
        elif layout.recompute == "selective":
            recompute += count * p["attn_fwd"]
    if last:
        hf, hb, hw = head_time(cfg, layout, b, s, prec, cluster)
        fwd, bwd, wgrad = fwd + (1 + mtp) * hf, bwd + (1 + mtp) * hb, wgrad + (1 + mtp) * hw
    return fwd, bwd, wgrad, recompute, attention


def optimizer_time(elements: float, cluster, bytes_per_element: float) -> float:
    """The optimizer step: memory-bound, `bytes_per_element` of HBM traffic per local element."""
    return memory_time(elements * bytes_per_element, cluster.gpu.hbm_bandwidth, cluster.curve) if elements else 0.0
