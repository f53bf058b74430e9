"""Communication: alpha-beta times of the collectives, and the exact volumes tensorpar sends.

Time of one collective over ``n`` ranks on a link of latency alpha and bandwidth beta
(per GPU, per direction), for a message of ``B`` bytes counted as tensorpar's `CommStats`
counts it (the NCCL-tests "logical buffer size": all-gather = the gathered output,
reduce-scatter = the input being reduced, scatter / gather = the full tensor):

================  ==================================  =========================================
op                ring                                tree (binomial; recursive doubling)
================  ==================================  =========================================
all_reduce        2(n-1) (alpha + B/(n beta))         2 ceil(log2 n) (alpha + B/beta)
all_gather        (n-1) (alpha + B/(n beta))          ceil(log2 n) alpha + (n-1)/n B/beta
reduce_scatter    (n-1) (alpha + B/(n beta))          ceil(log2 n) alpha + (n-1)/n B/beta
broadcast         (n-1) alpha + B/beta  (pipelined)   ceil(log2 n) (alpha + B/beta)
reduce            (n-1) alpha + B/beta  (pipelined)   ceil(log2 n) (alpha + B/beta)
gather, scatter   (n-1) (alpha + B/(n beta))          ceil(log2 n) alpha + (n-1)/n B/beta
send              alpha + B/beta                      alpha + B/beta
================  ==================================  =========================================

The ring all-reduce is a reduce-scatter followed by an all-gather; the binomial tree reduce
and broadcast move the whole message at each of their ceil(log2 n) steps (the algorithms that
`tensorpar.distributed.collective_algorithms` traces). `collective_time(..., algorithm="best")` takes the
faster of the two, as NCCL's tuner does.

Which link a group uses: `tensorpar.planning.layout.group_link`.

`model_collectives` lists every collective tensorpar's model runs for one micro-batch (forward
and backward; with PP, one stage's, including its point-to-point messages), `step_collectives`
those of a whole training step (adding the data-parallel gradient traffic of
`tensorpar.parallel.data_parallel.DistributedOptimizer`, the gradient-norm scalars, the pipeline's
loss and tied-embedding all-reduces and the trainer's loss average), and `comm_bytes_per_step`
sums them per (op, group): the numbers `mesh.stats` reports after the same work
(tests/test_planning_communication.py checks equality for TP, SP, recomputation, autocast, DP, ZeRO-1/2 and PP).
"""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict

from tensorpar.config.hardware import Link
from tensorpar.errors import TensorparError
from tensorpar.parallel.data_parallel import DEFAULT_BUCKET_BYTES
from tensorpar.layers.attention import kv_layout
from tensorpar.planning.layout import Layout, gradient_group, group_link, group_size, stage_layers
from tensorpar.planning.params import local_parameters

OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce", "gather", "scatter", "send")

ALGORITHMS = ("ring", "tree", "best")


def collective_time(op: str, nbytes: float, n: int, link: Link, algorithm: str = "best") -> float:
    """Seconds for one `op` of `nbytes` (tensorpar's byte convention) over `n` ranks on `link`."""
    if op == "recv":
        op = "send"
    if op not in OPS:
        raise TensorparError(f"unknown collective {op!r}; known: {', '.join(OPS)}")
    if algorithm not in ALGORITHMS:
        raise TensorparError(f"unknown algorithm {algorithm!r}; known: {', '.join(ALGORITHMS)}")
    if op == "send":
        return link.latency + nbytes / link.bandwidth
    if n <= 1:
        return 0.0
    if algorithm == "best":
        return min(collective_time(op, nbytes, n, link, "ring"), collective_time(op, nbytes, n, link, "tree"))
    a, beta = link.latency, link.bandwidth
    steps = math.ceil(math.log2(n))
    if algorithm == "ring":
        if op == "all_reduce":
            return 2 * (n - 1) * (a + nbytes / (n * beta))
        if op in ("broadcast", "reduce"):
            return (n - 1) * a + nbytes / beta
        return (n - 1) * (a + nbytes / (n * beta))  # all_gather, reduce_scatter, gather, scatter
    if op == "all_reduce":
        return 2 * steps * (a + nbytes / beta)
    if op in ("broadcast", "reduce"):
        return steps * (a + nbytes / beta)
    return steps * a + (n - 1) / n * nbytes / beta  # all_gather, reduce_scatter, gather, scatter


@dataclasses.dataclass(frozen=True)
class Collective:
    """`calls` collectives of `nbytes` each (tensorpar's byte convention) on group `group`."""

    op: str
    group: str
    nbytes: int
    calls: int = 1
    phase: str = "forward"  # forward | backward | step
    what: str = ""

    @property
    def total_bytes(self) -> int:
        return self.nbytes * self.calls


def model_collectives(
    cfg,
    layout: Layout,
    micro_batch: int,
    seq_len: int,
    *,
    act_bytes: int = 4,
    matmul_bytes: int | None = None,
    grad_bytes: int = 4,
    stage: int | None = None,
    label_smoothing: bool = False,
    scatter_gather: bool = False,
) -> list[Collective]:
    """Every collective of one micro-batch's forward and backward through tensorpar's Transformer.

    `act_bytes`: the residual stream and its gradient (fp32 = 4 in tensorpar, also under bf16
    autocast); `matmul_bytes`: the outputs of the row-parallel linears (2 under bf16 autocast,
    default `act_bytes`); `grad_bytes`: parameter gradients (fp32 = 4 in tensorpar). `stage`
    selects one pipeline rank (None: the whole model). Nothing is sent when TP = 1 and PP = 1.
    `scatter_gather`: pipeline messages are split across the TP ranks (Megatron-LM's scatter/gather
    optimisation), as they are anyway under sequence parallelism.
    """
    mm = act_bytes if matmul_bytes is None else matmul_bytes
    first, last, n_layers = stage_layers(cfg, layout, stage)
    out: list[Collective] = []
    tp, sp, cp = layout.tp, layout.sp, layout.cp
    b, s, h = micro_batch, seq_len // cp, cfg.hidden_size  # s: the tokens of each sequence this rank holds
    bsh = b * s * h

    def add(op, nbytes, calls, phase, what, group="tp"):
        if calls:
            out.append(Collective(op, group, int(nbytes), int(calls), phase, what))

    if tp > 1:
        # Full recomputation re-runs each block's forward inside backward. torch's non-reentrant checkpoint
        # stops re-running as soon as every tensor backward needs exists again, so without dropout the MLP's
        # output reduction (the block's last op, whose result nothing saves) is not repeated.
        full = layout.recompute == "full"
        again_in = 2 if full else 0
        again_out = (2 if cfg.dropout > 0 else 1) if full else 0
        norm_params = 2 if cfg.norm == "layernorm" else 1
        if first:
            if sp:
                add("reduce_scatter", bsh * act_bytes, 1, "forward", "embedding (vocab-parallel, to sequence shards)")
                add("all_gather", bsh * act_bytes, 1, "backward", "embedding gradient")
                if cfg.position == "learned":
                    add("all_reduce", s * h * grad_bytes, 1, "backward", "position-embedding gradient (SP)")
            else:
                add("all_reduce", bsh * act_bytes, 1, "forward", "embedding (vocab-parallel)")
        L = n_layers
        if sp:
            add("all_gather", bsh * act_bytes, 2 * L, "forward", "attention / MLP input (SP gather)")
            add("reduce_scatter", bsh * mm, 2 * L, "forward", "attention / MLP output (SP reduce-scatter)")
            add("all_gather", bsh * act_bytes, again_in * L, "backward", "recomputed attention / MLP input")
            add("reduce_scatter", bsh * mm, again_out * L, "backward", "recomputed attention / MLP output")
            add("reduce_scatter", bsh * act_bytes, 2 * L, "backward", "attention / MLP input gradient")
            add("all_gather", bsh * mm, 2 * L, "backward", "attention / MLP output gradient")
            add("all_reduce", h * grad_bytes, 2 * L * norm_params, "backward", "norm weight gradients (SP)")
            if cfg.bias:
                add("all_reduce", h * grad_bytes, 2 * L, "backward", "row-parallel bias gradients (SP)")
        else:
            add("all_reduce", bsh * mm, 2 * L, "forward", "attention / MLP output (row-parallel)")
            add("all_reduce", bsh * mm, again_out * L, "backward", "recomputed attention / MLP output")
            add("all_reduce", bsh * act_bytes, 2 * L, "backward", "attention / MLP input gradient")
        if cfg.kv_heads < tp:  # replicated KV heads: one buffer with a slot per KV head, K and V separately
            kv = cfg.kv_heads * cfg.head_dim
            add("all_reduce", kv * h * grad_bytes, 2 * L, "backward", "replicated K/V weight gradients")
            if cfg.bias:
                add("all_reduce", kv * grad_bytes, 2 * L, "backward", "replicated K/V bias gradients")
        if last:
            if sp:
                add("all_reduce", h * grad_bytes, norm_params, "backward", "final norm gradients (SP)")
                add("all_gather", bsh * act_bytes, 1, "forward", "head input (SP gather)")
                add("reduce_scatter", bsh * act_bytes, 1, "backward", "head input gradient")
            else:
                add("all_reduce", bsh * act_bytes, 1, "backward", "head input gradient")
            add("all_reduce", b * s * 4, 1, "forward", "cross-entropy max (fp32)")
            add("all_reduce", (3 if label_smoothing else 2) * b * s * 4, 1, "forward", "cross-entropy sums (fp32)")
    if cp > 1:
        out += ring_collectives(cfg, layout, b, s, mm, n_layers, last)
    if layout.pp > 1 and stage is not None:
        # Point-to-point between stages (tensorpar.parallel.pipeline.PipelineRunner: fp32 hidden states
        # forward, their gradients backward, once per chunk boundary; sequence shards under SP). Both the
        # send and the matching recv are counted, each with the message's bytes.
        v, pp = layout.virtual_stages, layout.pp
        msg = b * (s // tp if (sp or scatter_gather) else s) * h * act_bytes
        add("send", msg, v - (stage == pp - 1), "forward", "activations to the next stage", "pp")
        add("recv", msg, v - (stage == 0), "forward", "activations from the previous stage", "pp")
        add("send", msg, v - (stage == 0), "backward", "activation gradients to the previous stage", "pp")
        add("recv", msg, v - (stage == pp - 1), "backward", "activation gradients from the next stage", "pp")
    return out


def ring_collectives(cfg, layout: Layout, b: int, s: int, kv_bytes: int, n_layers: int, last: bool) -> list[Collective]:
    """The context-parallel ring of one micro-batch (tensorpar.layers.ring_attention), `s` tokens per rank.

    Per layer: forward, the local K and V blocks sent cp - 1 times; backward, the same again, then their
    fp32 gradients cp - 1 times and once more home; recomputation (selective re-runs the attention core,
    full the whole layer) repeats the forward ring. K travels in fp32 after RoPE under autocast (RoPE
    promotes it), V in the matmul dtype (`kv_bytes`). Sends and receives are both counted, each with the
    message's bytes. The last stage also averages the loss over the CP ranks (two fp32 scalars)."""
    cp = layout.cp
    block = b * kv_layout(cfg.kv_heads, layout.tp)[0] * cfg.head_dim * s
    k_bytes = 4 if cfg.position == "rope" else kv_bytes
    rings = 1 + (layout.recompute != "none")  # forward rings of K and V per layer, recomputation included
    out = []
    for op in ("send", "recv"):
        for name, nbytes in (("K", k_bytes), ("V", kv_bytes)):
            out.append(Collective(op, "cp", block * nbytes, (cp - 1) * n_layers * rings, "forward",
                                  f"{name} blocks round the ring"))
            out.append(Collective(op, "cp", block * nbytes, (cp - 1) * n_layers, "backward",
                                  f"{name} blocks round the ring again"))
        out.append(Collective(op, "cp", block * 4, 2 * cp * n_layers, "backward", "K, V gradients (fp32)"))
    if last:
        out.append(Collective("all_reduce", "cp", 8, 1, "forward", "loss mean over the CP ranks"))
    return out


def step_collectives(
    cfg,
    layout: Layout,
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
) -> list[Collective]:
    """Every collective of one training step of one rank (of pipeline stage `stage`).

    The model's collectives once per micro-batch, then the data-parallel gradient traffic of
    tensorpar's `DistributedOptimizer` (flat buckets of `bucket_bytes`, filled in reverse
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
    tied-embedding gradient between the first and last stage, and the trainer's loss average.
    """
    m = num_micro_batches
    out = [dataclasses.replace(c, calls=c.calls * m)
           for c in model_collectives(cfg, layout, layout.micro_batch_size, seq_len, act_bytes=act_bytes,
                                      matmul_bytes=matmul_bytes, grad_bytes=grad_bytes, stage=stage,
                                      label_smoothing=label_smoothing, scatter_gather=scatter_gather)]
    grads = gradient_group(layout)
    if layout.replicas > 1:
        first, last, _ = stage_layers(cfg, layout, stage)
        key = (repr(cfg), layout.tp, layout.pp, 0 if stage is None else stage, layout.virtual_stages, param_bytes,
               bucket_bytes, layout.replicas if layout.zero else 1)
        if key not in _BUCKET_CACHE:
            params = params_of(cfg, layout, stage)
            pad = layout.replicas if layout.zero else 1
            padded = [math.ceil(n / pad) * pad for n in bucket_sizes([n for _, n, _ in params], param_bytes, bucket_bytes)]
            sizes: dict[int, int] = defaultdict(int)  # bucket elements -> how many buckets of that size
            for n in padded:
                sizes[n] += 1
            _BUCKET_CACHE[key] = (sum(padded), dict(sizes))
        total, sizes = _BUCKET_CACHE[key]
        if layout.zero == 0:
            for n, k in sizes.items():
                out.append(Collective("all_reduce", grads, n * grad_bytes, k, "step", "gradient buckets"))
        elif layout.zero in (1, 2):
            per_mb = layout.zero == 2 and zero2_per_micro_batch
            for n, k in sizes.items():
                out.append(Collective("reduce_scatter", grads, n * grad_bytes, k * (m if per_mb else 1),
                                      "backward" if per_mb else "step", "gradient buckets"))
            for n, k in sizes.items():
                out.append(Collective("all_gather", grads, n * param_bytes, k, "step", "updated parameters"))
        else:
            if key + ("zero3",) not in _BUCKET_CACHE:
                _BUCKET_CACHE[key + ("zero3",)] = zero3_units(params_of(cfg, layout, stage), layout.replicas)
            root, layers, last = _BUCKET_CACHE[key + ("zero3",)]
            out.append(Collective("all_gather", grads, root * param_bytes, 1, "forward", "ZeRO-3 root gather"))
            out.append(Collective("reduce_scatter", grads, root * grad_bytes, 1, "step", "ZeRO-3 root gradients"))
            for n, k in layers.items():
                out.append(Collective("all_gather", grads, n * param_bytes, k * m, "forward", "ZeRO-3 block gathers"))
                again = (k - (n == last)) * m if zero3_reshard_after_forward else 0  # the last block is kept
                if again:
                    out.append(Collective("all_gather", grads, n * param_bytes, again, "backward",
                                          "ZeRO-3 block gathers for the backward"))
                out.append(Collective("reduce_scatter", grads, n * grad_bytes, k * m, "backward",
                                      "ZeRO-3 block gradients"))
        if layout.zero:
            out.append(Collective("all_reduce", grads, 4, 1, "step", "gradient norm (ZeRO shards)"))
    if layout.tp > 1:
        out.append(Collective("all_reduce", "tp", 4, 1, "step", "gradient norm"))
    if layout.pp > 1:
        out.append(Collective("all_reduce", "pp", 4, 1, "step", "loss to every stage"))
        out.append(Collective("all_reduce", "pp", 4, 1, "step", "gradient norm"))
        if cfg.tie_embeddings and stage in (0, layout.pp - 1):
            n = math.ceil(cfg.vocab_size / layout.tp) * cfg.hidden_size  # this rank's rows of the padded table
            out.append(Collective("all_reduce", "embed", n * grad_bytes, 1, "step", "tied embedding gradient"))
    if layout.dp > 1:
        out.append(Collective("all_reduce", "dp", 4, 1, "step", "loss average"))
    return out


_BUCKET_CACHE: dict = {}


def params_of(cfg, layout: Layout, stage: int | None) -> list[tuple[str, int, int]]:
    return local_parameters(cfg, layout.tp, layout.pp, 0 if stage is None else stage, layout.virtual_stages)


def zero3_units(params: list[tuple[str, int, int]], dp: int) -> tuple[int, dict[int, int], int]:
    """ZeRO-3's gather units of a stage's (name, numel, ndim) parameters, each padded to a multiple of dp:
    (elements of the root unit, {elements of a block unit: how many blocks}, elements of the last block)."""
    root, blocks = 0, defaultdict(int)
    for name, n, _ in params:
        if name.startswith("layers."):
            blocks[name.split(".")[1]] += n
        else:
            root += n
    sizes: dict[int, int] = defaultdict(int)
    for n in blocks.values():
        sizes[math.ceil(n / dp) * dp] += 1
    last = math.ceil(list(blocks.values())[-1] / dp) * dp if blocks else 0
    return math.ceil(root / dp) * dp, dict(sizes), last


def bucket_sizes(numels: list[int], elem_bytes: int, bucket_bytes: int) -> list[int]:
    """Element counts of DistributedOptimizer's buckets: parameters in reverse order, a bucket closed
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


def sum_bytes(collectives: list[Collective]) -> dict[tuple[str, str], int]:
    """Total bytes per (op, group), in `CommStats`' keys."""
    out: dict[tuple[str, str], int] = defaultdict(int)
    for c in collectives:
        out[(c.op, c.group)] += c.total_bytes
    return dict(out)


def comm_bytes_per_step(
    cfg,
    layout: Layout,
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
) -> dict[tuple[str, str], int]:
    """Bytes per (op, group) that tensorpar's `CommStats` counts on one rank.

    With ``include_optimizer=False``: `num_micro_batches` forward/backward passes of
    `micro_batch` sequences (``mesh.stats.reset(); Transformer(cfg, mesh)(ids, targets).backward()``
    is one). With ``include_optimizer=True``: a whole training step, `micro_batch` being the
    layout's micro-batch size (data-parallel gradients, gradient norm, loss average added).
    `dtype_bytes` is the residual stream's dtype (4: fp32, also under tensorpar's bf16 autocast),
    `matmul_dtype_bytes` the row-parallel outputs' (2 under bf16 autocast).
    """
    layout = dataclasses.replace(layout, micro_batch_size=micro_batch)
    if include_optimizer:
        return sum_bytes(step_collectives(cfg, layout, seq_len, num_micro_batches, act_bytes=dtype_bytes,
                                          matmul_bytes=matmul_dtype_bytes, grad_bytes=grad_dtype_bytes,
                                          stage=stage, label_smoothing=label_smoothing))
    per_mb = model_collectives(cfg, layout, micro_batch, seq_len, act_bytes=dtype_bytes,
                               matmul_bytes=matmul_dtype_bytes, grad_bytes=grad_dtype_bytes, stage=stage,
                               label_smoothing=label_smoothing)
    return {k: v * num_micro_batches for k, v in sum_bytes(per_mb).items()}


def collectives_time(collectives: list[Collective], cluster, layout: Layout, algorithm: str = "best") -> float:
    """Seconds the listed collectives take back to back (one after another, nothing overlapped)."""
    total = 0.0
    for c in collectives:
        n = group_size(layout, c.group)
        link = group_link(cluster, layout, c.group)
        total += c.calls * collective_time(c.op, c.nbytes, n, link, algorithm)
    return total
