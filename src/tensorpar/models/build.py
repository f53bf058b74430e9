"""The model, built in one place: what train, eval, generate, serve, the dry run and the benchmarks all call.

`build_transformer` makes this rank's part of a `Transformer` for a layout on a mesh: its pipeline stage (the layers its
chunks hold, the embedding and head where it holds the ends), its tensor-parallel shards, the queue a split-backward
schedule leaves weight gradients in, parameters in the precision's dtype (the optimizer keeps fp32 masters), seeded
or loaded weights, and its blocks compiled when asked. `Execution` holds how the rank runs what it holds.
"""

from __future__ import annotations

import dataclasses

import torch

from tensorpar.config.precision import Precision
from tensorpar.layout import ParallelLayout
from tensorpar.layout.rules import require_model_config
from tensorpar.models.compile import compile_blocks
from tensorpar.models.init import initial_adapters
from tensorpar.models.placement import PipelineStage, Placement
from tensorpar.models.state import load_full_state_dict, model_state
from tensorpar.models.transformer import Transformer
from tensorpar.pipeline_parallel.weight_grad import WeightGradQueue
from tensorpar.tensor_parallel.fp8_scaling import Fp8Recipe
from tensorpar.tensor_parallel.lora import LoraSpec


@dataclasses.dataclass(frozen=True)
class Execution:
    """How a rank runs its part of the model: activation recomputation, TP collectives overlapped with the GEMMs,
    context-parallel attention and its split, the fused head and loss, torch.compile of each block, the kernels of
    attention within packed documents and of the routed experts."""

    recompute: str = "none"
    tp_overlap: bool = True
    cp_impl: str = "ring"
    cp_split: str = "zigzag"
    loss_chunk_tokens: int | None = None
    compile: bool = False
    document_attention: str = "auto"
    expert_gemm: str = "grouped"

    @classmethod
    def of(cls, options) -> "Execution":
        """What a command's options ask for (the fields a command does not have take their defaults)."""
        get = lambda name: getattr(options, name, getattr(cls, name))  # noqa: E731
        return cls(get("recompute"), get("tp_overlap"), get("cp_impl"), get("cp_split"),
                   get("loss_chunk_tokens") or None, get("compile"), get("document_attention"), get("expert_gemm"))


def build_transformer(cfg, mesh, layout: ParallelLayout | None = None, precision: Precision = Precision(),
                execution: Execution = Execution(), *, seed: int = 0, weights: dict | None = None,
                source: str = "state dict", meta: bool = False, lora: LoraSpec | None = None) -> Transformer:
    """This rank's part of `cfg` under `layout` on `mesh` (None: the mesh's own), initialised from `seed`, or with
    `weights` (a dense state dict, from `source`; a pipeline stage takes the tensors it holds). `meta`: on the meta
    device, no values (the dry run). Training (`precision.training`) casts the parameters to bf16/fp16. `lora`: LoRA
    adapters on the linears it targets, the rest frozen; adapters `weights` lacks start from `seed`. A `layout`
    of other sizes than the mesh's is refused (a LayoutError): the model would hold a part the mesh cannot run."""
    require_model_config(cfg)
    if layout is not None and hasattr(mesh, "check_run"):
        mesh.check_run(layout, cfg.is_moe)
    layout = layout if layout is not None else getattr(mesh, "layout", None)
    pipelined = layout is not None and layout.pp > 1
    placement = Placement.on(
        mesh, sequence_parallel=layout is not None and layout.sequence_parallel, tp_overlap=execution.tp_overlap,
        weight_grads=WeightGradQueue(mesh.device) if pipelined and layout.splits_backward else None,
        fp8=Fp8Recipe.of(precision), cp_impl=execution.cp_impl, cp_split=execution.cp_split,
        stage=PipelineStage.of(layout, cfg.num_layers, mesh.pp_rank) if pipelined else PipelineStage(),
        recompute=execution.recompute, loss_chunk_tokens=execution.loss_chunk_tokens,
        device="meta" if meta else None, document_attention=execution.document_attention,
        expert_gemm=execution.expert_gemm, lora=lora)
    device = getattr(mesh, "device", None)
    # this rank's GPU only: forking every visible device's state would open a context on each
    with torch.random.fork_rng(devices=[device] if getattr(device, "type", None) == "cuda" else []):
        torch.manual_seed(seed)  # what module constructors draw; the caller's random state is left as it was
        model = Transformer(cfg, placement, seed=seed, init=weights is None and not meta)
    if weights is not None and not meta:
        names = model_state(model)
        if lora is not None:
            weights = {**initial_adapters(model, seed), **weights}
        load_full_state_dict(model, {k: v for k, v in weights.items() if k in names} if pipelined else weights,
                             source=source)
    if precision.param_dtype != torch.float32:  # buffers stay fp32
        for p in model.parameters():
            p.data = p.data.to(precision.param_dtype)
    if execution.compile and not meta:
        compile_blocks(model)
    return model
