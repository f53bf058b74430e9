"""Memory per GPU: parameters, gradients, optimizer states, activations, and a stated margin.

The bytes per element of each kind of state come from a `Precision` (`tensorpar.planning.precision_recipes`).

ZeRO (Playbook, after Rajbhandari et al.) divides by dp: stage 1 the optimizer states (and
master weights), stage 2 also the gradients, stage 3 also the parameters. The tensorpar
precisions model tensorpar's own ZeRO exactly (`tensorpar.data_parallel.bucketed`,
`tensorpar.data_parallel.fully_sharded`; a test compares with the bytes a run counts):
ZeRO-1/2 keep an fp32 master slice (4/dp bytes) even of fp32 parameters; ZeRO-1 keeps full
gradient buckets plus the fp32 gradient slice; ZeRO-2 the slice plus the full buffers in flight
(two adjacent buckets, one being filled and one being reduce-scattered, and one bucket's 1/dp
result; with several micro-batches a step also the last bucket of one beside the first of the
next); ZeRO-3 the parameter shards and, as ``transient``, the gathered root (embedding,
head, final norm: gathered for the whole step) and two blocks (the one computing and the
prefetched one), gradient shards plus the root's full gradient and two blocks' in flight, and
no separate master of fp32 parameters (the shard is what AdamW steps).

Activations, two models:

- ``tensorpar``: exactly what tensorpar's model saves for backward (checked against
  saved-tensor measurements in tests/test_planning_memory.py). Per layer and micro-batch of b
  sequences of s tokens, TP size t, s_n = s/t under sequence parallelism (else s), A = 4 bytes
  (the fp32 residual stream) and M = matmul dtype bytes (2 under bf16 autocast, else 4):
  each norm saves its input (A b s_n h; a norm after a sublayer, Gemma's sandwich or OLMo 2's, its output's M),
  RMSNorm also its fp32 normalised output (4 b s_n h)
  and the inverse RMS (4 b s_n), LayerNorm its mean and rstd (8 b s_n); the linears after a
  norm save their input: one fp32 tensor [b, s, h] shared by q/k/v (gate/up) in fp32 - the
  *gathered* full sequence under SP - and one bf16 copy per consuming linear under autocast
  (3 for q/k/v, 2 for gate/up; one, shared, at TP > 1 with tensorpar's TP overlap); attention saves q, k, v (KV heads repeated to the local query
  heads) and its output, 4 M b s h/t, and the fp32 log-sum-exp (4 b s a/t; flash attention,
  no s^2 term; but a soft cap's tanh and fp32 probabilities, 8 b s^2 a/t, and a window's mask, and the q / k
  norms' inputs and outputs); the MLP saves 4 M b s f/t (SwiGLU: gate, silu(gate), up, product), 2 (GeLU)
  or 1 (ReLU). Selective recomputation keeps the attention core's inputs (q, k before the KV
  repeat; fp32 after RoPE under autocast) instead of its saved tensors. Full recomputation
  keeps each layer's input (A b s_n h). Outside the layers: the token ids, RoPE's cos/sin, the
  final norm, the head's input and the loss's fp32 softmax over the local vocabulary
  (4 b s V_pad/t). Under bf16 autocast the weights' bf16 copies (2 bytes per matmul weight
  element) stay alive from forward to backward, one set per micro-batch in flight: reported as
  ``weight_copies``. With the fused, chunked head and loss (training's default, `loss_chunk_tokens`) the loss
  computes its gradients in the forward and keeps, instead of the head's input and the softmax, the head's input
  gradient and (when the head trains) its weight gradient in fp32 (4 b s h + 4 V_pad/t h), and no bf16 copy
  of the head's weight. The loss's temporaries (the unfused loss's fp32 logits before its softmax,
  4 b s V_pad/t; the fused one's chunk of logits and their gradient, 8 chunk V_pad/t) are not modelled: they
  live inside the loss's forward or backward only.
- ``playbook``: the Playbook's (Korthikanti et al. 2022) formulas in bf16, generalised to GQA
  and gated MLPs: per layer s b h (34 + 5 a s / h) without TP; with TP t
  s b h (10 + 24/t + 5 a s/(h t)); with TP and SP s b h (34 + 5 a s/h) / t; selective
  recomputation (or flash attention) drops the 5 a s/h attention-score term; full
  recomputation keeps 2 s b h (/t with SP) per layer. The "10" counts the norm inputs, the
  linear inputs and two dropout masks; without dropout the masks (2 s b h) are left out.
  With fp8 GEMMs (``megatron-fp8``) every linear layer saves its input as Transformer Engine does: the fp8
  transpose made by its cast-transpose, 1 byte per element (`_Linear.forward`'s ``save_for_backward
  (inputmat_t)`` in NVIDIA/TransformerEngine transformer_engine/pytorch/module/linear.py, likewise the
  norm-fused LayerNormLinear's ln_out): the q/k/v and MLP-up inputs, the attention output and the
  down projection's input. Each linear layer also keeps its weight cast to fp8 and that cast's transpose
  (2 bytes per weight element, module buffers updated on a step's first micro-batch): ``weight_copies``.
  With fp8 parameters (``megatron-fp8-params``, NeMo 2.0's ``fp8_param_gather``) the fp8 weight and its
  transpose are the parameter (``param_bytes`` 2) and no copies are kept.

Pipeline: with 1F1B the first stage holds ``min(pp, m)`` micro-batches of activations (rank r:
``min(pp - r, m)``); Megatron-LM's interleaved schedule with v chunks holds
``min(2 (pp - 1) + (v - 1) pp + 1, m v)`` chunk-forwards of L/(pp v) layers each on rank 0,
i.e. L (1 + (pp - 1)/(pp v)) layers' worth, as Korthikanti et al. state. Without PP one
micro-batch is in flight (gradient accumulation runs them one after another).

Memory levers (`tensorpar.planning.offload_memory`): bf16 AdamW moments, the optimizer and the activations in
host memory (``host_optimizer``, ``host_activations``; not in the GPU's total).

Margin: ``overhead`` = 1.5 GiB (CUDA context, NCCL and cuBLAS workspaces) + 5% of everything
else (allocator fragmentation, small temporaries). A layout is feasible when the total,
overhead included, fits the GPU's memory.
"""

from __future__ import annotations

import dataclasses
import math

from tensorpar.config.choices import LOSS_CHUNK_TOKENS
from tensorpar.config.memory_levers import MemoryLevers
from tensorpar.config.hardware import GiB
from tensorpar.distributed.sharding import padded
from tensorpar.planning.communication import DEFAULT_BUCKET_BYTES
from tensorpar.planning.candidates import Candidate, candidate_stages, stage_layers
from tensorpar.planning.fp8_traffic import fp8_input_bytes
from tensorpar.planning.latent import latent_attention_activations, latent_playbook_bytes, mtp_activations
from tensorpar.planning.offload_memory import SavedBytes, host_optimizer_bytes, levered_precision
from tensorpar.planning.lora_adapters import (check_lora, lora_layer_activations, lora_outer_activations,
                                     lora_weight_copies)
from tensorpar.planning.params import ParamSummary, layout_summary
from tensorpar.planning.precision_recipes import Precision, get_precision
from tensorpar.planning.state_memory import optimizer_state_bytes, state_bytes  # noqa: F401
from tensorpar.tensor_parallel.lora import LoraSpec

OVERHEAD_FIXED_BYTES = int(1.5 * GiB)

OVERHEAD_FRACTION = 0.05


def _mlp_saved(cfg) -> int:
    """How many [b, s, f/t] tensors the MLP saves."""
    relu = cfg.activation == "relu"  # relu saves its output, which is also the next op's input
    if cfg.gated_mlp:
        return 3 if relu else 4
    return 1 if relu else 2


def tensorpar_layer_activations(cfg, tp: int, sp: bool, b: int, s: int, recompute: str, autocast: bool,
                                act_bytes: int = 4, moe: bool = False, tp_overlap: bool = True, fp8: str = "",
                                cp: int = 1) -> int:
    """Bytes one transformer layer of tensorpar saves for backward, for one micro-batch (see module docstring).
    `act_bytes`: 2 when the parameters and activations are bf16/fp16 (then M = 2 too). `moe`: the layer's MLP
    is a mixture of experts (`tensorpar_moe_activations` instead of the dense MLP's). `tp_overlap` (at TP > 1):
    the overlapped entry casts the input shared by q/k/v (gate/up) once under autocast, not once per linear.
    `cp`: context parallelism (its ring keeps no s x s tensor, soft cap and window included)."""
    A, M = act_bytes, (2 if autocast or act_bytes == 2 else 4)
    t = tp
    h, hd = cfg.hidden_size, cfg.head_dim
    sn = s // t if sp else s
    if recompute == "full":
        return A * b * sn * h
    heads = cfg.num_heads // t
    kv_local = max(cfg.kv_heads // t, 1)
    f = cfg.ffn_hidden_size // t
    stats = 4 * b * sn * h + 4 * b * sn if cfg.norm == "rmsnorm" else 8 * b * sn
    before, after = cfg.norm_placement in ("pre", "sandwich"), cfg.norm_placement in ("sandwich", "post")
    # Norms before a sublayer take the residual stream (A bytes); after one, the sublayer's output (M bytes).
    norms = 2 * before * (A * b * sn * h + stats) + 2 * after * (M * b * sn * h + stats)
    if autocast:
        shared = tp_overlap and t > 1
        attn_in = (1 if shared else 3) * 2 * b * s * h
        mlp_in = (1 if shared or not cfg.gated_mlp else 2) * 2 * b * s * h
    else:
        attn_in = mlp_in = A * b * s * h
    local = b * s * heads * hd
    if recompute == "selective":
        qk = 4 if (autocast and cfg.position == "rope") else M  # RoPE promotes bf16 q, k to fp32 under autocast
        attn = qk * local + qk * b * s * kv_local * hd + M * b * s * kv_local * hd + M * local
    else:
        attn = 4 * M * local + 4 * b * heads * s + _score_bytes(cfg, b, heads, s, M, cp)
    attn += _qk_norm_bytes(cfg, b, s, heads, kv_local, M)
    mlp = _mlp_saved(cfg) * M * b * s * f
    if moe:
        mlp_in, mlp = 0, tensorpar_moe_activations(cfg, tp, b, s, autocast, act_bytes)
    masks = 0
    if cfg.dropout > 0:
        masks = 2 * (A if (cfg.bias or not autocast) else M) * b * sn * h
    if cfg.is_mla:  # latent attention's own tensors (tensorpar.planning.latent)
        attn_in, attn = 0, latent_attention_activations(cfg, tp, sp, b, s, recompute, autocast, act_bytes)
    return norms + attn_in + mlp_in + attn + mlp + masks + fp8_input_bytes(cfg, fp8, recompute, b, s, t, moe)


def _qk_norm_bytes(cfg, b: int, s: int, heads: int, kv_heads: int, M: int) -> int:
    """What the norms of q and k save (this rank's heads, the whole sequence): per head, the fp32 copy of the
    input, the normalised output (M) and the inverse RMS per head and token; over the whole projection (computed
    in fp32 throughout), input and output in fp32 and the inverse RMS per token."""
    n, rows = b * s * (heads + kv_heads) * cfg.head_dim, b * s * (heads + kv_heads)
    return {"none": 0, "head": (4 + M) * n + 4 * rows, "projection": 8 * n + 8 * b * s}[cfg.qk_norm]


def _score_bytes(cfg, b: int, heads: int, s: int, M: int, cp: int) -> int:
    """The s x s tensors one layer's attention core keeps, averaged over the layers: with a soft cap (computed
    outside SDPA, which has none) the capped scores' tanh and the fp32 probabilities (8 bytes per score); a window
    shorter than the sequence, SDPA's mask (M bytes per score, or the soft-capped path's boolean one). Neither
    under context parallelism (the ring holds blocks only)."""
    if cp > 1:
        return 0
    windowed = 0.0
    if cfg.sliding_window is not None:  # (a search asks for hundreds of thousands of layouts: no loop where none slide)
        windowed = sum(cfg.attention_window(i) is not None and cfg.attention_window(i) < s
                       for i in range(cfg.num_layers)) / cfg.num_layers
    capped = cfg.attn_logit_softcap is not None
    return round(b * heads * s * s * 8 * capped + s * s * (1 if capped else M) * windowed)


def tensorpar_moe_activations(cfg, tp: int, b: int, s: int, autocast: bool, act_bytes: int = 4) -> int:
    """Bytes an MoE layer's MLP part saves for backward, for one micro-batch (tensorpar.expert_parallel): each TP rank
    routes T = b s / tp tokens (its sequence shard or token slice), i.e. T k routing choices whose rows the
    all-to-all brings to their experts. Saved: the router's input (T h; a bf16 copy under autocast), its fp32
    logits' softmax and top-k (2 x 4 T E + T k indices and weights); the dispatched rows as the experts'
    input (T k h: fp32, or one bf16 copy per consuming linear under autocast), the experts' hidden tensors
    (as the dense MLP's, T k f_e each) and their combined outputs (M T k h) with the routing weights; the
    shared experts as a tensor-parallel MLP of width num_shared_experts x f_e over the b s tokens."""
    A, M = act_bytes, (2 if autocast or act_bytes == 2 else 4)
    h, e, k, fe = cfg.hidden_size, cfg.num_experts, cfg.experts_per_token, cfg.expert_ffn_size
    tokens = b * s // tp
    rows = tokens * k
    copies = 2 if cfg.gated_mlp else 1
    shared = 0
    if cfg.num_shared_experts:
        shared_in = copies * 2 * b * s * h if autocast else A * b * s * h
        shared = shared_in + _mlp_saved(cfg) * M * b * s * (cfg.num_shared_experts * fe // tp)
    router_in = 2 * tokens * h if autocast else (0 if shared and tp == 1 else A * tokens * h)  # fp32: shares the norm's
    router = 2 * 4 * tokens * e + (8 + 4) * rows
    experts_in = copies * 2 * rows * h if autocast else A * rows * h
    experts = _mlp_saved(cfg) * M * rows * fe + M * rows * h
    return router_in + router + experts_in + experts + shared


def tensorpar_outer_activations(cfg, tp: int, sp: bool, b: int, s: int, autocast: bool,
                                act_bytes: int = 4, chunked_loss: bool = False,
                                head_trained: bool = True) -> dict[str, int]:
    """Bytes saved outside the layers for one micro-batch: ``first`` (ids, embedding dropout mask),
    ``rope`` (cos/sin tables, every stage) and ``last`` (final norm, head input, loss; `chunked_loss`: the
    fused head and loss, which compute their gradients in the forward and keep them, in fp32, until the backward:
    the head's input gradient and, when the head trains (`head_trained`), its weight gradient)."""
    A = act_bytes
    h = cfg.hidden_size
    sn = s // tp if sp else s
    first = 8 * b * s + (b * s if tp > 1 else 0)  # ids (masked to the local vocabulary) and the mask
    if cfg.dropout > 0:
        first += A * b * sn * h
    rope = 2 * A * s * cfg.rotary_dim if cfg.position == "rope" else 0
    if cfg.norm == "rmsnorm":
        last = A * b * sn * h + 4 * b * sn * h + 4 * b * sn
    else:
        last = A * b * sn * h + 8 * b * sn
    vocab = padded(cfg.vocab_size, tp) // tp
    if chunked_loss:  # the gradients of the head's input and weight
        last += 4 * b * s * h + (4 * vocab * h if head_trained else 0)
    else:  # the head's input, the softmax and the soft cap's tanh of the logits
        last += (2 if autocast else A) * b * s * h + 4 * b * s * vocab
        if cfg.final_logit_softcap is not None:
            last += (2 if autocast or A == 2 else 4) * b * s * vocab
    last += (0 if chunked_loss else 8 * b * s + 2 * b * s) + 8  # targets and masks (unfused), token count
    return {"first": first, "rope": rope, "last": last}


def playbook_layer_activations(cfg, tp: int, sp: bool, b: int, s: int, recompute: str, flash: bool = True,
                               nbytes: int = 2, moe: bool = False, linear_input_bytes: int | None = None) -> int:
    """The Playbook's (Korthikanti et al.) per-layer activation bytes, generalised to GQA and gated MLPs; with
    `moe`, the MLP's saved tensors are those of k routed experts per token (split over the TP ranks, the
    dispatched rows and the combined outputs included), the fp32 router scores and the shared experts'.
    `linear_input_bytes`: bytes per element of what each linear layer saves of its input for the weight gradient
    (fp8 GEMMs: 1, Transformer Engine's fp8 transpose; default `nbytes`) - the q/k/v and MLP-up inputs, the
    attention output and the MLP's down-projection input."""
    lin = nbytes if linear_input_bytes is None else linear_input_bytes
    t = tp
    h, a = cfg.hidden_size, cfg.num_heads
    bsh = b * s * h
    if recompute == "full":
        return nbytes * bsh // (t if sp else 1)
    dropout = cfg.dropout > 0
    outside = nbytes * 2 * bsh + lin * 2 * bsh + (2 * bsh if dropout else 0)  # 2 norm inputs, 2 linear inputs, masks
    kv = cfg.kv_heads * cfg.head_dim  # q, k, v (latent attention: its keys, values and latents)
    inside = latent_playbook_bytes(cfg, b, s, nbytes) if cfg.is_mla else nbytes * b * s * (h + 2 * kv)
    inside += lin * bsh  # the attention output (the output projection's input)
    mlp = (_mlp_saved(cfg) - 1) * nbytes + lin  # per [b, s, f] element: the last one is the down projection's input
    if moe:
        rows = b * s * cfg.experts_per_token
        inside += mlp * rows * cfg.expert_ffn_size + 2 * rows * h * nbytes + 8 * b * s * cfg.num_experts
        inside += mlp * b * s * cfg.num_shared_experts * cfg.expert_ffn_size
    else:
        inside += mlp * b * s * cfg.ffn_hidden_size
    if flash or recompute == "selective":
        inside += 4 * b * a * s if flash else 0  # log-sum-exp
    else:
        inside += (nbytes + (1 + nbytes if dropout else 0)) * a * s * s * b  # softmax (+ mask, dropout output)
    return (outside // (t if sp else 1)) + inside // t


def playbook_outer_activations(cfg, tp: int, sp: bool, b: int, s: int, nbytes: int = 2) -> dict[str, int]:
    bsh = b * s * cfg.hidden_size
    first = bsh // (tp if sp else 1) if cfg.dropout > 0 else 0  # embedding dropout mask
    last = nbytes * bsh // (tp if sp else 1) + nbytes * bsh  # final norm input, head input
    last += 4 * b * s * padded(cfg.vocab_size, tp) // tp  # fp32 softmax of the loss
    return {"first": first, "rope": 0, "last": last}


def in_flight(layout: Candidate, num_micro_batches: int, stage: int) -> int:
    """Chunk-forwards whose activations pipeline rank `stage` holds at its peak (1F1B / interleaved)."""
    pp, v, m = layout.pp, layout.virtual_stages, num_micro_batches
    if pp == 1:
        return 1
    if v == 1:
        return min(pp - stage, m)
    if m == pp:
        return m * v
    return min(2 * (pp - stage - 1) + (v - 1) * pp + 1, m * v)


@dataclasses.dataclass
class MemoryBreakdown:
    """Bytes per component on the most loaded GPU (`stage`)."""

    parameters: int
    gradients: int
    optimizer: int
    activations: int
    weight_copies: int
    transient: int
    overhead: int
    stage: int
    parameter_count: int
    host_optimizer: int = 0  # --optimizer-offload: the optimizer's bytes in host memory
    host_activations: int = 0  # --activation-offload: the saved tensors in host memory
    frozen: int = 0  # LoRA: the frozen base weights (`parameters` are then the adapters)

    @property
    def total(self) -> int:
        return (self.parameters + self.frozen + self.gradients + self.optimizer + self.activations
                + self.weight_copies + self.transient + self.overhead)

    COMPONENTS = ("parameters", "gradients", "optimizer", "activations", "weight_copies", "transient", "overhead",
                  "frozen")

    def gib(self) -> dict[str, float]:
        """The GPU's bytes by component and in total, GiB."""
        out = {k: getattr(self, k) / GiB for k in self.COMPONENTS}
        out["total"] = self.total / GiB
        return out

    def host_gib(self) -> dict[str, float]:
        """The host memory the memory levers use, GiB."""
        return {"optimizer": self.host_optimizer / GiB, "activations": self.host_activations / GiB,
                "total": (self.host_optimizer + self.host_activations) / GiB}


def stage_memory(cfg, layout: Candidate, seq_len: int, global_batch: int, precision: Precision | str,
                 stage: int = 0, flash_attention: bool = True, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 tp_overlap: bool = True, loss_chunk_tokens: int | None = LOSS_CHUNK_TOKENS,
                 levers: MemoryLevers = MemoryLevers(), lora: LoraSpec | None = None) -> MemoryBreakdown:
    """Peak memory of one GPU of pipeline rank `stage` (`bucket_bytes`: the DP gradient bucket size; `tp_overlap`:
    tensorpar's TP overlap, its default, on as in training; `loss_chunk_tokens`: tensorpar's fused head and loss,
    training's default chunk, None for logits then the loss), and the host memory the `levers` use
    (`tensorpar.planning.offload_memory`). `lora`: LoRA fine-tuning, the base frozen (`tensorpar.planning.lora_adapters`)."""
    prec = levered_precision(get_precision(precision), levers)
    check_lora(cfg, lora)
    pp = layout.pp
    summary = layout_summary(cfg, layout, stage, lora)
    n_layers = stage_layers(cfg, layout, stage if pp > 1 else None)[2]
    m = max(layout.num_micro_batches(global_batch), 1)
    states = state_bytes(cfg, layout, summary, stage, prec, bucket_bytes, lora, m)
    opt_mem = states.optimizer
    chunks = in_flight(layout, m, stage if pp > 1 else 0)
    saved = _saved_bytes(cfg, layout, seq_len, m, chunks, stage, prec, summary, flash_attention, tp_overlap,
                         loss_chunk_tokens, lora)
    activations, weight_copies = saved.activations, saved.weight_copies
    transient = states.gathered + saved.recomputed + saved.copies_alive
    host_opt = host_act = 0
    if levers.optimizer_offload:
        opt_mem, host_opt = 0, host_optimizer_bytes(summary, layout, prec)
    if levers.activation_offload:
        host_act, activations, weight_copies = saved.offloaded(levers, n_layers)
        # in the backward a layer's saved tensors come back for it, the next layer's ahead of it; when the later layers
        # stay, the first ones come back as those are freed, and only the one fetched ahead adds to the peak
        layer = _layer_activations(cfg, layout, layout.micro_batch_size, seq_len // layout.cp, layout.recompute, prec,
                                   flash_attention, tp_overlap, 1.0 if cfg.is_moe else 0.0, lora)
        transient += (2 if levers.offloaded_layers(n_layers) == n_layers else 1) * layer
    subtotal = (states.parameters + states.frozen + states.gradients + opt_mem + activations + weight_copies
                + transient)
    overhead = OVERHEAD_FIXED_BYTES + int(OVERHEAD_FRACTION * subtotal)
    return MemoryBreakdown(states.parameters, states.gradients, opt_mem, activations, weight_copies, transient,
                           overhead, stage, summary.numel, host_opt, host_act, states.frozen)


def _saved_bytes(cfg, layout: Candidate, seq_len: int, m: int, chunks: int, stage: int, prec: Precision,
                 summary: ParamSummary, flash_attention: bool, tp_overlap: bool, loss_chunk_tokens: int | None,
                 lora: LoraSpec | None) -> SavedBytes:
    """The `SavedBytes` of `chunks` chunk-forwards in flight on pipeline rank `stage`."""
    first, last, n_layers = stage_layers(cfg, layout, stage if layout.pp > 1 else None)
    # zero-bubble schedules keep the unfused head and loss (their split backward defers the head's weight gradient)
    chunked = bool(loss_chunk_tokens) and prec.activations == "tensorpar" and not layout.splits_backward
    activations, recomputed, in_layers = _activation_bytes(cfg, layout, seq_len, m, chunks, n_layers, first, last,
                                                           prec, flash_attention, tp_overlap, chunked, lora)
    weight_copies, copies_alive = _weight_copy_bytes(cfg, layout, summary, n_layers, chunks, last, prec, chunked)
    weight_copies += chunks * lora_weight_copies(cfg, layout, prec, lora, first) // layout.virtual_stages
    return SavedBytes(activations, recomputed, in_layers, weight_copies, copies_alive,
                      _head_weight_copies(summary, last, prec, chunked))


def moved_activation_bytes(cfg, layout: Candidate, seq_len: int, precision: Precision | str, stage: int = 0,
                           flash_attention: bool = True, levers: MemoryLevers = MemoryLevers(),
                           lora: LoraSpec | None = None) -> tuple[int, int]:
    """(the bytes --activation-offload moves to the host and back for one micro-batch on a rank of pipeline `stage`,
    what the layers it moves save; the stage's layers): one micro-batch's pass through the stage's chunks, as
    `stage_memory` counts them (no bytes without the lever)."""
    n_layers = stage_layers(cfg, layout, stage if layout.pp > 1 else None)[2]
    if not levers.activation_offload:
        return 0, n_layers
    prec = levered_precision(get_precision(precision), levers)
    summary = layout_summary(cfg, layout, stage, lora)
    saved = _saved_bytes(cfg, layout, seq_len, 1, layout.virtual_stages, stage, prec, summary, flash_attention, True,
                         LOSS_CHUNK_TOKENS, lora)
    return saved.offloaded(levers, n_layers)[0], n_layers


def _activation_bytes(cfg, layout: Candidate, seq_len: int, m: int, chunks: int, n_layers: int, first: bool,
                      last: bool, prec: Precision, flash_attention: bool, tp_overlap: bool,
                      chunked_loss: bool = False, lora: LoraSpec | None = None) -> tuple[int, int]:
    """(activations at the peak, the layer activations recomputation brings back during backward, the layers' share
    of the first) in bytes on one rank: per layer x layers per chunk x the `chunks` chunk-forwards in flight, plus
    the stage's ends."""
    b, s = layout.micro_batch_size, seq_len // layout.cp  # each rank holds seq_len / cp tokens of a sequence
    layers_per_chunk = n_layers // layout.virtual_stages
    mbs_in_flight = min(m, math.ceil(chunks / layout.virtual_stages)) if layout.pp > 1 else 1
    # MoE models: the share of the layers whose MLP is a mixture of experts (every moe_layer_freq-th; the same
    # share on every stage, as tensorpar places them by global index)
    moe_share = (sum(cfg.is_moe_layer(i) for i in range(cfg.num_layers)) / cfg.num_layers) if cfg.is_moe else 0.0
    if prec.activations == "tensorpar":
        outer = tensorpar_outer_activations(cfg, layout.tp, layout.sequence_parallel, b, s, prec.autocast, prec.act_bytes,
                                            chunked_loss, head_trained=lora is None)
    else:
        outer = playbook_outer_activations(cfg, layout.tp, layout.sequence_parallel, b, s, prec.act_bytes)
    per_layer = _layer_activations(cfg, layout, b, s, layout.recompute, prec, flash_attention, tp_overlap, moe_share,
                                   lora)
    recomputed = 0
    if layout.recompute != "none":  # during backward one layer's activations exist again
        whole = _layer_activations(cfg, layout, b, s, "none", prec, flash_attention, tp_overlap, moe_share, lora)
        recomputed = whole if layout.recompute == "full" else whole - per_layer
    ends = mbs_in_flight * ((outer["first"] if first else 0) + outer["rope"]) + (outer["last"] if last else 0)
    ends += lora_outer_activations(cfg, layout, b, s, layout.recompute, prec, lora, first, last) * (
        mbs_in_flight if first else 1)
    if last and cfg.num_mtp_layers:  # the multi-token prediction modules' blocks, norms and heads
        layer = _layer_activations(cfg, layout, b, s, layout.recompute, prec, flash_attention, tp_overlap,
                                   float(cfg.is_moe_layer(cfg.num_layers)), lora)
        ends += mtp_activations(cfg, layout, b, s, prec, layer, outer["last"])
    in_layers = chunks * layers_per_chunk * per_layer
    return in_layers + ends, recomputed, in_layers


def _layer_activations(cfg, layout: Candidate, b: int, s: int, mode: str, prec: Precision, flash_attention: bool,
                       tp_overlap: bool, moe_share: float, lora: LoraSpec | None = None) -> int:
    """Bytes one layer saves for one micro-batch under recomputation `mode`, in the precision's activation model;
    with MoE layers the mean over MoE and dense layers weighted by `moe_share`, rounded; `lora`: with the adapters'
    (`tensorpar.planning.lora_adapters.lora_layer_activations`)."""
    def one(moe):
        if prec.activations == "tensorpar":
            # LoRA: the frozen base's fp8 GEMMs keep no input (`fp8_linear`), the adapters' GEMMs are not fp8, so the
            # layer saves what it saves without fp8
            fp8 = prec.fp8_recipe if lora is None else ""
            base = tensorpar_layer_activations(cfg, layout.tp, layout.sequence_parallel, b, s, mode, prec.autocast,
                                               prec.act_bytes, moe, tp_overlap, fp8, layout.cp)
            return base + lora_layer_activations(cfg, layout, b, s, mode, prec, lora, tp_overlap)
        return playbook_layer_activations(cfg, layout.tp, layout.sequence_parallel, b, s, mode, flash_attention, prec.act_bytes,
                                          moe, 1 if prec.gemm_dtype == "fp8" else None)

    if not moe_share:
        return one(False)
    return round(moe_share * one(True) + (1 - moe_share) * one(False))


def _weight_copy_bytes(cfg, layout: Candidate, summary: ParamSummary, n_layers: int, chunks: int, last: bool,
                       prec: Precision, chunked_loss: bool = False) -> tuple[int, int]:
    """(weight copies kept from forward to backward, those alive only while a layer recomputes) in bytes: bf16
    autocast's copies of the matmul weights, or Transformer Engine's fp8 weights and transposes."""
    if prec.autocast:
        layer_weights = summary.layer_matmul_weights
        head_copies = _head_weight_copies(summary, last, prec, chunked_loss)
        if layout.recompute == "full":
            return head_copies, 2 * layer_weights // max(n_layers, 1)
        # every micro-batch's forward makes its own copies: one set per chunk-forward in flight
        return 2 * chunks * layer_weights // layout.virtual_stages + head_copies, 0
    if prec.fp8_recipe:
        # tensorpar's fp8 GEMMs keep the bf16 weight (the parameter) and quantise it again in the backward: only the
        # tensorwise scales are kept, and one layer's fp8 weights exist while its backward runs
        scales = 4 * (1 + 3 + 2 + 1 + (2 if cfg.gated_mlp else 1) + 2) if prec.fp8_recipe == "tensorwise" else 0
        fp8_weights = summary.layer_matmul_weights // max(n_layers, 1)
        if layout.recompute == "full":
            return 0, fp8_weights
        return chunks * n_layers * scales // layout.virtual_stages, fp8_weights
    if prec.gemm_dtype == "fp8" and not prec.fp8_params:
        # Transformer Engine keeps each linear layer's fp8 weight and its fp8 transpose beside the bf16 weight; with
        # fp8 parameters those two are the weight (param_bytes = 2 counts them)
        return 2 * summary.layer_matmul_weights, 0
    return 0, 0


def _head_weight_copies(summary: ParamSummary, last: bool, prec: Precision, chunked_loss: bool) -> int:
    """Of `_weight_copy_bytes`' kept copies, the LM head's: bf16 autocast's copy of its weight (the fused, chunked
    loss keeps none)."""
    return 2 * summary.head_matmul_weights if prec.autocast and last and not chunked_loss else 0


def layout_memory(cfg, layout: Candidate, seq_len: int, global_batch: int, precision: Precision | str,
                  flash_attention: bool = True, levers: MemoryLevers = MemoryLevers(),
                  lora: LoraSpec | None = None) -> MemoryBreakdown:
    """The most loaded GPU's breakdown (the first or the last pipeline stage; any stage with uneven stages)."""
    stages = candidate_stages(cfg, layout)
    return max((stage_memory(cfg, layout, seq_len, global_batch, precision, st, flash_attention, levers=levers,
                             lora=lora)
                for st in stages), key=lambda mb: mb.total)
