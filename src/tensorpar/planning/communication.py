"""Communication: the exact volumes tensorpar sends (their times: `tensorpar.planning.collective_cost`).

`model_collectives` lists every collective tensorpar's model runs for one micro-batch (forward and backward; with
PP, one stage's, including its point-to-point messages), `step_collectives` those of a whole training step (adding
the data-parallel gradient traffic of `tensorpar.data_parallel`'s bucketed optimizers, the gradient-norm scalars,
the pipeline's loss and tied-embedding all-reduces and the trainer's loss average), and `comm_bytes_per_step`
sums them per (op, group): the numbers `mesh.stats` reports after the same work
(tests/test_planning_communication.py checks equality for TP, SP, recomputation, autocast, DP, ZeRO-1/2/3, PP
and LoRA, whose collectives are `tensorpar.planning.lora_traffic`'s).

Mixture-of-experts layers (`moe_collectives`) add their all-to-alls on the expert-parallel group "ep"
(balanced routing assumed: each rank sends its T k routing choices' rows), change their MLP's TP
collectives (the routed part splits the tokens over TP instead of all-reducing a row-parallel output),
and their experts' gradients reduce over expert-DP ("edp"); these MoE volumes are modelled from the
layer's code, not yet checked byte for byte against a counted run.
"""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict

from tensorpar.data_parallel import DEFAULT_BUCKET_BYTES
from tensorpar.layout.rules import kv_heads_per_rank
from tensorpar.planning.candidates import Candidate, stage_layer_indices, stage_layers
from tensorpar.planning.collective_cost import Collective, add_collective as _add, sum_bytes
from tensorpar.planning.fp8_traffic import fp8_tp_collectives, fp8_units, fp8_zero3_traffic, is_fp8_gathered
from tensorpar.planning.latent import key_value_widths, latent_collectives, mtp_collectives
from tensorpar.planning.lora_adapters import frozen, trained
from tensorpar.planning.lora_traffic import lora_collectives
from tensorpar.planning.params import is_expert, layout_parameters
from tensorpar.planning.zero3_traffic import frozen_zero3_traffic, zero3_traffic, zero3_units
from tensorpar.tensor_parallel.lora import LoraSpec

def model_collectives(
    cfg,
    layout: Candidate,
    micro_batch: int,
    seq_len: int,
    *,
    act_bytes: int = 4,
    matmul_bytes: int | None = None,
    grad_bytes: int = 4,
    stage: int | None = None,
    label_smoothing: bool = False,
    scatter_gather: bool = False,
    tp_pieces: int = 1,
    fp8_recipe: str = "",
    lora: LoraSpec | None = None,
) -> list[Collective]:
    """Every collective of one micro-batch's forward and backward through tensorpar's Transformer.

    `tp_pieces`: with tensorpar's TP overlap (`tensorpar.tensor_parallel.tp_overlap`, on in training) the row-parallel
    exits' forward collectives, the SP entries' forward all-gathers and the SP exits' backward all-gathers each go
    as that many collectives of a piece of the tokens (``DEFAULT_CHUNKS``): the same bytes, more calls, each
    paying the link's latency (`Collective.pieces`; full recomputation's plain MLP exit is counted chunked too).

    `act_bytes`: the residual stream and its gradient (fp32 = 4 in tensorpar, also under bf16 autocast);
    `matmul_bytes`: the outputs of the row-parallel linears (2 under bf16 autocast, default `act_bytes`); `grad_bytes`:
    parameter gradients (fp32 = 4 in tensorpar). `stage` selects one pipeline rank (None: the whole model). Nothing is
    sent when TP = 1 and PP = 1. `scatter_gather`: pipeline messages are split across the TP ranks (Megatron-LM's
    scatter/gather optimisation), as they are anyway under sequence parallelism. `fp8_recipe`: the amax all-reduces
    of tensorpar's fp8 GEMMs (`tensorpar.planning.fp8_traffic`). `lora`: LoRA, the base frozen (`lora_traffic`).
    """
    mm = act_bytes if matmul_bytes is None else matmul_bytes
    trains = lora is None  # the base's weights train: their gradients summed over TP where each rank saw a shard
    first, last, n_layers = stage_layers(cfg, layout, stage)
    mtp = cfg.num_mtp_layers if last else 0  # multi-token prediction modules: a block, the embedding and head again
    n_layers += mtp
    b, s = micro_batch, seq_len // layout.cp  # s: the tokens of each sequence this rank holds
    out: list[Collective] = []
    if layout.tp > 1:
        for _ in range((1 if first else 0) + mtp):
            out += _embedding_collectives(cfg, layout.sequence_parallel, b, s, act_bytes, grad_bytes, trains)
        out += _layer_collectives(cfg, layout, n_layers, b * s * cfg.hidden_size, act_bytes, mm, grad_bytes,
                                  tp_pieces, trains)
        if cfg.is_mla:
            out += latent_collectives(cfg, layout, n_layers, b, s, act_bytes, grad_bytes)
        out += fp8_tp_collectives(cfg, layout, b, s, n_layers, fp8_recipe)
        for _ in range(1 + mtp if last else 0):
            out += _head_collectives(cfg, layout.sequence_parallel, b, s, act_bytes, grad_bytes, label_smoothing,
                                     trains)
        if mtp:
            out += mtp_collectives(cfg, layout, b, s, act_bytes, mm, grad_bytes)
    if cfg.is_moe:
        blocks = stage_layer_indices(cfg, layout, stage) + list(range(cfg.num_layers, cfg.num_layers + mtp))
        n_moe = sum(cfg.is_moe_layer(i) for i in blocks)
        out = moe_collectives(cfg, layout, out, b, s, n_layers, n_moe, act_bytes, mm, grad_bytes, trains)
    out = lora_collectives(cfg, layout, lora, out, first, n_layers, b * s, mm, grad_bytes)
    if layout.cp > 1:
        out += ring_collectives(cfg, layout, b, s, mm, n_layers, last)
    if layout.pp > 1 and stage is not None:
        out += _pipeline_messages(cfg, layout, stage, b, s, act_bytes, scatter_gather)
    return out


def _norm_params(cfg) -> int:
    """The weights of one norm: weight and bias for LayerNorm, the weight alone for RMSNorm."""
    return 2 if cfg.norm == "layernorm" else 1


def _embedding_collectives(cfg, sp: bool, b: int, s: int, act_bytes: int, grad_bytes: int,
                           trains: bool = True) -> list[Collective]:
    """The first stage's TP collectives of the vocabulary-parallel embedding (and, under SP, of the learned
    position embedding's gradient); a frozen embedding (not `trains`) has no backward."""
    out: list[Collective] = []
    bsh, h = b * s * cfg.hidden_size, cfg.hidden_size
    if sp:
        _add(out, "reduce_scatter", bsh * act_bytes, 1, "forward", "embedding (vocab-parallel, to sequence shards)")
        _add(out, "all_gather", bsh * act_bytes, trains, "backward", "embedding gradient")
        if cfg.position == "learned":
            _add(out, "all_reduce", s * h * grad_bytes, trains, "backward", "position-embedding gradient (SP)")
    else:
        _add(out, "all_reduce", bsh * act_bytes, 1, "forward", "embedding (vocab-parallel)")
    return out


def _layer_collectives(cfg, layout: Candidate, n_layers: int, bsh: int, act_bytes: int, mm: int, grad_bytes: int,
                       tp_pieces: int, trains: bool = True) -> list[Collective]:
    """The TP collectives of the stage's `n_layers` transformer layers: the attention and MLP entries and exits
    (SP gathers and reduce-scatters, or row-parallel all-reduces), what recomputation repeats, and the gradients
    TP ranks share (norms and biases under SP, replicated K/V heads), which frozen weights (not `trains`) skip."""
    out: list[Collective] = []
    h, L = cfg.hidden_size, n_layers
    # Full recomputation re-runs each block's forward inside backward. torch's non-reentrant checkpoint
    # stops re-running as soon as every tensor backward needs exists again, so without dropout the MLP's
    # output reduction (the block's last op, whose result nothing saves) is not repeated.
    full = layout.recompute == "full"
    entries = 1 if cfg.is_mla else 2  # latent attention enters with its latents (tensorpar.planning.latent)
    again_in = entries if full else 0
    again_out = (2 if cfg.dropout > 0 else 1) if full else 0
    if layout.sequence_parallel:
        _add(out, "all_gather", bsh * act_bytes, entries * L, "forward", "attention / MLP input (SP gather)",
             pieces=tp_pieces)
        _add(out, "reduce_scatter", bsh * mm, 2 * L, "forward", "attention / MLP output (SP reduce-scatter)",
             pieces=tp_pieces)
        _add(out, "all_gather", bsh * act_bytes, again_in * L, "backward", "recomputed attention / MLP input")
        _add(out, "reduce_scatter", bsh * mm, again_out * L, "backward", "recomputed attention / MLP output")
        _add(out, "reduce_scatter", bsh * act_bytes, entries * L, "backward", "attention / MLP input gradient")
        _add(out, "all_gather", bsh * mm, 2 * L, "backward", "attention / MLP output gradient", pieces=tp_pieces)
        _add(out, "all_reduce", h * grad_bytes, 2 * L * _norm_params(cfg) * trains, "backward",
             "norm weight gradients (SP)")
        if cfg.bias:
            _add(out, "all_reduce", h * grad_bytes, 2 * L * trains, "backward", "row-parallel bias gradients (SP)")
    else:
        _add(out, "all_reduce", bsh * mm, 2 * L, "forward", "attention / MLP output (row-parallel)",
             pieces=tp_pieces)
        _add(out, "all_reduce", bsh * mm, again_out * L, "backward", "recomputed attention / MLP output")
        _add(out, "all_reduce", bsh * act_bytes, entries * L, "backward", "attention / MLP input gradient")
    if cfg.kv_heads < layout.tp and not cfg.is_mla:  # replicated KV heads: one buffer with a slot per KV head, K and V separately
        kv = cfg.kv_heads * cfg.head_dim
        _add(out, "all_reduce", kv * h * grad_bytes, 2 * L * trains, "backward", "replicated K/V weight gradients")
        if cfg.attention_qkv_bias:
            _add(out, "all_reduce", kv * grad_bytes, 2 * L * trains, "backward", "replicated K/V bias gradients")
    return out


def _head_collectives(cfg, sp: bool, b: int, s: int, act_bytes: int, grad_bytes: int,
                      label_smoothing: bool, trains: bool = True) -> list[Collective]:
    """The last stage's TP collectives: the final norm's gradients under SP (unless frozen: not `trains`), the LM
    head's input and its gradient, and the vocabulary-parallel cross-entropy's fp32 reductions."""
    out: list[Collective] = []
    bsh, h = b * s * cfg.hidden_size, cfg.hidden_size
    if sp:
        _add(out, "all_reduce", h * grad_bytes, _norm_params(cfg) * trains, "backward", "final norm gradients (SP)")
        _add(out, "all_gather", bsh * act_bytes, 1, "forward", "head input (SP gather)")
        _add(out, "reduce_scatter", bsh * act_bytes, 1, "backward", "head input gradient")
    else:
        _add(out, "all_reduce", bsh * act_bytes, 1, "backward", "head input gradient")
    _add(out, "all_reduce", b * s * 4, 1, "forward", "cross-entropy max (fp32)")
    _add(out, "all_reduce", (3 if label_smoothing else 2) * b * s * 4, 1, "forward", "cross-entropy sums (fp32)")
    return out


def _pipeline_messages(cfg, layout: Candidate, stage: int, b: int, s: int, act_bytes: int,
                       scatter_gather: bool) -> list[Collective]:
    """Pipeline rank `stage`'s point-to-point messages of one micro-batch (tensorpar.pipeline_parallel.runner.PipelineRunner:
    fp32 hidden states forward, their gradients backward, once per chunk boundary; sequence shards under SP or
    with `scatter_gather`). Both the send and the matching recv are counted, each with the message's bytes."""
    out: list[Collective] = []
    split = layout.split(cfg.num_layers)
    msg = b * (s // layout.tp if (layout.sequence_parallel or scatter_gather) else s) * cfg.hidden_size * act_bytes
    virtual = [split.stage_of(stage, c) for c in range(split.chunks)]
    # A chunk boundary crosses ranks unless both stages sit on this rank (the two middle stages of zbv's V).
    nexts = sum(v < split.stages - 1 and split.rank_of(v + 1)[0] != stage for v in virtual)
    prevs = sum(v > 0 and split.rank_of(v - 1)[0] != stage for v in virtual)
    _add(out, "send", msg, nexts, "forward", "activations to the next stage", "pp")
    _add(out, "recv", msg, prevs, "forward", "activations from the previous stage", "pp")
    _add(out, "send", msg, prevs, "backward", "activation gradients to the previous stage", "pp")
    _add(out, "recv", msg, nexts, "backward", "activation gradients from the next stage", "pp")
    return out


def moe_collectives(cfg, layout: Candidate, dense: list[Collective], b: int, s: int, n_layers: int, n_moe: int,
                    act_bytes: int, mm: int, grad_bytes: int, trains: bool = True) -> list[Collective]:
    """`dense`, the collectives of a micro-batch as if every layer were dense, changed for the `n_moe` MoE layers
    among the stage's `n_layers` (tensorpar.expert_parallel), `s` tokens per sequence on this rank.

    Each TP rank routes T = b s / tp tokens. Without sequence parallelism the routed part takes its 1/tp of the
    tokens (no communication) and all-gathers the outputs (backward: all-gathers the input gradients) instead
    of the dense MLP's row-parallel all-reduce (forward) and input-gradient all-reduce (backward), which only
    the shared experts (a TP MLP) still run; under SP the routed part works on the sequence shard, and the SP
    gather / reduce-scatter pairs are the shared experts' only. The router's replicated weight gradient is
    all-reduced over TP (unless frozen: not `trains`), and the balance statistics (2 E fp32 per sequence) over the TP ranks sharing sequences.
    On the EP group, per MoE layer: forward, the expert counts (E int64) and the rows out (T k h, the
    residual dtype) and back (T k h, the matmul dtype); backward, the two row all-to-alls reversed; full
    recomputation repeats the forward ones."""
    out = list(dense)
    tp, sp, h = layout.tp, layout.sequence_parallel, cfg.hidden_size
    bsh = b * s * h
    full = layout.recompute == "full"
    if tp > 1 and n_moe:
        shared = cfg.num_shared_experts > 0
        if not shared:  # no MLP collectives in an MoE layer: those counted twice a layer lose one call per MoE layer
            twice = {2 * n_layers} | ({n_layers} if cfg.is_mla else set())  # latent attention enters on its own
            out = [dataclasses.replace(c, calls=c.calls - n_moe)
                   if c.group == "tp" and "attention / MLP" in c.what and c.calls in twice else c for c in out]
        if not sp:
            out.append(Collective("all_gather", "tp", bsh * act_bytes, n_moe, "forward", "MoE outputs (token split)"))
            out.append(Collective("all_gather", "tp", bsh * act_bytes, n_moe, "backward", "MoE input gradients"))
        _add(out, "all_reduce", cfg.num_experts * h * grad_bytes, n_moe * trains, "backward",
             "router weight gradients")
        out.append(Collective("all_reduce", "tp", b * 2 * cfg.num_experts * 4, n_moe * (1 + full), "forward",
                              "router balance statistics"))
    if layout.ep > 1 and n_moe:
        rows = (b * s // tp) * cfg.experts_per_token * h
        again = 1 + full
        out.append(Collective("all_to_all", "ep", cfg.num_experts * 8, n_moe * again, "forward", "expert counts"))
        out.append(Collective("all_to_all", "ep", rows * act_bytes, n_moe * again, "forward", "MoE dispatch"))
        out.append(Collective("all_to_all", "ep", rows * mm, n_moe * again, "forward", "MoE combine"))
        out.append(Collective("all_to_all", "ep", rows * mm, n_moe, "backward", "MoE combine gradients"))
        out.append(Collective("all_to_all", "ep", rows * act_bytes, n_moe, "backward", "MoE dispatch gradients"))
    return out


def ring_collectives(cfg, layout: Candidate, b: int, s: int, kv_bytes: int, n_layers: int, last: bool) -> list[Collective]:
    """The context-parallel ring of one micro-batch (tensorpar.context_parallel.ring_attention), `s` tokens per rank.

    Per layer: forward, the local K and V blocks sent cp - 1 times; backward, the same again, then their
    fp32 gradients cp - 1 times and once more home; recomputation (selective re-runs the attention core,
    full the whole layer) repeats the forward ring. K travels in fp32 after RoPE under autocast (RoPE
    promotes it), V in the matmul dtype (`kv_bytes`). Sends and receives are both counted, each with the
    message's bytes. The last stage also averages the loss over the CP ranks (two fp32 scalars)."""
    cp = layout.cp
    heads = (cfg.num_heads // layout.tp) if cfg.is_mla else kv_heads_per_rank(cfg.kv_heads, layout.tp)[0]
    k_width, v_width = key_value_widths(cfg)  # latent attention: per-head keys (the rotary one shared) and values
    k_bytes = 4 if cfg.position == "rope" else kv_bytes
    rings = 1 + (layout.recompute != "none")  # forward rings of K and V per layer, recomputation included
    out = []
    for op in ("send", "recv"):
        for name, nbytes, width in (("K", k_bytes, k_width), ("V", kv_bytes, v_width)):
            block = b * heads * width * s
            out.append(Collective(op, "cp", block * nbytes, (cp - 1) * n_layers * rings, "forward",
                                  f"{name} blocks round the ring"))
            out.append(Collective(op, "cp", block * nbytes, (cp - 1) * n_layers, "backward",
                                  f"{name} blocks round the ring again"))
            out.append(Collective(op, "cp", block * 4, cp * n_layers, "backward", f"{name} gradients (fp32)"))
    if last:
        out.append(Collective("all_reduce", "cp", 8, 1, "forward", "loss mean over the CP ranks"))
    return out


def step_collectives(
    cfg,
    layout: Candidate,
    seq_len: int,
    num_micro_batches: int,
    *,
    act_bytes: int = 4,
    matmul_bytes: int | None = None,
    grad_bytes: int = 4,
    param_bytes: int = 4,
    stage: int | None = None,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    label_smoothing: bool = False,
    scatter_gather: bool = False,
    zero2_per_micro_batch: bool = True,
    zero3_reshard_after_forward: bool = True,
    fp8_recipe: str = "",
    lora: LoraSpec | None = None,
) -> list[Collective]:
    """Every collective of one training step of one rank (of pipeline stage `stage`).

    The model's collectives once per micro-batch, then the data-parallel gradient traffic of
    tensorpar's `BucketedOptimizer` (flat buckets of `bucket_bytes`, filled in reverse
    parameter order; ZeRO pads each bucket to a multiple of dp): zero=0 all-reduces every
    bucket once per step; zero=1 reduce-scatters every bucket once per step and all-gathers
    the updated parameters; zero=2 the same, but reduce-scatters every micro-batch's gradients
    (``zero2_per_micro_batch``, as tensorpar and DeepSpeed do, so that full gradients never
    persist; False: once per step). zero=3 (`FullyShardedOptimizer`) all-gathers each block's
    parameters (padded to dp) in every micro-batch's forward and backward (forward only with
    ``zero3_reshard_after_forward=False``) and reduce-scatters its gradients after every
    micro-batch's backward; the root (the stage's other parameters) is gathered and its
    gradient reduce-scattered once per step.
    Then the gradient-norm scalars (one fp32 all-reduce on DP under ZeRO, on TP, on PP), the
    tied-embedding gradient between the first and last stage, and the trainer's loss average. `fp8_recipe`: with
    tensorpar's fp8 GEMMs, their amax all-reduces and (tensorwise) ZeRO-3's fp8 gathers
    (`tensorpar.planning.fp8_traffic`). `lora`: only the adapters' gradients are reduced (`_replica_gradient_traffic`).
    """
    m = num_micro_batches
    out = [dataclasses.replace(c, calls=c.calls * m)
           for c in model_collectives(cfg, layout, layout.micro_batch_size, seq_len, act_bytes=act_bytes,
                                      matmul_bytes=matmul_bytes, grad_bytes=grad_bytes, stage=stage,
                                      label_smoothing=label_smoothing, scatter_gather=scatter_gather,
                                      fp8_recipe=fp8_recipe, lora=lora)]
    if layout.replicas > 1:
        out += _replica_gradient_traffic(cfg, layout, stage, m, grad_bytes, param_bytes, bucket_bytes,
                                         zero2_per_micro_batch, zero3_reshard_after_forward,
                                         fp8_gather=fp8_recipe == "tensorwise" and lora is None, lora=lora)
    if cfg.is_moe and layout.expert_dp > 1:  # the routed experts' own buckets, over expert-DP (frozen under LoRA)
        experts = [p for p in trained(params_of(cfg, layout, stage, lora), lora) if is_expert(p[0])]
        if experts:
            _, sizes = _bucket_table(experts, param_bytes, bucket_bytes, layout.expert_dp if layout.zero else 1)
            out += _gradient_traffic(sizes, "edp", layout.zero, m, zero2_per_micro_batch, grad_bytes, param_bytes,
                                     "expert ")
    return out + _step_scalars(cfg, layout, stage, grad_bytes, lora is None)


def _replica_gradient_traffic(cfg, layout: Candidate, stage: int | None, m: int, grad_bytes: int, param_bytes: int,
                              bucket_bytes: int, zero2_per_micro_batch: bool,
                              zero3_reshard_after_forward: bool, fp8_gather: bool = False,
                              lora: LoraSpec | None = None) -> list[Collective]:
    """The step's gradient and parameter traffic of the stage's non-expert parameters over their replicas
    (the DP x CP gradient group): DistributedOptimizer's buckets (ZeRO 0 to 2) or FullyShardedOptimizer's units
    (ZeRO-3), and under ZeRO the gradient norm's all-reduce over the shards. HSDP: ZeRO's traffic within a replica
    (group "dp_shard") and each shard's fp32 gradient slice all-reduced across the replicas ("dp_replicate").
    `lora`: the buckets hold the adapters alone; ZeRO-3's frozen units are gathered alike and never reduced."""
    grads, shards = layout.shard_group, layout.shards if layout.zero else 1
    key = (repr(cfg), layout.tp, layout.ep, 0 if stage is None else stage,
           layout.split(cfg.num_layers) if layout.pp > 1 else None, param_bytes, bucket_bytes, shards, lora)
    every = params_of(cfg, layout, stage, lora)
    if key not in _BUCKET_CACHE:
        params = [p for p in trained(every, lora) if not is_expert(p[0])]
        _BUCKET_CACHE[key] = _bucket_table(params, param_bytes, bucket_bytes, shards)
    _, sizes = _BUCKET_CACHE[key]
    if layout.zero in (0, 1, 2):
        out = _gradient_traffic(sizes, grads, layout.zero, m, zero2_per_micro_batch, grad_bytes, param_bytes)
        units = dict(sizes)
    else:
        if key + ("zero3", fp8_gather) not in _BUCKET_CACHE:
            kept = [p for p in trained(every, lora) if not (fp8_gather and is_fp8_gathered(p[0]))]
            _BUCKET_CACHE[key + ("zero3", fp8_gather)] = zero3_units(kept, shards)
        root, layers, last = _BUCKET_CACHE[key + ("zero3", fp8_gather)]
        out = zero3_traffic(root, layers, last, grads, m, grad_bytes, param_bytes, zero3_reshard_after_forward)
        if lora is not None:
            base = [p for p in frozen(every, lora) if not (fp8_gather and is_fp8_gathered(p[0]))]
            out += frozen_zero3_traffic(base, shards, grads, m, param_bytes, zero3_reshard_after_forward)
        units = {**layers}
        units[root] = units.get(root, 0) + 1
        if fp8_gather:
            out += fp8_zero3_traffic(every, layout, grads, m, grad_bytes, zero3_reshard_after_forward)
            for padded, _ in fp8_units(every, shards):
                units[padded] = units.get(padded, 0) + 1
    if layout.dp_replicate > 1:
        for n, k in units.items():
            out.append(Collective("all_reduce", "dp_replicate", n // shards * 4, k, "step", "HSDP: gradient "
                                                                                           "slices across replicas"))
    if layout.zero:
        out.append(Collective("all_reduce", grads, 4, 1, "step", "gradient norm (ZeRO shards)"))
    return out


def _step_scalars(cfg, layout: Candidate, stage: int | None, grad_bytes: int, trains: bool = True) -> list[Collective]:
    """The step's closing all-reduces: the gradient norm over TP and PP, the loss sent to every stage, the tied
    embedding's gradient between the first and last stage (unless frozen: not `trains`), and the trainer's loss
    average over DP."""
    out = []
    if layout.tp > 1:
        out.append(Collective("all_reduce", "tp", 4, 1, "step", "gradient norm"))
    if layout.pp > 1:
        out.append(Collective("all_reduce", "pp", 4, 1, "step", "loss to every stage"))
        out.append(Collective("all_reduce", "pp", 4, 1, "step", "gradient norm"))
        last_rank = layout.split(cfg.num_layers).last_rank
        if trains and (cfg.tie_embeddings or cfg.num_mtp_layers) and last_rank != 0 and stage in (0, last_rank):
            n = math.ceil(cfg.vocab_size / layout.tp) * cfg.hidden_size  # this rank's rows of the padded table
            out.append(Collective("all_reduce", "embed", n * grad_bytes, 1, "step", "tied embedding gradient"))
    if layout.dp > 1:
        out.append(Collective("all_reduce", "dp", 4, 1, "step", "loss average"))
    return out


_BUCKET_CACHE: dict = {}


def _bucket_table(params, param_bytes: int, bucket_bytes: int, pad: int) -> tuple[int, dict[int, int]]:
    """(elements of all buckets, {bucket elements: how many buckets}) of `params`, each bucket padded to `pad`."""
    padded = [math.ceil(n / pad) * pad for n in bucket_sizes([n for _, n, _ in params], param_bytes, bucket_bytes)]
    sizes: dict[int, int] = defaultdict(int)  # bucket elements -> how many buckets of that size
    for n in padded:
        sizes[n] += 1
    return sum(padded), dict(sizes)


def _gradient_traffic(sizes: dict[int, int], group: str, zero: int, m: int, zero2_per_micro_batch: bool,
                      grad_bytes: int, param_bytes: int, what: str = "") -> list[Collective]:
    """BucketedOptimizer's collectives for buckets of `sizes` reduced over `group` (ZeRO 0, 1 or 2)."""
    out = []
    if zero == 0:
        for n, k in sizes.items():
            out.append(Collective("all_reduce", group, n * grad_bytes, k, "step", what + "gradient buckets"))
        return out
    per_mb = zero == 2 and zero2_per_micro_batch
    for n, k in sizes.items():
        out.append(Collective("reduce_scatter", group, n * grad_bytes, k * (m if per_mb else 1),
                              "backward" if per_mb else "step", what + "gradient buckets"))
    for n, k in sizes.items():
        out.append(Collective("all_gather", group, n * param_bytes, k, "step", what + "updated parameters"))
    return out


def params_of(cfg, layout: Candidate, stage: int | None, lora: LoraSpec | None = None) -> list[tuple[str, int, int]]:
    return layout_parameters(cfg, layout, stage, lora)


def bucket_sizes(numels: list[int], elem_bytes: int, bucket_bytes: int) -> list[int]:
    """Element counts of BucketedOptimizer's buckets: parameters in reverse order, a bucket closed
    as soon as it holds at least `bucket_bytes`."""
    buckets, current, size = [], 0, 0
    for n in reversed(numels):
        current += n
        size += n * elem_bytes
        if size >= bucket_bytes:
            buckets.append(current)
            current, size = 0, 0
    if current:
        buckets.append(current)
    return buckets


def comm_bytes_per_step(
    cfg,
    layout: Candidate,
    micro_batch: int,
    seq_len: int,
    dtype_bytes: int = 4,
    *,
    matmul_dtype_bytes: int | None = None,
    grad_dtype_bytes: int = 4,
    num_micro_batches: int = 1,
    include_optimizer: bool = False,
    stage: int | None = None,
    label_smoothing: bool = False,
    lora: LoraSpec | None = None,
) -> dict[tuple[str, str], int]:
    """Bytes per (op, group) that tensorpar's `CommStats` counts on one rank.

    With ``include_optimizer=False``: `num_micro_batches` forward/backward passes of
    `micro_batch` sequences (``mesh.stats.reset(); Transformer(cfg, mesh)(ids, targets).backward()``
    is one). With ``include_optimizer=True``: a whole training step, `micro_batch` being the
    layout's micro-batch size (data-parallel gradients, gradient norm, loss average added).
    `dtype_bytes` is the residual stream's dtype (4: fp32, also under tensorpar's bf16 autocast),
    `matmul_dtype_bytes` the row-parallel outputs' (2 under bf16 autocast); `lora`: LoRA fine-tuning.
    """
    layout = layout.replace(micro_batch_size=micro_batch)
    if include_optimizer:
        return sum_bytes(step_collectives(cfg, layout, seq_len, num_micro_batches, act_bytes=dtype_bytes,
                                          matmul_bytes=matmul_dtype_bytes, grad_bytes=grad_dtype_bytes,
                                          stage=stage, label_smoothing=label_smoothing, lora=lora))
    per_mb = model_collectives(cfg, layout, micro_batch, seq_len, act_bytes=dtype_bytes,
                               matmul_bytes=matmul_dtype_bytes, grad_bytes=grad_dtype_bytes, stage=stage,
                               label_smoothing=label_smoothing, lora=lora)
    return {k: v * num_micro_batches for k, v in sum_bytes(per_mb).items()}
