"""The parameter, gradient and optimizer bytes of one rank (`tensorpar.planning.memory` adds the activations).

ZeRO as tensorpar's optimizers run it (`tensorpar.data_parallel.bucketed`, `tensorpar.data_parallel.fully_sharded`):
ZeRO-1/2 keep an fp32 master slice (4/dp bytes) even of fp32 parameters; ZeRO-1 keeps full gradient buckets plus
the fp32 gradient slice; ZeRO-2 the slice plus the full buffers in flight; ZeRO-3 the parameter shards and, as
gathered, the root and two blocks, gradient shards plus the root's full gradient and two blocks' in flight, and no
separate master of fp32 parameters.

LoRA (a `ParamSummary` with frozen parameters): only the trained parameters (the adapters) have gradients, masters
and optimizer states; the frozen base is held in the parameters' dtype (``frozen``), whole below ZeRO-3 and sharded
over DP x CP (routed experts over expert-DP) under ZeRO-3, which gathers it with its block as it gathers the
adapters (`FullyShardedOptimizer`'s frozen units).
"""

from __future__ import annotations

import dataclasses
import math

from tensorpar.planning.candidates import Candidate
from tensorpar.planning.communication import bucket_sizes
from tensorpar.planning.lora_adapters import gradient_arrival_order, trained
from tensorpar.planning.params import ParamSummary, layout_parameters
from tensorpar.planning.precision_recipes import Precision
from tensorpar.planning.zero3_traffic import block_units
from tensorpar.tensor_parallel.lora import LoraSpec


@dataclasses.dataclass(frozen=True)
class StateBytes:
    """One rank's bytes of parameters (trained), frozen parameters, gradients, optimizer states, and the parameters
    ZeRO-3 gathers at once."""

    parameters: int
    frozen: int
    gradients: int
    optimizer: int
    gathered: int


def optimizer_state_bytes(params, precision: Precision, zero: int = 0, dp: int = 1) -> int:
    """AdamW states (+ master weights) of one rank holding `params` ((name, numel, ndim) list or a
    `ParamSummary`: its trained parameters). Unsharded: 8 bytes per element and a 4-byte `step` tensor per parameter
    tensor (torch's AdamW), plus fp32 masters when the parameters are not fp32. ZeRO-1+: 1/dp of both."""
    if isinstance(params, ParamSummary):
        numel, tensors = params.trained_numel, params.trained_tensors
    else:
        numel, tensors = sum(n for _, n, _ in params), len(params)
    return adamw_bytes(numel, tensors, precision, zero, dp)


def adamw_bytes(numel: int, tensors: int, precision: Precision, zero: int = 0, dp: int = 1,
                sharded: bool | None = None) -> int:
    """`optimizer_state_bytes` of `numel` elements in `tensors` tensors, sharded over `dp` ranks by ZeRO.
    `sharded`: whether ZeRO's optimizer holds them (default: when dp > 1; routed experts under a ZeRO run are held
    by it, with its master slice, also where their expert-DP group is one rank)."""
    states = precision.optimizer_bytes * numel + 4 * tensors
    master = precision.master_bytes * numel
    if zero >= 1 and (dp > 1 if sharded is None else sharded):
        states = math.ceil(precision.optimizer_bytes * numel / dp) + 4 * tensors
        extra_master = precision.zero_master_bytes if zero < 3 else 0  # ZeRO-3 steps its fp32 shards directly
        master = math.ceil((precision.master_bytes or extra_master) * numel / dp)
    return states + master


def zero_gradients_in_flight(layout: Candidate, every: list[tuple[str, int, int]], prec: Precision,
                             bucket_bytes: int, lora: LoraSpec | None = None, micro_batches: int = 1) -> int:
    """Bytes of tensorpar's full-size gradient buffers alive at once under ZeRO-2 (two adjacent buckets and one
    bucket's reduce-scattered slice; with several `micro_batches` a step, the last bucket of one micro-batch, still
    in the queue, beside the first of the next) or ZeRO-3 (the root's gradient, two blocks' dense units and one's
    slice, and one block's routed experts, a unit of their own), of the trained parameters among `every` (the
    stage's `layout_parameters`)."""
    dp = layout.shards
    params = trained(every, lora)
    if layout.zero == 3:
        # One block's (the largest) full-size expert gradient is alive at the peak beside two adjacent blocks' dense
        # ones and one dense slice (measured against the built rank). The blocks are the decoder layers and the MTP
        # modules, each its own size (a dense first layer, an MTP module's projection); the root is the rest.
        root, dense, experts = block_units(params)
        padded = [math.ceil(n / dp) * dp for n in dense]
        # Under fp8 the built ranks hold one block's dense unit at a time, not two (measured against the built rank:
        # tiny at DP 2, llama-8b at DP 64, with HSDP, at TP 2 + SP; a real tiny run agrees): the fp8 GEMMs' backward
        # completes a block's weight gradients before the next block's arrive
        open_blocks = max(padded, default=0) if prec.fp8_recipe else _adjacent_pair_max(padded)
        return 4 * (root + open_blocks + max(padded, default=0) // dp + max(experts, default=0))
    counts = bucket_sizes([n for _, n, _ in params], prec.param_bytes, bucket_bytes)
    sizes = [math.ceil(n / dp) * dp for n in counts]
    if lora is not None:
        return 4 * _zero2_buffers_in_flight(params, gradient_arrival_order(every), counts, sizes, dp, micro_batches)
    # the queue frees a micro-batch's last bucket (the embedding's) when the next micro-batch hands over its first
    pair = max(_adjacent_pair_max(sizes), sizes[-1] + sizes[0] if micro_batches > 1 else 0)
    return 4 * (pair + max(sizes) // dp)


def _adjacent_pair_max(sizes: list[int]) -> int:
    """The most elements two adjacent units (buckets, blocks) hold together; the one unit's when there is one."""
    return max([a + b for a, b in zip(sizes, sizes[1:])] or sizes or [0])


def _zero2_buffers_in_flight(params: list[tuple[str, int, int]], arrivals: list[str], counts: list[int],
                             sizes: list[int], dp: int, micro_batches: int = 1) -> int:
    """The most elements of ZeRO-2's full-size buffers (`sizes`, padded) alive at once when the gradients of
    `params` arrive in the order `arrivals`, once per micro-batch: a bucket's buffer from its first gradient until the
    next bucket is handed to the queue (which keeps one reduce-scatter, with its output slice, in flight, also into
    the next micro-batch's backward). The buckets hold `counts` elements of the parameters in reverse order
    (`bucket_sizes`)."""
    bucket_of, total, index, filled = {}, [0] * len(counts), 0, 0
    for name, n, _ in reversed(params):
        bucket_of[name], total[index], filled = index, total[index] + 1, filled + n
        if filled == counts[index] and index + 1 < len(counts):
            index, filled = index + 1, 0
    open_elements, in_flight, peak = 0, 0, 0
    for _ in range(min(micro_batches, 2)):  # the second micro-batch starts with the first one's last bucket in flight
        opened, left = set(), list(total)
        for name in arrivals:
            b = bucket_of[name]
            if b not in opened:
                opened.add(b)
                open_elements += sizes[b]
                peak = max(peak, open_elements + in_flight)
            left[b] -= 1
            if left[b] == 0:  # handed to the queue: the previous one completes and is freed first
                open_elements -= sizes[b]
                in_flight = sizes[b] + sizes[b] // dp
                peak = max(peak, open_elements + in_flight)
    return peak


def _gradient_bytes(numel: int, shards: int, zero: int, prec: Precision) -> int:
    """Gradient bytes of `numel` elements whose gradients are reduced over `shards` ranks (ZeRO-2: kept 1/shards;
    ZeRO-1/2 in tensorpar: full buckets plus the fp32 slice; the ZeRO-2 buffers in flight are added apart)."""
    grad_mem = prec.grad_bytes * numel
    if zero >= 2 and not prec.zero2_full_grads_at_peak:  # routed experts whose expert-DP is 1 too: their whole slice
        return math.ceil(grad_mem / shards)
    if zero == 3:  # a recipe whose full gradients are alive at the peak: their gradients alone, no slice
        return grad_mem
    if zero >= 1 and (prec.zero_master_bytes or prec.zero_buffers_in_flight):
        grad_mem += math.ceil(4 * numel / shards)  # tensorpar's fp32 gradient slice next to the full buckets
    return grad_mem


def state_bytes(cfg, layout: Candidate, summary: ParamSummary, stage: int, prec: Precision,
                bucket_bytes: int, lora: LoraSpec | None = None, micro_batches: int = 1) -> StateBytes:
    """The state bytes of one rank of `stage` holding `summary`'s parameters: ZeRO shards over every replica of the
    parameters (DP x CP; HSDP: one replica's ranks), routed experts over expert-DP; `lora`: the adapters alone
    train; `micro_batches`: each rank's per step."""
    dp, edp = layout.shards, layout.expert_dp
    zero = layout.zero if dp > 1 else 0
    pb = prec.param_bytes
    # Routed experts' gradients and optimizer states: reduced and ZeRO-sharded over expert-DP, the rest over DP x CP.
    expert = summary.trained_expert_numel
    dense = summary.trained_numel - expert
    frozen_expert = summary.frozen_expert_numel
    frozen_dense = summary.frozen_numel - frozen_expert
    param_mem, frozen_mem = pb * (dense + expert), pb * (frozen_dense + frozen_expert)
    grad_mem = _gradient_bytes(dense, dp, zero, prec) + _gradient_bytes(expert, edp, layout.zero if expert else 0, prec)
    gathered = 0
    in_flight = zero >= 2 and prec.zero_buffers_in_flight
    every = layout_parameters(cfg, layout, stage if layout.pp > 1 else 0, lora) if in_flight or zero == 3 else []
    if in_flight:
        # a tied embedding split over the pipeline's ends is reduce-scattered once a step, in finish_backward: its
        # bucket (the stage's last) is never left in the queue from one micro-batch to the next
        tied = layout.pp > 1 and (cfg.tie_embeddings or cfg.num_mtp_layers > 0) and any(
            name == "embed.weight" for name, _, _ in trained(every, lora))
        grad_mem += zero_gradients_in_flight(layout, every, prec, bucket_bytes, lora, 1 if tied else micro_batches)
    if zero == 3:  # parameters sharded like their gradients: routed experts over expert-DP, the rest over DP x CP
        param_mem = math.ceil(pb * dense / dp) + math.ceil(pb * expert / edp)
        frozen_mem = math.ceil(pb * frozen_dense / dp) + math.ceil(pb * frozen_expert / edp)
        # Gathered: the block being computed and the prefetched one, and the root (embedding, head) for the step.
        root, block_dense, block_experts = block_units(every)
        gathered = (root + _adjacent_pair_max([a + b for a, b in zip(block_dense, block_experts)])) * pb
    opt_mem = (adamw_bytes(dense, summary.trained_tensors - summary.trained_expert_tensors, prec, zero, dp)
               + adamw_bytes(expert, summary.trained_expert_tensors, prec, zero if expert else 0, edp, sharded=True))
    return StateBytes(param_mem, frozen_mem, grad_mem, opt_mem, gathered)
