"""Pipeline parallelism: run a schedule's actions (pipeline_parallel/schedules.py) with real point-to-point
transfers.

The model's layers lie on the ranks as the layout's `PipelineSplit` says (tensorpar.layout.stages: pp x v virtual
stages, even or of --pipeline-layers' sizes; rank r holds stages r, r + pp, ..., its chunks 0..v-1) in one
`Transformer` whose parameter names keep the global layer indices. Stage 0 also embeds, the last stage also
computes the head and the loss.

A forward action receives the previous stage's activations (unless it is stage 0), runs the
chunk and sends its output on (unless it is the last stage, which keeps the loss). A backward
action receives the gradient of its output (unless it is the last stage, which starts from the
loss), back-propagates and sends the input's gradient to the previous stage. In the zero-bubble
schedules (zb-h1, zbv) that backward computes only input gradients: the model's layers leave their
weight gradients in the runner's `WeightGradQueue`, and the schedule's W action for the same
micro-batch and chunk computes them (pipeline_parallel/weight_grad.py). With packed documents (--document-mask)
every stage is handed its micro-batch's `PackedDocuments` with the hidden states: each rank holds every
micro-batch's tokens, so the document ids and positions never travel between stages. In a V (zbv) rank 0 holds the first and
the last stage, and the two middle stages share the last rank, which hands their tensors over
without a message. Sends are
asynchronous and receives block, so a schedule whose order respects its dependencies cannot
deadlock; messages carry tags naming (micro-batch, stage, direction) — gloo matches on them,
NCCL matches in issue order, which these schedules keep consistent per pair of ranks.
"""

from __future__ import annotations

import contextlib
import time

import torch


from tensorpar.data.batch import as_batch
from tensorpar.distributed.sharding import retag
from tensorpar.errors import TensorparError
from tensorpar.layout import ParallelLayout
from tensorpar.pipeline_parallel.schedules import build_schedule, is_v_shaped
from tensorpar.pipeline_parallel.weight_grad import WeightGradQueue


class PipelineRunner:
    """Executes one optimizer step's micro-batches through the pipeline with a named schedule."""

    def __init__(self, model, mesh, layout: ParallelLayout, num_microbatches: int,
                 activation_shape: tuple[int, ...], autocast=contextlib.nullcontext,
                 activation_dtype: torch.dtype = torch.float32, weight_grads: WeightGradQueue | None = None):
        """`layout`: the run's (its pipeline size is the mesh's; its schedule, chunks and split are run here).
        `weight_grads`: under a schedule that splits the backward (zb-h1, zbv), the `WeightGradQueue` the model was
        built with (its layers leave their weight gradients there until the schedule's W actions)."""
        self.model, self.mesh, self.layout = model, mesh, layout
        self.split = layout.split(model.cfg.num_layers)
        self.pp, self.rank, self.v = mesh.pp_size, mesh.pp_rank, self.split.chunks
        self.stages = self.split.stages
        self.last = self.stages - 1
        plan = build_schedule(layout.schedule, self.pp, num_microbatches, layout.virtual_stages)
        self.v_shape = is_v_shaped(plan)
        self.chunks = self.split.rank_layers(self.rank)
        self.actions = plan[self.rank]
        if layout.splits_backward and weight_grads is None:
            raise TensorparError(f"the {layout.schedule} schedule splits the backward: build the model with a "
                                 f"WeightGradQueue and pass the queue here")
        self.weight_grads = weight_grads if layout.splits_backward else None
        embed = getattr(model, "embed", None)
        tied = embed is not None and getattr(getattr(model, "head", None), "weight", None) is embed.weight
        if self.v_shape and self.v > 1 and (tied or (embed is not None and model.cfg.num_mtp_layers)):
            # An embedding the last stage uses too (tied to the head, or multi-token prediction's), on the rank holding
            # both ends: the first chunk's lookup and the last chunk's are two backward passes per micro-batch (data
            # parallelism counts its gradient's arrivals).
            retag(embed.weight, backward_passes=2)
        self._local: dict[int, torch.Tensor] = {}  # tensors handed between two stages on this rank
        self.num_microbatches = num_microbatches
        self.activation_shape = activation_shape
        self.autocast = autocast
        self.activation_dtype = activation_dtype  # of the hidden states (and their gradients) sent between stages
        self.timeline: list[tuple[str, int, int, float, float]] = []
        self.peak_in_flight = 0

    def _stage(self, chunk: int) -> int:
        return self.split.stage_of(self.rank, chunk)

    def _rank_of(self, stage: int) -> int:
        return self.split.rank_of(stage)[0]

    def _send(self, tensor: torch.Tensor, stage: int, tag: int, sends: list) -> None:
        """Send `tensor` to the rank holding `stage` (or keep it, when that is this rank)."""
        dst = self._rank_of(stage)
        if dst == self.rank:
            self._local[tag] = tensor
        else:
            sends.append((self.mesh.pp_group.isend(tensor, dst, tag=tag), tensor))

    def _tag(self, microbatch: int, stage: int, backward: bool) -> int:
        return 2 * (microbatch * self.stages + stage) + int(backward)

    def _forward_chunk(self, x, chunk, targets, dropout_seed, aux_scale=1.0, documents=None, inputs=None):
        stage = self._stage(chunk)
        extra = {} if documents is None else {"documents": documents}
        if inputs is not None:  # the last stage's multi-token prediction takes the window's token ids
            extra["inputs"] = inputs
        with self.autocast():
            return self.model.forward_layers(x, self.chunks[chunk], targets, dropout_seed, embed=stage == 0,
                                             head=stage == self.stages - 1, aux_scale=aux_scale, **extra)

    def _recv(self, tag: int, stage: int) -> torch.Tensor:
        """What the rank holding `stage` sent with `tag`."""
        src = self._rank_of(stage)
        if src == self.rank:
            return self._local.pop(tag).detach().clone()
        buf = torch.empty(self.activation_shape, device=self.mesh.device, dtype=self.activation_dtype)
        self.mesh.pp_group.irecv(buf, src, tag=tag).wait()
        return buf

    def _forward_action(self, mb: int, chunk: int, batch, dropout_seed, sends: list, aux_scale: float = 1.0,
                        documents=None):
        """Receive the input (unless stage 0), run the chunk, send the output on (unless the last stage).
        Returns (input, output, start of compute); on the last stage the output is the loss. `batch`: token
        windows [mb, L+1] or a `Batch` (inputs and targets); `aux_scale`: what MoE router losses' backward is scaled
        by; `documents`: the micro-batch's packed documents, or None."""
        stage = self._stage(chunk)
        batch = as_batch(batch)
        x = batch.inputs if stage == 0 else self._recv(self._tag(mb, stage, False), stage - 1)
        if stage > 0 and torch.is_grad_enabled():
            x.requires_grad_()
        t0 = time.perf_counter()
        last = stage == self.last
        mtp = last and bool(getattr(self.model, "mtp_keys", None))  # multi-token prediction reads the token ids
        out = self._forward_chunk(x, chunk, batch.targets if last else None, dropout_seed, aux_scale, documents,
                                  batch.inputs if mtp else None)
        if stage != self.last:
            out = out.to(self.activation_dtype)
            self._send(out.detach(), stage + 1, self._tag(mb, stage + 1, False), sends)
        return x, out, t0

    def _finish(self, sends: list, loss_sum: torch.Tensor) -> float:
        """Wait for the sends, share the last stage's weighted loss with the other stages, return it."""
        for work, _ in sends:
            work.wait()
        self.mesh.pp_group.all_reduce(loss_sum)
        return loss_sum.item()

    def train_step(self, microbatches: list, dropout_seed, loss_scale: float = 1.0, documents: list | None = None,
                   weights: list[float] | None = None) -> float:
        """Forward and backward of every micro-batch ([mb, L+1] token windows, or `Batch`es of inputs and targets);
        returns the sum of their losses times `weights` (on every rank; default: 1 / M each, the mean). The backward
        starts from micro-batch i's loss times `loss_scale` x `weights[i]` (training/loss_weights.py: the exact
        token-weighted normalisation; `loss_scale`: fp16's dynamic loss scaling). `dropout_seed(i)` gives
        micro-batch i's seed; `documents[i]`, if given, micro-batch i's packed documents (of its inputs)."""
        weights = weights or [1.0 / self.num_microbatches] * self.num_microbatches
        saved: dict[tuple[int, int], tuple[torch.Tensor | None, torch.Tensor]] = {}
        sends, loss_sum = [], torch.zeros((), device=self.mesh.device)
        self.timeline, self.peak_in_flight = [], 0
        for action in self.actions:
            with self._range(action):
                loss_sum = self._run_action(action, microbatches, dropout_seed, (loss_scale, weights), saved, sends,
                                            loss_sum, documents)
        return self._finish(sends, loss_sum)

    def _range(self, action):
        """A named range for torch.profiler while the run is profiled (--profile-steps)."""
        if not self.mesh.stats.profiling:
            return contextlib.nullcontext()
        return torch.profiler.record_function(f"pipeline {action.kind} mb{action.microbatch} chunk{action.chunk}")

    def _run_action(self, action, microbatches, dropout_seed, scales: tuple[float, list[float]], saved: dict,
                    sends: list, loss_sum: torch.Tensor, documents: list | None = None) -> torch.Tensor:
        """One action of the schedule: a chunk's forward (F), backward (B, or its input-gradient half) or weight
        gradients (W); returns the weighted loss summed so far. `scales`: (the loss scale, the micro-batches'
        weights)."""
        mb, chunk = action.microbatch, action.chunk
        stage = self._stage(chunk)
        loss_scale, weights = scales
        if action.kind == "F":
            x, out, t0 = self._forward_action(mb, chunk, microbatches[mb], dropout_seed(mb), sends,
                                              loss_scale / self.num_microbatches,
                                              None if documents is None else documents[mb])
            if stage == self.last:
                loss_sum += out.detach().float() * weights[mb]
                out = out * (loss_scale * weights[mb])
            saved[(mb, chunk)] = (x if stage > 0 else None, out)
            self.peak_in_flight = max(self.peak_in_flight, len(saved))
        elif action.kind == "B":
            x, out = saved.pop((mb, chunk))
            grad = None if stage == self.last else self._recv(self._tag(mb, stage, True), stage + 1)
            t0 = time.perf_counter()
            torch.autograd.backward(out, grad)
            if self.weight_grads is not None:
                self.weight_grads.close((mb, chunk))
            if stage > 0:
                self._send(x.grad, stage - 1, self._tag(mb, stage - 1, True), sends)
        else:  # "W": the weight gradients that B left in the queue
            t0 = time.perf_counter()
            self.weight_grads.run((mb, chunk))
        self.timeline.append((action.kind, mb, chunk, t0, time.perf_counter()))
        return loss_sum

    @torch.no_grad()
    def forward_only(self, microbatches: list, documents: list | None = None,
                     weights: list[float] | None = None) -> float:
        """The losses of `microbatches` without backward (validation), every micro-batch through every stage,
        summed with `weights` (default: their mean); `documents` as in `train_step`."""
        weights = weights or [1.0 / len(microbatches)] * len(microbatches)
        sends, loss_sum = [], torch.zeros((), device=self.mesh.device)
        for mb, batch in enumerate(microbatches):
            for chunk in range(self.v):
                _, out, _ = self._forward_action(mb, chunk, batch, None, sends, 1.0,
                                                 None if documents is None else documents[mb])
                if self._stage(chunk) == self.last:
                    loss_sum += out.float() * weights[mb]
        return self._finish(sends, loss_sum)
