"""ZeRO-3: fully sharded data parallelism (the Playbook's DP chapter, last stage; PyTorch FSDP, DeepSpeed stage 3).

Each DP (x CP) rank stores 1/dp of every parameter, gradient and optimizer state of its part of the model (its
TP shard of its pipeline stage). Parameters are grouped into units that are gathered and freed together: one
per transformer block, and a root unit with the rest of the stage (embedding, positions, final norm, head).

Mixture-of-experts models: a block's routed experts (ShardSpec group "ep") form a unit of their own, sharded,
gathered and reduce-scattered over the mesh's expert-data-parallel group (whose ranks hold the same experts)
instead of DP x CP; it is gathered and freed with its block's dense unit. Its gradients are divided by the
DP x CP size like the dense ones (every rank's token gradients carry that factor; the expert-DP ranks together
saw every token once).

Per micro-batch, for a block:

=========  ==========================================================================================
forward    all-gather the block's flat parameters just before it runs, starting the next block's
           all-gather at the same time (it runs while this block computes); free them after the block
           (``reshard_after_forward=False`` keeps them for the backward: more memory, one all-gather less;
           the stage's last block is always kept, the backward starts with it)
backward   all-gather again when the gradient reaches the block's output, starting the previous
           block's; free them when every parameter's gradient is in, and reduce-scatter the flat
           gradient into this rank's fp32 gradient shard (asynchronously; the full gradient is dropped)
=========  ==========================================================================================

The root unit is gathered at its first use in a step and kept until the optimizer step; its gradients are
summed over the step's micro-batches (the tied embedding's also over the first and last pipeline stage) and
reduce-scattered once, in `finish_backward`.

Gradient accumulation: a block's gradients are reduce-scattered after every micro-batch, not once per step.
Keeping full gradients across micro-batches would hold the whole stage's gradients at once, which ZeRO-3 is
there to avoid (FSDP and DeepSpeed make the same choice). Per block and micro-batch the communication is one
all-gather in forward, one in backward (none with reshard_after_forward=False, nor for the stage's last block)
and one reduce-scatter.

Frozen parameters (LoRA's base weights) are sharded too, in units of their own beside each block's and the root's:
gathered and freed with their block (with the root), never reduce-scattered, with no master weights or optimizer
state. A block's frozen unit is freed once the backward has left the block (when the gradient reaches the block
before it, or at the end of the step), since its weights compute the input gradient.

HSDP (`Mesh.dp_shard_group` smaller than DP x CP): the units are sharded within a replica (gathers and
reduce-scatters inside it) and each unit's gradient slice is all-reduced across the replicas once per step, in
`finish_backward`.
"""

from __future__ import annotations

import contextlib
import functools

import torch
from torch import nn

from tensorpar.data_parallel.flat_buffer import BytesInUse, FlatBuffer, nbytes
from tensorpar.data_parallel.host_masters import HostMasterWeights, offloaded_memory
from tensorpar.data_parallel.master_weights import MasterWeights
from tensorpar.data_parallel.reduce_scatter_queue import ReduceScatterQueue, sum_over_replicas
from tensorpar.data_parallel.shard_pieces import adamw_step_count, state_bytes
from tensorpar.distributed.sharding import shard_spec
from tensorpar.errors import TensorparError
from tensorpar.data_parallel.muon_matrices import step_rule
from tensorpar.optim.grad_norm import unscale_and_clip
from tensorpar.layers.attention import KVParallelLinear
from tensorpar.tensor_parallel import fp8_scaling
from tensorpar.tensor_parallel.linear import ColumnParallelLinear, RowParallelLinear


def _fp8_gathered(model: nn.Module, block: nn.Module) -> set[int]:
    """The parameters of `block` gathered in fp8: its column/row-parallel weights when the model's GEMMs are fp8
    with tensorwise scales (a rowwise recipe scales the weights per row and per column, not by one scale)."""
    fp8 = getattr(getattr(model, "region", None), "fp8", None)
    if fp8 is None or fp8.rowwise:
        return set()
    return {id(m.weight) for m in block.modules()
            if isinstance(m, (ColumnParallelLinear, RowParallelLinear, KVParallelLinear))}


class _Unit(FlatBuffer):
    """Parameters gathered and freed together; between uses each holds an empty tensor. Sharded over `dp_group`
    (kept as `.dp`): DP x CP, or expert-DP for a block's routed experts."""

    def __init__(self, name: str, params: list[nn.Parameter], dp_group, root: bool, gathered: BytesInUse):
        super().__init__(params, dp_group.size)
        self.name, self.root, self.dp, self.gathered = name, root, dp_group, gathered
        lo, hi = self.slice_bounds(dp_group)
        self.shard = self.pack()[lo:hi].clone()  # the parameters this rank stores
        self.slice = None  # the MasterSlice AdamW steps (the shard itself when fp32)
        self.full: torch.Tensor | None = None
        self._gather = None
        self.ready = 0
        self.in_backward = False
        self._empty = torch.empty(0, dtype=self.shard.dtype, device=self.shard.device)
        self.free()

    def start_gather(self) -> None:
        """Start all-gathering the parameters (nothing if they are gathered or being gathered)."""
        if self.full is None:
            self.full = torch.empty(self.padded, dtype=self.shard.dtype, device=self.shard.device)
            self.gathered.add(nbytes(self.full))
            self._gather = self.dp.all_gather_async(self.full, self.shard)

    def wait_gather(self) -> None:
        """Make every parameter hold its values (a view of the gathered flat buffer)."""
        self.start_gather()
        if self._gather is not None:
            self._gather.wait()
            self._gather = None
            self.bind(self.full)

    def free(self) -> None:
        if self._gather is not None:
            self._gather.wait()  # never drop a collective in flight
            self._gather = None
        for p in self.params:
            p.data = self._empty
        self.gathered.sub(nbytes(self.full))
        self.full = None


class _Fp8Unit(_Unit):
    """A block's column/row-parallel weights under tensorwise fp8 GEMMs, gathered in fp8: each weight is cast with
    one power-of-two scale from the amax of the whole weight (all its DP shards, and its TP shards: the scale the
    layer itself takes), so the all-gather moves 1 byte per element instead of 2, and dequantised into the
    parameters. Exactly so, and without changing what the layer computes: with power-of-two scales the layer's own
    cast of the dequantised weight gives back the same fp8 values (torchao's and NeMo's fp8 all-gather). The
    scales cost one small all-reduce (max) over DP and one over TP per gather. `exact` (inside `gathered()`:
    checkpoints, sampling) gathers the parameters' own values instead."""

    def __init__(self, name: str, params: list[nn.Parameter], dp_group, tp_group, gathered: BytesInUse):
        super().__init__(name, params, dp_group, False, gathered)
        self.tp, self.exact, self.rounded = tp_group, False, False
        lo, hi = self.slice_bounds(dp_group)
        # each weight's piece of this rank's shard: (weight, start, end) in shard coordinates
        self.pieces = [(i, max(off, lo) - lo, min(off + shape.numel(), hi) - lo)
                       for i, (off, shape) in enumerate(zip(self.offsets, self.shapes))
                       if off < hi and off + shape.numel() > lo]
        self._fp8 = self._scales = None

    def start_gather(self) -> None:
        if self.full is not None or self.exact:
            super().start_gather()
            return
        amax = torch.zeros(len(self.params), device=self.shard.device)
        for i, a, b in self.pieces:
            amax[i] = fp8_scaling.amax(self.shard[a:b])
        amax = self.dp.all_reduce(amax, op="max")
        if self.tp is not None and self.tp.size > 1:
            amax = self.tp.all_reduce(amax, op="max")
        self._scales = fp8_scaling.pow2_scale(amax, fp8_scaling.E4M3)
        local = torch.zeros(self.shard.numel(), dtype=fp8_scaling.E4M3, device=self.shard.device)
        for i, a, b in self.pieces:
            local[a:b] = fp8_scaling.quantize(self.shard[a:b], self._scales[i], fp8_scaling.E4M3)
        self.full = torch.empty(self.padded, dtype=self.shard.dtype, device=self.shard.device)
        self._fp8 = torch.empty(self.padded, dtype=torch.uint8, device=self.shard.device)
        self.gathered.add(nbytes(self.full))
        self._gather = self.dp.all_gather_async(self._fp8, local.view(torch.uint8))
        self.rounded = True

    def wait_gather(self) -> None:
        self.start_gather()
        if self._gather is not None and self._fp8 is not None:
            self._gather.wait()
            self._gather = None
            values = self._fp8.view(fp8_scaling.E4M3)
            for i, (off, shape) in enumerate(zip(self.offsets, self.shapes)):
                n = shape.numel()
                self.full[off : off + n] = (values[off : off + n].float() / self._scales[i]).to(self.full.dtype)
            self._fp8 = None
            self.bind(self.full)
        super().wait_gather()

    def free(self) -> None:
        super().free()
        self._fp8, self.rounded = None, False


class FullyShardedOptimizer:
    """AdamW over parameters, gradients and states sharded across the mesh's DP (x CP) group: ZeRO-3.

    The same interface as `BucketedOptimizer` (begin_step, finish_backward, clip_and_step, checkpoints);
    `gathered()` is a context in which every parameter holds its values (saving, sampling, exporting)."""

    zero = 3

    def __init__(self, model: nn.Module, mesh, *, lr: float, weight_decay: float, betas=(0.9, 0.95),
                 eps: float = 1e-8, reshard_after_forward: bool = True, prefetch: bool = True,
                 reduce_dtype: torch.dtype = torch.float32, optimizer: str = "adamw", muon_momentum: float = 0.95,
                 offload: bool = False, state_dtype: torch.dtype = torch.float32):
        self.mesh, self.dp, self.reduce_dtype = mesh, mesh.dp_cp_group, reduce_dtype
        # HSDP: units sharded within a replica, their gradient slices all-reduced across the replicas
        self.shards = getattr(mesh, "dp_shard_group", None) or self.dp
        self.replicas = getattr(mesh, "dp_replicate_group", None)
        self.reshard_after_forward, self.prefetch = reshard_after_forward, prefetch
        expert_dp = getattr(mesh, "expert_dp_group", None)
        if any(shard_spec(p).expert for p in model.parameters()) and expert_dp is None:
            raise TensorparError("the model has routed experts but the mesh no expert groups: "
                                 "build it with init_mesh(..., ep=N)")
        layers = getattr(model, "layers", None)
        if not isinstance(layers, nn.ModuleDict):
            raise TensorparError("ZeRO-3 shards a tensorpar Transformer (its blocks are the units gathered together)")
        in_blocks = {id(p) for p in layers.parameters()}
        self.gathered_bytes, self.grad_bytes = BytesInUse(), BytesInUse()
        # Per block, the units gathered and freed together: its dense parameters (over DP x CP), and its routed
        # experts' (over expert-DP) if it has any.
        self.blocks = self._sharded_blocks(model, expert_dp, trained=True)
        self.units = [u for units in self.blocks for u in units]
        self.root = self._root_unit(model, in_blocks, trained=True)
        # The frozen parameters (LoRA's base), sharded alike: gathered and freed, never reduced nor stepped
        self.frozen_blocks = self._sharded_blocks(model, expert_dp, trained=False)
        self.frozen_root = self._root_unit(model, in_blocks, trained=False)
        self.roots = [u for u in (self.root, self.frozen_root) if u is not None]
        self.frozen = [u for units in self.frozen_blocks for u in units]
        if self.frozen_root is not None:
            self.frozen.append(self.frozen_root)
        self._all = self.units + ([self.root] if self.root else [])
        self._unit_of = {id(p): u for u in self._all for p in u.params}
        self.tied = [(off, shape.numel()) for p, off, shape in zip(self.root.params, self.root.offsets,
                                                                    self.root.shapes)
                     if shard_spec(p).pipeline_tied] if self.root else []
        self._pinned = False
        self.nonfinite: list[nn.Parameter] = []  # after a skipped step: this rank's parameters with NaN/Inf gradients
        self.param_bytes = sum(nbytes(u.shard) for u in self._all)
        self.frozen_bytes = sum(nbytes(u.shard) for u in self.frozen)
        self.weights = HostMasterWeights(weight_decay) if offload else MasterWeights(weight_decay)
        for u in self._all:
            u.slice = self.weights.add(u, u.shard, u.dp, in_place=True)
        self.grad_bytes.add(sum(nbytes(u.slice.grad_shard) for u in self._all))
        self.queue = ReduceScatterQueue(self.shards, self.grad_bytes)
        self._hooks = []
        for i, block in enumerate(layers.values()):
            self._hooks.append(block.register_forward_pre_hook(functools.partial(self._pre_forward, i)))
            self._hooks.append(block.register_forward_hook(functools.partial(self._post_forward, i)))
        for module in (getattr(model, "embed", None), getattr(model, "final_norm", None)):
            if module is not None and self.roots:
                self._hooks.append(module.register_forward_pre_hook(lambda *_: self._gather_roots()))
        for u in self._all:
            for p in u.params:
                self._hooks.append(p.register_post_accumulate_grad_hook(self._grad_ready))

        self.optimizer = step_rule(model, mesh, self.weights, self.weights.slices, optimizer, lr=lr, betas=betas,
                                   eps=eps, momentum=muon_momentum, state_dtype=state_dtype)

    def _sharded_blocks(self, model: nn.Module, expert_dp, trained: bool) -> list[list[_Unit]]:
        """Per block, the units of its trained (or frozen) parameters; the trained ones' linear weights gathered in
        fp8 where the model's GEMMs are tensorwise fp8."""
        return [self._block_units(f"layer {key}" + ("" if trained else " (frozen)"),
                                  [p for p in block.parameters() if p.requires_grad == trained], expert_dp,
                                  _fp8_gathered(model, block) if trained else frozenset())
                for key, block in model.layers.items()]

    def _root_unit(self, model: nn.Module, in_blocks: set[int], trained: bool) -> _Unit | None:
        """The unit of the stage's trained (or frozen) parameters outside its blocks, if it has any."""
        params = [p for p in model.parameters() if p.requires_grad == trained and id(p) not in in_blocks]
        name = "root" if trained else "root (frozen)"
        return _Unit(name, params, self.shards, True, self.gathered_bytes) if params else None

    def _block_units(self, name: str, params: list[nn.Parameter], expert_dp, fp8: set[int] = frozenset()
                     ) -> list[_Unit]:
        """The units of one block's `params`, gathered and freed together: the dense ones (over DP x CP; the weights
        in `fp8` in a unit of their own, gathered in fp8) and the routed experts' (over expert-DP), where it has
        any."""
        dense = [p for p in params if not shard_spec(p).expert and id(p) not in fp8]
        units = [_Unit(name, dense, self.shards, False, self.gathered_bytes)] if dense else []
        in_fp8 = [p for p in params if id(p) in fp8]
        if in_fp8:
            units.append(_Fp8Unit(f"{name} fp8", in_fp8, self.shards, self.mesh.tp_group, self.gathered_bytes))
        experts = [p for p in params if shard_spec(p).expert]
        if experts:
            units.append(_Unit(f"{name} experts", experts, expert_dp, False, self.gathered_bytes))
        return units

    # -- hooks: gather before use, free after, reduce-scatter the gradients ----------------------------------

    def _units_of(self, i: int) -> list[_Unit]:
        """Block i's units: the trained ones first (their flags say whether the block is in its backward)."""
        return self.blocks[i] + self.frozen_blocks[i]

    def _gather_roots(self) -> None:
        for unit in self.roots:
            unit.wait_gather()

    def _release_frozen(self, i: int) -> None:
        """Free block i's frozen units: the backward has left the block."""
        if 0 <= i < len(self.blocks) and not self._pinned:
            for unit in self.frozen_blocks[i]:
                unit.in_backward = False
                unit.free()

    def _pre_forward(self, i: int, module, args) -> None:
        units = self._units_of(i)
        for unit in units:
            unit.wait_gather()
        if self.prefetch and not units[0].in_backward and i + 1 < len(self.blocks):
            for unit in self._units_of(i + 1):
                unit.start_gather()

    def _post_forward(self, i: int, module, args, output) -> None:
        units = self._units_of(i)
        if units[0].in_backward or self._pinned:  # a recomputation inside the backward, or everything pinned
            return
        if torch.is_grad_enabled() and isinstance(output, torch.Tensor) and output.requires_grad:
            output.register_hook(functools.partial(self._pre_backward, i))
            if not self.reshard_after_forward or i == len(self.blocks) - 1:
                return  # the stage's last block is the first the backward needs: kept, not gathered again
        for unit in units:
            unit.free()

    def _pre_backward(self, i: int, grad: torch.Tensor) -> None:
        for unit in self._units_of(i):
            unit.in_backward = True
            unit.wait_gather()
        self._release_frozen(i + 1)  # the gradient has left block i + 1
        if self.prefetch and i > 0:
            for unit in self._units_of(i - 1):
                unit.start_gather()

    def _grad_ready(self, param: torch.Tensor) -> None:
        unit = self._unit_of[id(param)]
        unit.add_grad(unit.gradient_buffer(self.reduce_dtype, self.grad_bytes), param)
        unit.ready += 1
        if unit.ready == len(unit.params) and not unit.root:
            unit.ready, unit.in_backward = 0, False
            self.queue.push(unit.slice, unit.grad_buffer, unit.dp)
            unit.grad_buffer = None
            if not self._pinned:
                unit.free()

    # -- the step ----------------------------------------------------------------------------------------------

    def begin_step(self, num_microbatches: int) -> None:
        self.grad_bytes.reset_peak()
        self.gathered_bytes.reset_peak()
        for u in self._all + self.frozen:
            u.ready, u.in_backward = 0, False
        if self.prefetch:  # what the first forward needs first, gathered side by side
            for u in self.roots + (self._units_of(0) if self.blocks else []):
                u.start_gather()

    def finish_backward(self) -> None:
        """Reduce-scatter the root's gradients (after summing the tied embedding's over the pipeline's ends), wait
        for every reduce-scatter, and average."""
        root = self.root
        if root is not None:
            full_grad = root.gradient_buffer(self.reduce_dtype, self.grad_bytes)
            for off, numel in self.tied:
                self.mesh.embed_group.all_reduce(full_grad[off : off + numel])
            self.queue.push(root.slice, full_grad)
            root.grad_buffer, root.ready = None, 0
        for i in range(len(self.blocks)):
            self._release_frozen(i)
        self.queue.drain()
        for u in self._all:
            if u.dp is self.shards:  # the experts' units are sharded over expert-DP: no replicas
                sum_over_replicas(u.slice.grad_shard, self.replicas)
            u.slice.grad_shard.div_(self.dp.size)

    def clip_and_step(self, max_norm: float, scaler=None) -> torch.Tensor:
        """Clip by the dense model's gradient norm, step this rank's shards, free every gathered parameter (the
        next use gathers the updated ones). With a `DynamicLossScaler` (fp16) the gradients are first divided by
        its scale. A step whose gradient norm is not finite is skipped (without a scaler, `nonfinite` then lists this
        rank's parameters whose gradient is NaN or Inf). Returns the norm before clipping."""
        norm, skip = unscale_and_clip(self.weights.params, max_norm, self.mesh, True, scaler)
        self.nonfinite = self.weights.nonfinite() if skip and scaler is None else []
        if not skip:
            self.optimizer.step()
        for u in self._all:
            if not skip:
                u.slice.write_back()
            u.free()
            u.slice.grad_shard.zero_()
        for u in self.frozen:
            u.free()
        return norm

    # -- whole parameters and checkpoints ----------------------------------------------------------------------

    @contextlib.contextmanager
    def gathered(self):
        """Every parameter holds its values inside (a collective on entry: call on every DP rank)."""
        self._pinned = True
        try:
            for u in self._all + self.frozen:
                if isinstance(u, _Fp8Unit):
                    if u.rounded:
                        u.free()
                    u.exact = True
                u.start_gather()
            for u in self._all + self.frozen:
                u.wait_gather()
            yield
        finally:
            self._pinned = False
            for u in self._all + self.frozen:
                u.free()
                if isinstance(u, _Fp8Unit):
                    u.exact = False

    def reload_parameters(self) -> None:
        """Inside `gathered()`, after the parameters were overwritten (a checkpoint load): take them as the shards."""
        for u in self._all:
            u.shard.copy_(u.full[u.slice.lo : u.slice.hi])
        for u in self.frozen:
            lo, hi = u.slice_bounds(u.dp)
            u.shard.copy_(u.full[lo:hi])
        self.weights.reload()

    def local_state(self, names: dict[int, str]) -> tuple[dict[str, dict[str, torch.Tensor]], int]:
        """AdamW moments in the layout of the local (TP-sharded) parameters, all-gathered over DP x CP (the routed
        experts': over expert-DP) (a collective)."""
        mixed = any(u.slice.separate for u in self._all)
        return self.weights.local_state(self.optimizer, names, with_master=mixed), adamw_step_count(self.optimizer)

    def kinds_of(self, name: str, shape) -> tuple[str, ...]:
        """The optimizer state the parameter `name` keeps (AdamW's moments, or Muon's momentum)."""
        return self.optimizer.kinds_of(name, shape)

    def load_local_state(self, states: dict[str, dict[str, torch.Tensor]], step: int, names: dict[int, str]) -> None:
        self.weights.load_local_state(self.optimizer, states, step, names)

    def memory(self) -> dict[str, int]:
        """This rank's bytes of parameter shards, gradients (the most alive at once since `begin_step`: shards and
        full per-unit gradients in flight), optimizer state (AdamW moments, and fp32 masters of non-fp32
        shards) and gathered parameters (the most alive at once since `begin_step`); with frozen parameters, their
        shards as "frozen"."""
        master = self.weights.master_bytes()
        out = offloaded_memory(self.weights, self.optimizer, {
            "parameters": self.param_bytes, "gradients": self.grad_bytes.peak,
            "optimizer": state_bytes(self.optimizer) + master, "gathered": self.gathered_bytes.peak})
        if self.frozen:
            out["frozen"] = self.frozen_bytes
        return out

    def state_bytes(self) -> int:
        """Bytes of optimizer state (AdamW moments) held by this rank."""
        return state_bytes(self.optimizer)
