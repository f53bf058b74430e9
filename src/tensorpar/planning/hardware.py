"""What the planner knows about GPUs and clusters: a small catalog, every figure overridable.

A `GPUSpec` holds one accelerator's datasheet figures; a `Cluster` is ``gpus`` of them in nodes
of ``gpus_per_node`` (8 by default) with an intra-node link (NVLink / NVSwitch) and an inter-node
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

Link bandwidths are per GPU and per direction (the beta of the alpha-beta model in `cost`):
NVLink 4 (H100/H200) is 18 links x 25 GB/s = 450 GB/s per direction; NVLink 3 (A100) 12 x 25 =
300 GB/s; NVLink 5 (B200) 900 GB/s. The inter-node figures assume one NIC per GPU (DGX / HGX
rail-optimised): 8 x 400 Gb/s NDR = 50 GB/s per GPU for H100/H200/B200 systems, 8 x 200 Gb/s
HDR = 25 GB/s for A100 systems. Latencies are typical NCCL per-step latencies (a few
microseconds). These are nominal figures; measured NCCL bus bandwidths are 70-90% of them,
which ``--intra-bandwidth`` / ``--inter-bandwidth`` let you plug in.
"""

from __future__ import annotations

import dataclasses

from tensorpar.errors import TensorparError

GiB = 2**30
MiB = 2**20


@dataclasses.dataclass(frozen=True)
class Link:
    """One link class of the alpha-beta model: ``bandwidth`` in bytes/s (beta), ``latency`` in seconds (alpha)."""

    bandwidth: float
    latency: float

    def __post_init__(self):
        if not self.bandwidth > 0:
            raise TensorparError(f"link bandwidth must be positive, got {self.bandwidth}")
        if self.latency < 0:
            raise TensorparError(f"link latency must be non-negative, got {self.latency}")


@dataclasses.dataclass(frozen=True)
class GPUSpec:
    """Datasheet figures of one accelerator (dense, no sparsity)."""

    name: str
    memory_bytes: int
    peak_flops: dict  # {"bf16": ..., "tf32": ..., "fp32": ...} FLOP/s
    hbm_bandwidth: float  # bytes/s
    intra_node: Link  # NVLink / NVSwitch, per GPU per direction
    inter_node: Link  # InfiniBand / RoCE, per GPU per direction
    source: str = ""

    def peak(self, dtype: str) -> float:
        if dtype not in self.peak_flops:
            raise TensorparError(f"{self.name}: no peak figure for dtype {dtype!r}; known: {sorted(self.peak_flops)}")
        return self.peak_flops[dtype]


_NVLINK4 = Link(450e9, 3e-6)
_NVLINK3 = Link(300e9, 3e-6)
_NVLINK5 = Link(900e9, 3e-6)
_NDR = Link(50e9, 6e-6)  # 400 Gb/s per GPU
_HDR = Link(25e9, 6e-6)  # 200 Gb/s per GPU

GPUS: dict[str, GPUSpec] = {
    "h100-80gb": GPUSpec(
        "h100-80gb", 80 * GiB, {"bf16": 989.4e12, "tf32": 494.7e12, "fp32": 66.9e12}, 3.35e12, _NVLINK4, _NDR,
        "NVIDIA H100 SXM5 80GB datasheet; DGX H100 (8 x ConnectX-7 400 Gb/s)",
    ),
    "h200": GPUSpec(
        "h200", 141 * GiB, {"bf16": 989.4e12, "tf32": 494.7e12, "fp32": 66.9e12}, 4.8e12, _NVLINK4, _NDR,
        "NVIDIA H200 SXM 141GB datasheet; HGX H200 (8 x 400 Gb/s)",
    ),
    "a100-80gb": GPUSpec(
        "a100-80gb", 80 * GiB, {"bf16": 312e12, "tf32": 156e12, "fp32": 19.5e12}, 2.039e12, _NVLINK3, _HDR,
        "NVIDIA A100 SXM4 80GB datasheet; DGX A100 (8 x HDR 200 Gb/s)",
    ),
    "a100-40gb": GPUSpec(
        "a100-40gb", 40 * GiB, {"bf16": 312e12, "tf32": 156e12, "fp32": 19.5e12}, 1.555e12, _NVLINK3, _HDR,
        "NVIDIA A100 SXM4 40GB datasheet; DGX A100 (8 x HDR 200 Gb/s)",
    ),
    "b200": GPUSpec(
        "b200", 180 * GiB, {"bf16": 2250e12, "tf32": 1100e12, "fp32": 75e12}, 8.0e12, _NVLINK5, _NDR,
        "NVIDIA DGX B200 (approximate: 180 GB usable HBM3e, 2.25 PFLOP/s dense bf16)",
    ),
}

ALIASES = {
    "h100": "h100-80gb",
    "h100-sxm": "h100-80gb",
    "h100-sxm-80gb": "h100-80gb",
    "h200-sxm": "h200",
    "h200-141gb": "h200",
    "a100": "a100-80gb",
    "a100-sxm": "a100-80gb",
    "a100-sxm-80gb": "a100-80gb",
    "a100-sxm-40gb": "a100-40gb",
}


def get_gpu(name: str) -> GPUSpec:
    """A catalog entry by name or alias (case-insensitive)."""
    key = name.strip().lower()
    key = ALIASES.get(key, key)
    if key not in GPUS:
        names = sorted(GPUS) + sorted(f"{a} (= {t})" for a, t in ALIASES.items())
        raise TensorparError(f"unknown GPU '{name}'; known GPUs: {', '.join(names)}")
    return GPUS[key]


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
