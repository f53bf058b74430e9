"""Datasheet figures of accelerators: the one catalog that the MFU meter (training) and the planner read.

A `GPUSpec` holds one accelerator's dense peak FLOP/s per dtype, memory, HBM bandwidth and its
links; `get_gpu` finds one by name or alias. Link bandwidths are per GPU and per direction (the
beta of the planner's alpha-beta model): NVLink 4 (H100/H200) is 18 links x 25 GB/s = 450 GB/s
per direction; NVLink 3 (A100) 12 x 25 = 300 GB/s; NVLink 5 (B200) 900 GB/s. The inter-node
figures assume one NIC per GPU (DGX / HGX rail-optimised): 8 x 400 Gb/s NDR = 50 GB/s per GPU for
H100/H200/B200 systems, 8 x 200 Gb/s HDR = 25 GB/s for A100 systems. Latencies are typical NCCL
per-step latencies (a few microseconds). These are nominal figures; measured NCCL bus bandwidths
are 70-90% of them.

The host side, for the planner's offloading levers: ``host_link`` is the GPU's link to host memory, per direction
(PCIe 5.0 x16, 64 GB/s, for H100/H200/B200/MI300X; PCIe 4.0 x16, 32 GB/s, for A100; symmetric on paper, so
``host_link_back`` is set only by a calibrated profile whose copies back measured otherwise), and
``host_optimizer_bandwidth`` the host-memory traffic per GPU that an offloaded AdamW step reaches (28 bytes an
element: `tensorpar.planning.offload_time`). Its default, 32.5 GB/s, is derived from the one run there is: torch's
fused CPU AdamW over llama-1b's 1.24B fp32 masters, on 8 host threads of the H200 machine lent on 2026-11-28, made
the step 1.20 s longer (docs/benchmarks.md, "Fourth run"); less the model's copies (0.14 s) that is 1.06 s for
28 x 1.24B bytes. It is one rank's figure: eight ranks of a node share its cores and memory bus. `tensorpar
calibrate` measures both on the machine at hand.
"""

from __future__ import annotations

import dataclasses

from tensorpar.errors import TensorparError

GiB = 2**30
MiB = 2**20
DEFAULT_LINK_EFFICIENCY = 0.8  # the share of a nominal link bandwidth that transfers reach (NCCL-tests: 70-90%)


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
    # the library that runs its collectives: "nccl" (GPUs) or "gloo" (CPU processes, a calibrated CPU profile),
    # whose transfers run on the cores the ranks compute on (see `tensorpar.planning.cluster.make_cluster`)
    collectives: str = "nccl"
    host_link: Link = Link(64e9, 10e-6)  # to host memory, per direction: PCIe 5.0 x16
    host_link_back: Link | None = None  # from host memory, where it differs from host_link (a calibrated profile's)
    host_optimizer_bandwidth: float = 32.5e9  # bytes/s per GPU an offloaded AdamW step streams on the host
    # a calibrated profile's unmeasured dtypes -> the measured dtype whose peak they take
    peak_stand_ins: dict = dataclasses.field(default_factory=dict)

    def peak(self, dtype: str) -> float:
        if dtype not in self.peak_flops:
            raise TensorparError(f"{self.name}: no peak figure for dtype {dtype!r}; known: {sorted(self.peak_flops)}")
        return self.peak_flops[dtype]


_NVLINK4 = Link(450e9, 3e-6)
_NVLINK3 = Link(300e9, 3e-6)
_NVLINK5 = Link(900e9, 3e-6)
_NDR = Link(50e9, 6e-6)  # 400 Gb/s per GPU
_HDR = Link(25e9, 6e-6)  # 200 Gb/s per GPU
_PCIE4 = Link(32e9, 10e-6)  # PCIe 4.0 x16, per direction

GPUS: dict[str, GPUSpec] = {
    "h100-80gb": GPUSpec(
        "h100-80gb", 80 * GiB, {"bf16": 989.4e12, "fp8": 1978.9e12, "tf32": 494.7e12, "fp32": 66.9e12}, 3.35e12, _NVLINK4, _NDR,
        "NVIDIA H100 SXM5 80GB datasheet; DGX H100 (8 x ConnectX-7 400 Gb/s)",
    ),
    "h200": GPUSpec(
        "h200", 141 * GiB, {"bf16": 989.4e12, "fp8": 1978.9e12, "tf32": 494.7e12, "fp32": 66.9e12}, 4.8e12, _NVLINK4, _NDR,
        "NVIDIA H200 SXM 141GB datasheet; HGX H200 (8 x 400 Gb/s)",
    ),
    "a100-80gb": GPUSpec(
        "a100-80gb", 80 * GiB, {"bf16": 312e12, "tf32": 156e12, "fp32": 19.5e12}, 2.039e12, _NVLINK3, _HDR,
        "NVIDIA A100 SXM4 80GB datasheet; DGX A100 (8 x HDR 200 Gb/s)", host_link=_PCIE4,
    ),
    "a100-40gb": GPUSpec(
        "a100-40gb", 40 * GiB, {"bf16": 312e12, "tf32": 156e12, "fp32": 19.5e12}, 1.555e12, _NVLINK3, _HDR,
        "NVIDIA A100 SXM4 40GB datasheet; DGX A100 (8 x HDR 200 Gb/s)", host_link=_PCIE4,
    ),
    "b200": GPUSpec(
        "b200", 180 * GiB, {"bf16": 2250e12, "fp8": 4500e12, "tf32": 1100e12, "fp32": 75e12}, 8.0e12, _NVLINK5, _NDR,
        "NVIDIA DGX B200 (approximate: 180 GB usable HBM3e, 2.25 PFLOP/s dense bf16)",
    ),
    "mi300x": GPUSpec(
        "mi300x", 192 * GiB, {"bf16": 1307.4e12, "fp8": 2614.9e12, "tf32": 653.7e12, "fp32": 163.4e12}, 5.3e12,
        Link(448e9, 3e-6), _NDR,
        "AMD Instinct MI300X datasheet (dense); 7 Infinity Fabric links x 64 GB/s per direction; 400 Gb/s NIC per GPU",
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
