"""Clusters for the planner: GPUs of one catalog kind in nodes, every figure overridable.

A `Cluster` is ``gpus`` of them in nodes of ``gpus_per_node`` (8 by default) with an intra-node link (NVLink / NVSwitch) and an inter-node
link (InfiniBand, per GPU), the device's compute curve (`tensorpar.planning.devices`: GEMM efficiency by
shape, attention, memory bandwidth) and the efficiency knobs of the step-time model:

- ``mfu_ceiling``: None (the default) times every kernel through the device curve. A number instead
  (``--mfu-ceiling``) restores the old flat model: all FLOPs at that fraction of the peak, whatever
  their shapes.
- ``link_efficiency``: the fraction of the nominal link bandwidths that collectives reach. Default 0.8
  (NCCL-tests bus bandwidths on DGX/HGX systems are 70-90% of the nominal NVLink / InfiniBand figures);
  a calibrated profile's links are measured, so `plan --hardware` uses 1.
- ``tp_overlap``: the fraction of TP/SP collectives hidden behind the GEMMs they feed (Megatron-LM's
  ``--tp-comm-overlap``, userbuffers); default 0 (tensorpar, and Megatron-LM before 2023, overlap none).
- ``pp_overlap``: the fraction of the interleaved pipeline's point-to-point sends hidden behind the next
  chunk's compute (Megatron-Core's ``--overlap-p2p-communication``, which NeMo sets whenever the virtual
  pipeline size is above 1); default 0 (tensorpar's sends and receives are waited for where they are issued).
- ``overlap``: the fraction of the data-parallel (and ZeRO) communication that can hide behind
  the backward computation it overlaps with (see `step_time`). Default 0.5: bucketed overlap as in
  PyTorch DDP / tensorpar's `BucketedOptimizer` starts a bucket's collective as soon as the
  last micro-batch's backward has produced it, so roughly the last bucket is always exposed and
  the others compete with compute for memory bandwidth and SMs. 0 means no overlap at all. `make_cluster`
  defaults it to 0 for a device whose collectives run on gloo (``GPUSpec.collectives``, a calibrated CPU):
  gloo's transfers and reductions run on the CPU cores, which tensorpar's processes already keep busy
  (``cores / processes`` threads each), so the communication adds to the compute instead of hiding behind it.

- ``host_link`` / ``host_optimizer_bandwidth``: what the offloading levers cost (`tensorpar.planning.offload_time`):
  the GPU's link to host memory (``host_link`` to it, ``host_link_back`` from it; transfers reach
  ``link_efficiency`` of them, as collectives do) and the host-memory traffic an offloaded AdamW step reaches per
  GPU. Default: the GPU's (a calibrated profile's measured each way).

The GPU catalog itself (datasheet peaks, memory, links) is `tensorpar.config.hardware`;
``--intra-bandwidth`` / ``--inter-bandwidth`` and the other overrides replace any of its figures.
"""

from __future__ import annotations

import dataclasses

from tensorpar.config.hardware import DEFAULT_LINK_EFFICIENCY, GiB, GPUSpec, Link, get_gpu
from tensorpar.errors import TensorparError
from tensorpar.planning.devices import DeviceCurve, curve_for

DEFAULT_MFU_CEILING = None
DEFAULT_OVERLAP = 0.5
DEFAULT_HOST_MEMORY_GIB = 256  # host memory per GPU that offloading may fill: a DGX H100's 2 TiB over its 8 GPUs


@dataclasses.dataclass(frozen=True)
class Cluster:
    """``gpus`` GPUs of one kind in nodes of ``gpus_per_node``; links default to the GPU's catalog figures."""

    gpu: GPUSpec
    gpus: int
    gpus_per_node: int = 8
    intra: Link | None = None
    inter: Link | None = None
    mfu_ceiling: float | None = DEFAULT_MFU_CEILING
    overlap: float = DEFAULT_OVERLAP
    curve: DeviceCurve | None = None
    link_efficiency: float = DEFAULT_LINK_EFFICIENCY
    tp_overlap: float = 0.0
    pp_overlap: float = 0.0
    host_memory_bytes: int = DEFAULT_HOST_MEMORY_GIB * GiB  # per GPU: what the memory levers' offloading may use
    host_link: Link | None = None  # to host memory, per GPU (default: the GPU's)
    host_link_back: Link | None = None  # from host memory, per GPU (default: the GPU's)
    host_optimizer_bandwidth: float | None = None  # bytes/s per GPU of an offloaded AdamW step (default: the GPU's)

    def __post_init__(self):
        problems = []
        if self.gpus < 1:
            problems.append(f"the number of GPUs must be positive, got {self.gpus}")
        if self.gpus_per_node < 1:
            problems.append(f"GPUs per node must be positive, got {self.gpus_per_node}")
        elif self.gpus > self.gpus_per_node and self.gpus % self.gpus_per_node:
            problems.append(f"{self.gpus} GPUs do not fill whole nodes of {self.gpus_per_node} (plan --gpus-per-node "
                            f"says how many a node has)")
        if self.mfu_ceiling is not None and not 0 < self.mfu_ceiling <= 1:
            problems.append(f"the MFU ceiling must be in (0, 1], got {self.mfu_ceiling}")
        if not 0 <= self.overlap <= 1:
            problems.append(f"the overlap efficiency must be in [0, 1], got {self.overlap}")
        if not 0 < self.link_efficiency <= 1:
            problems.append(f"the link efficiency must be in (0, 1], got {self.link_efficiency}")
        if not 0 <= self.tp_overlap <= 1:
            problems.append(f"the TP overlap must be in [0, 1], got {self.tp_overlap}")
        if not 0 <= self.pp_overlap <= 1:
            problems.append(f"the pipeline p2p overlap must be in [0, 1], got {self.pp_overlap}")
        if self.host_optimizer_bandwidth is not None and not self.host_optimizer_bandwidth > 0:
            problems.append(f"the host optimizer bandwidth must be positive, got {self.host_optimizer_bandwidth}")
        if problems:
            raise TensorparError("invalid cluster: " + "; ".join(problems))
        if self.intra is None:
            object.__setattr__(self, "intra", self.gpu.intra_node)
        if self.inter is None:
            object.__setattr__(self, "inter", self.gpu.inter_node)
        if self.host_link is None:
            object.__setattr__(self, "host_link", self.gpu.host_link)
        if self.host_link_back is None:
            object.__setattr__(self, "host_link_back", self.gpu.host_link_back or self.gpu.host_link)
        if self.host_optimizer_bandwidth is None:
            object.__setattr__(self, "host_optimizer_bandwidth", self.gpu.host_optimizer_bandwidth)
        if self.curve is None:
            object.__setattr__(self, "curve", curve_for(self.gpu.name))
        eff = self.link_efficiency
        object.__setattr__(self, "_links", (Link(self.intra.bandwidth * eff, self.intra.latency),
                                            Link(self.inter.bandwidth * eff, self.inter.latency),
                                            Link(self.host_link.bandwidth * eff, self.host_link.latency),
                                            Link(self.host_link_back.bandwidth * eff, self.host_link_back.latency)))

    @property
    def nodes(self) -> int:
        return max(1, -(-self.gpus // self.gpus_per_node))

    @property
    def memory_bytes(self) -> int:
        return self.gpu.memory_bytes

    def peak(self, dtype: str) -> float:
        return self.gpu.peak(dtype)

    def link_for_span(self, span: int) -> Link:
        """The link of a group whose members lie within `span` consecutive ranks: NVLink if they fit in a node
        (bandwidths as collectives reach them: the nominal figure x ``link_efficiency``)."""
        return self._links[0] if span <= self.gpus_per_node else self._links[1]

    @property
    def copies_beside_compute(self) -> bool:
        """Whether copies to and from host memory run beside the compute (a GPU's copy engines, on side streams),
        or, on a CPU (a calibrated CPU profile, whose collectives are gloo's), in the thread that computes."""
        return self.gpu.collectives != "gloo"

    @property
    def to_host_link(self) -> Link:
        """The link to host memory as copies reach it (the nominal figure x ``link_efficiency``)."""
        return self._links[2]

    @property
    def from_host_link(self) -> Link:
        """The link back from host memory as copies reach it (the nominal figure x ``link_efficiency``)."""
        return self._links[3]

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
    curve: DeviceCurve | None = None,
    link_efficiency: float | None = None,
    tp_overlap: float | None = None,
    pp_overlap: float | None = None,
    host_memory_gib: float | None = None,
    host_link_bandwidth: float | None = None,
    host_optimizer_bandwidth: float | None = None,
    host_link_back_bandwidth: float | None = None,
) -> Cluster:
    """A Cluster from a catalog name (or a `GPUSpec`, e.g. a calibrated profile's, with its `curve`) with any
    figure overridden (bandwidths in bytes/s, latencies in s)."""
    spec = get_gpu(gpu) if isinstance(gpu, str) else gpu
    host_link = None if host_link_bandwidth is None else Link(host_link_bandwidth, spec.host_link.latency)
    host_link_back = (host_link if host_link_back_bandwidth is None  # --host-link-bandwidth alone: both ways
                      else Link(host_link_back_bandwidth, spec.host_link.latency))
    if memory_gib is not None:
        spec = dataclasses.replace(spec, memory_bytes=int(memory_gib * GiB))
    if peak_bf16 is not None:
        spec = dataclasses.replace(spec, peak_flops={**spec.peak_flops, "bf16": float(peak_bf16)})
    intra = Link(intra_bandwidth if intra_bandwidth is not None else spec.intra_node.bandwidth,
                 intra_latency if intra_latency is not None else spec.intra_node.latency)
    inter = Link(inter_bandwidth if inter_bandwidth is not None else spec.inter_node.bandwidth,
                 inter_latency if inter_latency is not None else spec.inter_node.latency)
    return Cluster(
        spec, gpus, gpus_per_node, intra, inter, mfu_ceiling,
        (0.0 if spec.collectives == "gloo" else DEFAULT_OVERLAP) if overlap is None else overlap, curve,
        DEFAULT_LINK_EFFICIENCY if link_efficiency is None else link_efficiency,
        0.0 if tp_overlap is None else tp_overlap,
        0.0 if pp_overlap is None else pp_overlap,
        int((DEFAULT_HOST_MEMORY_GIB if host_memory_gib is None else host_memory_gib) * GiB),
        host_link, host_link_back, host_optimizer_bandwidth,
    )
