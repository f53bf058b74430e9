"""Data parallelism around the TP (and PP) model: bucketed gradient averaging overlapped with the
backward pass, and ZeRO-1 / ZeRO-2 (the Playbook's DP chapter).

Parameters and gradients live in flat per-bucket buffers (each `param.data` and `param.grad` is a
view), buckets filled in reverse order so that the last layers' bucket, whose gradients are ready
first, is sent first. A bucket's collective starts, asynchronously, the moment the backward of
the step's *last* micro-batch has accumulated every gradient in it; earlier micro-batches only
accumulate locally. Per step:

=========  =====================================================================================
zero=0     all-reduce each bucket's gradients (every gradient byte once per step), average,
           clip, AdamW on the full parameters on every rank
zero=1     reduce-scatter each bucket's gradients; each rank clips and steps only its 1/dp slice
           (fp32 master slice and AdamW states: 1/dp of the memory), then all-gathers the
           updated parameters into the buckets
zero=2     gradients do not stay in full buckets: a bucket's buffer is allocated when its first
           gradient of a micro-batch arrives, reduce-scattered into the rank's fp32 slice as soon as
           the micro-batch has filled it, and released when that completes (at most 3 buckets'
           buffers exist at once). So the gradient memory is 1/dp of ZeRO-1's plus a few buckets;
           the price: with gradient accumulation every micro-batch's gradients are reduce-scattered
           (as DeepSpeed's ZeRO-2 does), not one reduction per step. Then as zero=1.
=========  =====================================================================================

Mixture-of-experts models: the routed experts' weights (ShardSpec group "ep") go into buckets of their own,
reduced (ZeRO: sharded) over the mesh's expert-data-parallel group, whose members hold the same experts, instead
of DP x CP. Both kinds are divided by the DP x CP size: every rank's token gradients carry that factor (the
loss is a per-rank mean), and the expert-DP ranks together saw every token once.

ZeRO-3 (parameters sharded too) is `tensorpar.parallel.fully_sharded.FullyShardedOptimizer`.
"""

from __future__ import annotations

import contextlib
import math

import torch
from torch import nn

from tensorpar.config.choices import ZERO_STAGES
from tensorpar.distributed.comm import Group
from tensorpar.errors import TensorparError
from tensorpar.layers.sharding import shard_spec
from tensorpar.optim.adamw import adamw, takes_weight_decay
from tensorpar.optim.grad_norm import unscale_and_clip
from tensorpar.parallel.shard_pieces import (MOMENTS, BytesInUse, ReduceScatterQueue, adamw_step_count, add_to_flat,
                                             cut_pieces, gather_moments, load_moments, nbytes, slice_bounds,
                                             state_bytes)

DEFAULT_BUCKET_BYTES = 25 * 2**20


class _Bucket:
    def __init__(self, params: list[nn.Parameter], pad_to: int, device, group: Group):
        self.params, self.group = params, group  # the group its gradients are reduced over
        self.numel = sum(p.numel() for p in params)
        self.padded = math.ceil(self.numel / pad_to) * pad_to
        dtype = params[0].dtype
        self.param_buffer = torch.zeros(self.padded, dtype=dtype, device=device)
        self.offsets = []
        offset = 0
        with torch.no_grad():
            for p in params:
                self.param_buffer[offset : offset + p.numel()].copy_(p.detach().flatten())
                p.data = self.param_buffer[offset : offset + p.numel()].view_as(p)
                self.offsets.append(offset)
                offset += p.numel()
        self.offset_of = {id(p): off for p, off in zip(params, self.offsets)}
        self.grad_buffer: torch.Tensor | None = None
        self.pending = None
        self.ready = 0
        self.arrivals = len(params)  # gradient arrivals per micro-batch (begin_step counts them)
        self.deferred = False

    def attach_grads(self) -> None:
        """Give every parameter a zeroed `.grad` that is a view of this bucket's gradient buffer."""
        self.grad_buffer = torch.zeros_like(self.param_buffer)
        for p, offset in zip(self.params, self.offsets):
            p.grad = self.grad_buffer[offset : offset + p.numel()].view_as(p)


class DistributedOptimizer:
    """AdamW whose gradients are averaged (zero=0) or sharded (zero=1, 2) across the mesh's DP group.

    Use per optimizer step::

        opt.begin_step(num_microbatches)   # before the first forward of the step
        ... forward / backward of every micro-batch ...
        opt.finish_backward()              # waits for the bucket collectives
        norm = opt.clip_and_step(max_norm)
    """

    def __init__(self, model: nn.Module, mesh, *, lr: float, weight_decay: float, betas=(0.9, 0.95),
                 eps: float = 1e-8, zero: int = 0, bucket_bytes: int | float = DEFAULT_BUCKET_BYTES,
                 reduce_dtype: torch.dtype = torch.float32):
        if zero not in ZERO_STAGES or zero == 3:
            raise TensorparError(f"DistributedOptimizer runs ZeRO 0, 1 or 2, got {zero} (ZeRO-3: FullyShardedOptimizer)")
        # Gradients are averaged (ZeRO: sharded) over every rank that holds the same parameters and saw other
        # tokens: DP, times CP under context parallelism.
        self.mesh, self.zero, self.dp = mesh, zero, mesh.dp_cp_group
        params = [p for p in model.parameters() if p.requires_grad]
        if not params:
            raise TensorparError("DistributedOptimizer: the model has no trainable parameters")
        device = params[0].device
        # bf16/fp16 parameters: gradients move into flat buffers of `reduce_dtype` (fp32 by default) as they arrive,
        # are accumulated and reduced there, and AdamW steps fp32 master copies (whole ones under ZeRO-0).
        self.mixed = params[0].dtype != torch.float32
        self.reduce_dtype = reduce_dtype if self.mixed else torch.float32
        groups_of = {False: self.dp, True: getattr(mesh, "expert_dp_group", None)}  # by "is a routed expert's weight"
        self.buckets: list[_Bucket] = []
        current, size = {False: [], True: []}, {False: 0, True: 0}

        def close(kind: bool) -> None:
            group = groups_of[kind]
            self.buckets.append(_Bucket(current[kind], group.size if zero else 1, device, group))
            current[kind], size[kind] = [], 0

        for p in reversed(params):
            kind = shard_spec(p).expert
            if kind and groups_of[True] is None:
                raise TensorparError("the model has routed experts but the mesh no expert groups: "
                                     "build it with init_mesh(..., ep=N)")
            current[kind].append(p)
            size[kind] += p.numel() * p.element_size()
            if size[kind] >= bucket_bytes:
                close(kind)
        for kind in (False, True):
            if current[kind]:
                close(kind)
        self._bucket_of = {id(p): b for b in self.buckets for p in b.params}
        # A tied embedding split across the first and last pipeline stage: its two copies' gradients are
        # summed (embed group) before DP sees them, so their buckets start only in finish_backward.
        self.tied = [p for p in params if getattr(p, "pipeline_tied", False)]
        for p in self.tied:
            self._bucket_of[id(p)].deferred = True
        self._expected = 1
        self._hooks = [p.register_post_accumulate_grad_hook(self._grad_ready) for p in params]
        self.param_bytes = sum(nbytes(b.param_buffer) for b in self.buckets)
        self.grad_bytes = BytesInUse()
        self.queue = ReduceScatterQueue(self.dp, self.grad_bytes)
        if zero < 2:  # the gradients live in the buckets for good
            for b in self.buckets:
                if self.mixed:
                    b.grad_buffer = torch.zeros(b.padded, dtype=self.reduce_dtype, device=device)
                else:
                    b.attach_grads()
                self.grad_bytes.add(nbytes(b.grad_buffer))

        groups = [{"params": [], "weight_decay": weight_decay}, {"params": [], "weight_decay": 0.0}]
        if zero or self.mixed:
            self._build_master_slices(groups)
        else:
            for p in params:
                groups[0 if takes_weight_decay(p) else 1]["params"].append(p)
        self.optimizer = adamw(groups, lr=lr, betas=betas, eps=eps)

    # -- ZeRO bookkeeping ---------------------------------------------------------------------

    def _build_master_slices(self, groups) -> None:
        """For each bucket, this rank's 1/dp slice: an fp32 master copy, its gradient slice, and one optimizer
        parameter per piece of an original parameter it covers."""
        self.slices: list[nn.Parameter] = []
        for b in self.buckets:
            b.slice_group = b.group if self.zero else Group.single("dp")  # ZeRO-0: a master of the whole bucket
            lo_b, hi_b = slice_bounds(b.padded, b.slice_group.rank, b.slice_group.size)
            b.master = b.param_buffer[lo_b:hi_b].detach().clone().float()
            if self.zero == 0 and b.grad_buffer.dtype == torch.float32:
                b.grad_shard = b.grad_buffer  # the all-reduced fp32 buffer is the master's gradient
            else:
                b.grad_shard = torch.zeros_like(b.master)
                self.grad_bytes.add(nbytes(b.grad_shard))
            b.pieces = cut_pieces(b.params, [p.shape for p in b.params], b.offsets, lo_b, hi_b, b.master, b.grad_shard, groups)
            self.slices += [piece.opt_param for piece in b.pieces]

    # -- the step ------------------------------------------------------------------------------

    def begin_step(self, num_microbatches: int) -> None:
        """Gradients are communicated after this many backward passes through each parameter (times its
        ``backward_passes`` per micro-batch: 2 for a tied embedding whose lookup and head run in two chunks)."""
        self._expected = num_microbatches
        self.grad_bytes.reset_peak()
        for b in self.buckets:
            b.ready = 0
            b.pending = None
            b.arrivals = sum(getattr(p, "backward_passes", 1) for p in b.params)  # per micro-batch

    def _grad_ready(self, param: torch.Tensor) -> None:
        bucket = self._bucket_of[id(param)]
        bucket.ready += 1
        if self.zero == 2:
            return self._gather_grad(bucket, param)
        if self.mixed:
            add_to_flat(bucket.grad_buffer, param, bucket.offset_of[id(param)])
        if bucket.ready == bucket.arrivals * self._expected and not bucket.deferred:
            self._launch(bucket)

    def _ensure_grad_buffer(self, b: _Bucket) -> torch.Tensor:
        """ZeRO-2: the bucket's gradient buffer, allocated (and counted) when first needed."""
        if b.grad_buffer is None:
            b.grad_buffer = torch.zeros(b.padded, dtype=self.reduce_dtype, device=b.grad_shard.device)
            self.grad_bytes.add(nbytes(b.grad_buffer))
        return b.grad_buffer

    def _gather_grad(self, b: _Bucket, param: torch.Tensor) -> None:
        """ZeRO-2: move the gradient into its bucket (allocated now if needed); hand a full bucket to the queue."""
        add_to_flat(self._ensure_grad_buffer(b), param, b.offset_of[id(param)])
        if b.ready % b.arrivals == 0 and not b.deferred:
            self.queue.push(b, b.grad_buffer, b.group)
            b.grad_buffer = None

    def _launch(self, b: _Bucket) -> None:
        if self.zero:
            b.rs_out = b.grad_shard
            if b.grad_buffer.dtype != b.grad_shard.dtype:  # reduced in bf16: into a bf16 slice, then widened
                b.rs_out = torch.empty(b.grad_shard.numel(), dtype=b.grad_buffer.dtype, device=b.grad_buffer.device)
            b.pending = b.group.reduce_scatter_async(b.rs_out, b.grad_buffer)
        else:
            b.pending = b.group.all_reduce_async(b.grad_buffer)

    def finish_backward(self) -> None:
        """Start any bucket not yet started (in bucket order, the same on every rank), wait for all, average."""
        if self.zero == 2:
            return self._finish_zero2()
        self._sum_tied_across_stages()
        for b in self.buckets:
            if b.pending is None:
                self._launch(b)
        for b in self.buckets:
            b.pending.wait()
            b.pending = None
            if self.zero:
                if b.rs_out is not b.grad_shard:
                    b.grad_shard.copy_(b.rs_out)
                b.grad_shard.div_(self.dp.size)
            elif self.mixed and b.grad_shard is not b.grad_buffer:
                b.grad_shard.copy_(b.grad_buffer).div_(self.dp.size)
            else:
                b.grad_buffer.div_(self.dp.size)

    def _sum_tied_across_stages(self) -> None:
        """Sum the tied embedding's gradient over its first- and last-stage copies (in its bucket's buffer)."""
        for p in self.tied:
            b = self._bucket_of[id(p)]
            offset = b.offset_of[id(p)]
            self.mesh.embed_group.all_reduce(b.grad_buffer[offset : offset + p.numel()])

    def _finish_zero2(self) -> None:
        deferred = [b for b in self.buckets if b.deferred]  # the tied embedding's: its stages' gradients first
        for b in deferred:
            self._ensure_grad_buffer(b)
        self._sum_tied_across_stages()
        for b in deferred:
            self.queue.push(b, b.grad_buffer, b.group)
            b.grad_buffer = None
        self.queue.drain()
        for b in self.buckets:
            b.grad_shard.div_(self.dp.size)

    def clip_and_step(self, max_norm: float, scaler=None) -> torch.Tensor:
        """Clip by the dense model's gradient norm, take the AdamW step, and (ZeRO) all-gather the parameters.
        With a `DynamicLossScaler` (fp16) the gradients are first divided by its scale, and a step whose gradients
        overflowed is skipped. Returns the norm before clipping."""
        params = self.slices if (self.zero or self.mixed) else [p for b in self.buckets for p in b.params]
        norm, skip = unscale_and_clip(params, max_norm, self.mesh, bool(self.zero), scaler)
        if not skip:
            self.optimizer.step()
            if self.zero:
                pending = []
                for b in self.buckets:
                    shard = b.master.to(b.param_buffer.dtype)
                    pending.append((b.group.all_gather_async(b.param_buffer, shard), shard))
                for work, _ in pending:
                    work.wait()
            elif self.mixed:
                for b in self.buckets:
                    b.param_buffer.copy_(b.master)
        for b in self.buckets:
            if b.grad_buffer is not None:
                b.grad_buffer.zero_()
            if self.zero == 2:
                b.grad_shard.zero_()  # ZeRO-2 adds each micro-batch's reduce-scatter into it
        return norm

    def memory(self) -> dict[str, int]:
        """This rank's bytes of parameters, gradients (the most alive at once since `begin_step`) and optimizer
        state (AdamW moments and, under ZeRO, the fp32 master slices)."""
        master = sum(nbytes(b.master) for b in self.buckets) if self.zero else 0
        return {"parameters": self.param_bytes, "gradients": self.grad_bytes.peak,
                "optimizer": state_bytes(self.optimizer) + master}

    # -- checkpoints: moments in the layout of the local (TP-sharded) parameters, whatever the ZeRO stage --

    def gathered(self):
        """A context in which every parameter holds its values (always so below ZeRO-3)."""
        return contextlib.nullcontext()

    def local_state(self, names: dict[int, str]) -> tuple[dict[str, dict[str, torch.Tensor]], int]:
        """({parameter name: {"exp_avg", "exp_avg_sq"}} for this rank's local parameters, AdamW step count).
        With ZeRO the moments are all-gathered over DP (a collective: call on every rank)."""
        step = adamw_step_count(self.optimizer)
        if self.zero or self.mixed:
            out = {}
            for group in dict.fromkeys(b.slice_group for b in self.buckets):  # dense buckets', then experts'
                buckets = [b for b in self.buckets if b.slice_group is group]
                out.update(gather_moments(buckets, self.optimizer, group, names, with_master=self.mixed))
            return out, step
        out = {}
        for b in self.buckets:
            for p in b.params:
                st = self.optimizer.state.get(p, {})
                out[names[id(p)]] = {k: (st[k].clone() if k in st else torch.zeros_like(p)) for k in MOMENTS}
        return out, step

    def load_local_state(self, states: dict[str, dict[str, torch.Tensor]], step: int, names: dict[int, str]) -> None:
        """Set AdamW moments (local parameter layout, as `local_state` returns) and the step count."""
        if self.zero or self.mixed:
            load_moments(self.buckets, self.optimizer, states, step, names)
            if self.mixed and not self.zero:
                for b in self.buckets:
                    b.param_buffer.copy_(b.master)
            return None
        step_tensor = torch.tensor(float(step))
        for b in self.buckets:
            for p in b.params:
                st = states[names[id(p)]]
                self.optimizer.state[p] = {"step": step_tensor.clone(),
                                           **{k: st[k].to(p).clone() for k in MOMENTS}}

    def reload_parameters(self) -> None:
        """After parameters were overwritten in place (a checkpoint load): refresh the master slices."""
        if self.zero or self.mixed:
            for b in self.buckets:
                lo, hi = slice_bounds(b.padded, b.slice_group.rank, b.slice_group.size)
                b.master.copy_(b.param_buffer[lo:hi])

    def state_bytes(self) -> int:
        """Bytes of optimizer state (AdamW moments) held by this rank."""
        return state_bytes(self.optimizer)
