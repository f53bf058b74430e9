"""What ZeRO 0, 1 and 2 share: bucketed gradients whose collectives overlap the backward pass.

A bucket's collective starts, asynchronously, the moment the backward of the step's *last* micro-batch has
accumulated every gradient in it; earlier micro-batches only accumulate locally (ZeRO-2 differs: see
`zero.Zero2Optimizer`). The stage classes say what the collective is and what AdamW steps:

=========  =====================================================================================
zero=0     `AllReduceOptimizer`: all-reduce each bucket's gradients, average, clip, AdamW on the
           full parameters on every rank
zero=1     `Zero1Optimizer`: reduce-scatter each bucket's gradients; each rank clips and steps only
           its 1/dp slice (fp32 master slice and AdamW states: 1/dp of the memory), then
           all-gathers the updated parameters into the buckets
zero=2     `Zero2Optimizer`: as ZeRO-1, but the gradients do not stay in full buckets (reduce-
           scattered per micro-batch into the rank's fp32 slice; a few buckets' buffers alive at once)
=========  =====================================================================================

HSDP (`Mesh.dp_shard_group` smaller than DP x CP): ZeRO-1/2 shard each bucket within a replica and all-reduce each
reduce-scattered slice across the replicas (`Mesh.dp_replicate_group`) before averaging: reduce-scatter inside,
all-reduce across, all-gather inside.

Mixture-of-experts models: the routed experts' buckets are reduced (ZeRO: sharded) over the mesh's expert-data-
parallel group, whose members hold the same experts, instead of DP x CP. Both kinds are divided by the DP x CP
size: every rank's token gradients carry that factor (the loss is a per-rank mean), and the expert-DP ranks
together saw every token once.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from tensorpar.data_parallel.buckets import DEFAULT_BUCKET_BYTES, Bucket, make_buckets
from tensorpar.data_parallel.flat_buffer import BytesInUse, nbytes
from tensorpar.data_parallel.host_masters import offloaded_memory
from tensorpar.data_parallel.shard_pieces import adamw_step_count, state_bytes
from tensorpar.distributed.sharding import shard_spec
from tensorpar.errors import TensorparError
from tensorpar.data_parallel.muon_matrices import step_rule, whole_parameters
from tensorpar.optim.grad_norm import unscale_and_clip


class BucketedOptimizer:
    """AdamW whose gradients are reduced over the mesh's DP (x CP) group in buckets; a stage class (ZeRO 0, 1, 2)
    says how. Use per optimizer step::

        opt.begin_step(num_microbatches)   # before the first forward of the step
        ... forward / backward of every micro-batch ...
        opt.finish_backward()              # waits for the bucket collectives
        norm = opt.clip_and_step(max_norm)
    """

    zero: int  # the ZeRO stage
    sharded = False  # each rank steps 1/dp of every bucket

    def __init__(self, model: nn.Module, mesh, *, lr: float, weight_decay: float, betas=(0.9, 0.95),
                 eps: float = 1e-8, bucket_bytes: int | float = DEFAULT_BUCKET_BYTES,
                 reduce_dtype: torch.dtype = torch.float32, optimizer: str = "adamw", muon_momentum: float = 0.95,
                 offload: bool = False, state_dtype: torch.dtype = torch.float32):
        # Gradients are averaged (ZeRO: sharded) over every rank that holds the same parameters and saw other
        # tokens: DP, times CP under context parallelism.
        self.mesh, self.dp = mesh, mesh.dp_cp_group
        # HSDP: ZeRO shards within a replica and all-reduces the shards' gradients across the replicas.
        self.shards = getattr(mesh, "dp_shard_group", None) or self.dp
        self.replicas = getattr(mesh, "dp_replicate_group", None)
        params = [p for p in model.parameters() if p.requires_grad]
        if not params:
            raise TensorparError(f"{type(self).__name__}: the model has no trainable parameters")
        # bf16/fp16 parameters: gradients move into flat buffers of `reduce_dtype` (fp32 by default) as they arrive,
        # are accumulated and reduced there, and AdamW steps fp32 master copies.
        self.mixed = params[0].dtype != torch.float32
        self.reduce_dtype = reduce_dtype if self.mixed else torch.float32
        self.buckets: list[Bucket] = make_buckets(params, bucket_bytes, self.shards if self.sharded else self.dp,
                                                  getattr(mesh, "expert_dp_group", None), self.sharded)
        self._bucket_of = {id(p): b for b in self.buckets for p in b.params}
        # A tied embedding split across the first and last pipeline stage: its two copies' gradients are
        # summed (embed group) before DP sees them, so their buckets start only in finish_backward.
        self.tied = [p for p in params if shard_spec(p).pipeline_tied]
        for p in self.tied:
            self._bucket_of[id(p)].deferred = True
        self._expected = 1
        self.nonfinite: list[nn.Parameter] = []  # after a skipped step: this rank's parameters with NaN/Inf gradients
        self._hooks = [p.register_post_accumulate_grad_hook(self._grad_ready) for p in params]
        self.param_bytes = sum(nbytes(b.param_buffer) for b in self.buckets)
        self.grad_bytes = BytesInUse()
        self._allocate_grads()
        self.offload = offload  # --optimizer-offload: the masters and states in host memory (host_masters.py)
        self.weights = self._build_weights(params, weight_decay)
        slices = getattr(self.weights, "slices", None) or whole_parameters(self.buckets)
        self.optimizer = step_rule(model, mesh, self.weights, slices, optimizer, lr=lr, betas=betas, eps=eps,
                                   momentum=muon_momentum, state_dtype=state_dtype)

    # -- what each stage decides --------------------------------------------------------------------------

    def _allocate_grads(self) -> None:
        """Persistent gradient buffers (ZeRO 0 and 1): fp32 parameters' .grad are views of them."""
        for b in self.buckets:
            if self.mixed:
                b.gradient_buffer(self.reduce_dtype, self.grad_bytes)
            else:
                b.attach_grads()
                self.grad_bytes.add(nbytes(b.grad_buffer))

    def _build_weights(self, params, weight_decay):
        raise NotImplementedError

    def _launch(self, b: Bucket) -> None:
        """Start the bucket's gradient collective."""
        raise NotImplementedError

    def _reduced(self, b: Bucket) -> None:
        """After the bucket's collective: its averaged gradient where AdamW reads it."""
        raise NotImplementedError

    def _publish(self) -> None:
        """After the AdamW step: the updated weights into the parameters."""

    # -- the step ------------------------------------------------------------------------------------------

    def begin_step(self, num_microbatches: int) -> None:
        """Gradients are communicated after this many backward passes through each parameter (times its
        ``backward_passes`` per micro-batch: 2 for a tied embedding whose lookup and head run in two chunks)."""
        self._expected = num_microbatches
        self.grad_bytes.reset_peak()
        for b in self.buckets:
            b.ready = 0
            b.pending = None
            b.arrivals = sum(shard_spec(p).backward_passes for p in b.params)  # per micro-batch

    def _grad_ready(self, param: torch.Tensor) -> None:
        bucket = self._bucket_of[id(param)]
        bucket.ready += 1
        bucket.collect(param)
        if bucket.ready == bucket.arrivals * self._expected and not bucket.deferred:
            self._launch(bucket)

    def finish_backward(self) -> None:
        """Start any bucket not yet started (in bucket order, the same on every rank), wait for all, average."""
        self._sum_tied_across_stages()
        for b in self.buckets:
            if b.pending is None:
                self._launch(b)
        for b in self.buckets:
            b.pending.wait()
            b.pending = None
            self._reduced(b)

    def _sum_tied_across_stages(self) -> None:
        """Sum the tied embedding's gradient over its first- and last-stage copies (in its bucket's buffer)."""
        for p in self.tied:
            b = self._bucket_of[id(p)]
            offset = b.offset_of[id(p)]
            self.mesh.embed_group.all_reduce(b.grad_buffer[offset : offset + p.numel()])

    def clip_and_step(self, max_norm: float, scaler=None) -> torch.Tensor:
        """Clip by the dense model's gradient norm, take the AdamW step, and bring the updated weights into the
        parameters. With a `DynamicLossScaler` (fp16) the gradients are first divided by its scale. A step whose
        gradient norm is not finite is skipped (without a scaler, `nonfinite` then lists this rank's parameters
        whose gradient is NaN or Inf). Returns the norm before clipping."""
        norm, skip = unscale_and_clip(self.weights.params, max_norm, self.mesh, self.sharded, scaler)
        self.nonfinite = self.weights.nonfinite() if skip and scaler is None else []
        if not skip:
            self.optimizer.step()
            self._publish()
        self._zero_grads()
        return norm

    def _zero_grads(self) -> None:
        for b in self.buckets:
            if b.grad_buffer is not None:
                b.grad_buffer.zero_()

    def memory(self) -> dict[str, int]:
        """This rank's bytes of parameters, gradients (the most alive at once since `begin_step`) and optimizer
        state (AdamW moments and the fp32 masters of bf16/fp16 parameters, whole or, under ZeRO, their slices;
        `host_optimizer` instead when offloaded)."""
        master = self.weights.master_bytes()
        return offloaded_memory(self.weights, self.optimizer, {
            "parameters": self.param_bytes, "gradients": self.grad_bytes.peak,
            "optimizer": state_bytes(self.optimizer) + master})

    # -- checkpoints: moments in the layout of the local (TP-sharded) parameters, whatever the ZeRO stage --

    def gathered(self):
        """A context in which every parameter holds its values (always so below ZeRO-3)."""
        return contextlib.nullcontext()

    def local_state(self, names: dict[int, str]) -> tuple[dict[str, dict[str, torch.Tensor]], int]:
        """({parameter name: its optimizer state} for this rank's local parameters, the step count).
        With ZeRO the moments are all-gathered over DP (a collective: call on every rank)."""
        return self.weights.local_state(self.optimizer, names, with_master=self.mixed), adamw_step_count(self.optimizer)

    def kinds_of(self, name: str, shape) -> tuple[str, ...]:
        """The optimizer state the parameter `name` keeps (AdamW's moments, or Muon's momentum)."""
        return self.optimizer.kinds_of(name, shape)

    def load_local_state(self, states: dict[str, dict[str, torch.Tensor]], step: int, names: dict[int, str]) -> None:
        """Set the optimizer state (local parameter layout, as `local_state` returns) and the step count."""
        self.weights.load_local_state(self.optimizer, states, step, names)

    def reload_parameters(self) -> None:
        """After parameters were overwritten in place (a checkpoint load): refresh the master slices."""
        self.weights.reload()

    def state_bytes(self) -> int:
        """Bytes of optimizer state (AdamW moments) held by this rank."""
        return state_bytes(self.optimizer)
