"""Clusters for the planner: GPUs of one catalog kind in nodes, every figure overridable.

A `Cluster` is ``gpus`` of them in nodes of ``gpus_per_node`` (8 by default) with an intra-node link (NVLink / NVSwitch) and an inter-node
link (InfiniBand, per GPU), plus the two efficiency knobs of the step-time model:

- ``mfu_ceiling``: the fraction of the dense peak that the model's own arithmetic reaches when
  nothing else gets in the way (no communication, no pipeline bubble). Default 0.55 for every
  dtype. Source: Narayanan et al. 2021 (SC21, "Efficient Large-Scale Language Model Training on
  GPU Clusters Using Megatron-LM") reach 52% of the A100's bf16/fp16 peak end to end for their
  1T-parameter model *including* communication and an ~6-11% pipeline bubble, i.e. about 55-58%
  for the arithmetic alone; the Llama 3 report (2024) gives 38-43% MFU at 8-16k H100s with far
  more communication. 0.55 is the round figure between these; change it with ``--mfu-ceiling``.
- ``overlap``: the fraction of the data-parallel (and ZeRO) communication that can hide behind
  the backward computation it overlaps with (see `step_time`). Default 0.5: bucketed overlap as in
  PyTorch DDP / tensorpar's `DistributedOptimizer` starts a bucket's collective as soon as the
  last micro-batch's backward has produced it, so roughly the last bucket is always exposed and
  the others compete with compute for memory bandwidth and SMs. 0 means no overlap at all.

The GPU catalog itself (datasheet peaks, memory, links) is `tensorpar.config.hardware`;
``--intra-bandwidth`` / ``--inter-bandwidth`` and the other overrides replace any of its figures.
"""

from __future__ import annotations

import dataclasses

from tensorpar.config.hardware import GiB, GPUSpec, Link, get_gpu
from tensorpar.errors import TensorparError

DEFAULT_MFU_CEILING = 0.55
DEFAULT_OVERLAP = 0.5


@dataclasses.dataclass(frozen=True)
class Cluster:
    """``gpus`` GPUs of one kind in nodes of ``gpus_per_node``; links default to the GPU's catalog figures."""

    gpu: GPUSpec
    gpus: int
    gpus_per_node: int = 8
    intra: Link | None = None
    inter: Link | None = None
    mfu_ceiling: float = DEFAULT_MFU_CEILING
    overlap: float = DEFAULT_OVERLAP

    def __post_init__(self):
        problems = []
        if self.gpus < 1:
            problems.append(f"the number of GPUs must be positive, got {self.gpus}")
        if self.gpus_per_node < 1:
            problems.append(f"GPUs per node must be positive, got {self.gpus_per_node}")
        elif self.gpus > self.gpus_per_node and self.gpus % self.gpus_per_node:
            problems.append(f"{self.gpus} GPUs do not fill whole nodes of {self.gpus_per_node}")
        if not 0 < self.mfu_ceiling <= 1:
            problems.append(f"the MFU ceiling must be in (0, 1], got {self.mfu_ceiling}")
        if not 0 <= self.overlap <= 1:
            problems.append(f"the overlap efficiency must be in [0, 1], got {self.overlap}")
        if problems:
            raise TensorparError("invalid cluster: " + "; ".join(problems))
        if self.intra is None:
            object.__setattr__(self, "intra", self.gpu.intra_node)
        if self.inter is None:
            object.__setattr__(self, "inter", self.gpu.inter_node)

    @property
    def nodes(self) -> int:
        return max(1, -(-self.gpus // self.gpus_per_node))

    @property
    def memory_bytes(self) -> int:
        return self.gpu.memory_bytes

    def peak(self, dtype: str) -> float:
        return self.gpu.peak(dtype)

    def link_for_span(self, span: int) -> Link:
        """The link of a group whose members lie within `span` consecutive ranks: NVLink if they fit in a node."""
        return self.intra if span <= self.gpus_per_node else self.inter

    def describe(self) -> str:
        return (f"{self.gpus} x {self.gpu.name} ({self.nodes} node{'s' if self.nodes > 1 else ''} of "
                f"{min(self.gpus, self.gpus_per_node)}; NVLink {self.intra.bandwidth / 1e9:.0f} GB/s, "
                f"inter-node {self.inter.bandwidth / 1e9:.0f} GB/s per GPU)")


def make_cluster(
    gpu: str | GPUSpec,
    gpus: int,
    *,
    gpus_per_node: int = 8,
    memory_gib: float | None = None,
    intra_bandwidth: float | None = None,
    intra_latency: float | None = None,
    inter_bandwidth: float | None = None,
    inter_latency: float | None = None,
    peak_bf16: float | None = None,
    mfu_ceiling: float | None = None,
    overlap: float | None = None,
) -> Cluster:
    """A Cluster from a catalog name with any figure overridden (bandwidths in bytes/s, latencies in s)."""
    spec = get_gpu(gpu) if isinstance(gpu, str) else gpu
    if memory_gib is not None:
        spec = dataclasses.replace(spec, memory_bytes=int(memory_gib * GiB))
    if peak_bf16 is not None:
        spec = dataclasses.replace(spec, peak_flops={**spec.peak_flops, "bf16": float(peak_bf16)})
    intra = Link(intra_bandwidth if intra_bandwidth is not None else spec.intra_node.bandwidth,
                 intra_latency if intra_latency is not None else spec.intra_node.latency)
    inter = Link(inter_bandwidth if inter_bandwidth is not None else spec.inter_node.bandwidth,
                 inter_latency if inter_latency is not None else spec.inter_node.latency)
    return Cluster(
        spec, gpus, gpus_per_node, intra, inter,
        DEFAULT_MFU_CEILING if mfu_ceiling is None else mfu_ceiling,
        DEFAULT_OVERLAP if overlap is None else overlap,
    )
