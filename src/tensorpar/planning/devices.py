"""How fast one device runs the kernels of a transformer layer: GEMMs by shape, attention, memory-bound kernels.

A GEMM C[m, n] = A[m, k] B[k, n] is timed by a roofline with the tiling a GEMM library uses
(`gemm_time`)::

    tiles  = ceil(m / tile_m) ceil(n / tile_n)          output tiles, each computed by one SM / CU
    waves  = tiles / units, the last partial wave counted ``wave_quantization`` of the way to a full one
    t_math = waves x 2 tile_m tile_n (k + k_overhead) / (peak x gemm_efficiency / units)
    t_mem  = (m k + k n + m n) x bytes / (hbm_bandwidth x hbm_efficiency)
    t      = max(t_math, t_mem) + launch_s

so a large, aligned GEMM runs at ``gemm_efficiency`` of the datasheet peak, and a small or thin one far below
it: few tiles leave SMs idle (the wave term), a short k pays the prologue / epilogue of every tile
(``k_overhead``, the k at which it halves efficiency), a skinny one is memory-bound, a tiny one is launch-bound.

Attention (flash-style, causal): ``2 b s^2 h_q`` FLOPs forward (half the square: the causal mask) at
``attention_efficiency[0]`` of peak and 2.5 x that backward (FlashAttention-2's dQ/dK/dV) at
``attention_efficiency[1]``. Without flash attention the two batched GEMMs go through `gemm_time` and the
softmax / mask / dropout through memory. Element-wise and norm kernels move bytes at
``hbm_bandwidth x hbm_efficiency`` (`memory_time`).

Where the curves come from (`CURVES`):

- ``gemm_efficiency`` is the *Maximum Achievable Matmul FLOPS* measured with bf16 inputs over a sweep of large
  shapes, divided by the datasheet peak: stas00/ml-engineering, compute/accelerator/README.md, "Maximum
  Achievable Matmul FLOPS comparison table" (A100 SXM 267.9 of 312 = 85.9%, H100 SXM 794.5 of 989 = 80.3%,
  "H100/H200 SXM" one row, B200 SXM 1745 of 2250 = 77.6%, MI300X 781.9 of 1300 = 60.1%; fp8
  (``float8_e4m3fn`` through ``torch._scaled_mm``): H100 SXM 1402.6 of 1979 = 70.9% (torch 2.7.0+cu126, best
  shape 1024x9216x14336; the table's version at commit b9e29720), H200 1453.4 of 1979 = 73.4%, B200 3432.5 of
  4500 = 76.3%). These are the best of a sweep on a GPU measured for seconds; a training run holds the GPU at
  its power limit for hours, which these figures do not capture.
- the *shape* of the curve (units = SM / CU count from the datasheets, a 128 x 256 output tile, k_overhead,
  wave_quantization, launch) is the roofline-and-tiling model above, not a fit to each device: the tile is
  CUTLASS / cuBLAS's usual Hopper and Ampere bf16 tile, k_overhead = 128 (one k-block of prologue and one of
  epilogue per tile), wave_quantization = 0.5 (cuBLAS's heuristics and stream-K recover about half of a
  partial wave), launch 4 us. ``tensorpar calibrate`` measures a device's own curve and
  `plan --hardware PROFILE` uses it instead.
- ``hbm_efficiency`` 0.85 of the datasheet bandwidth (STREAM-like copy kernels reach 80-90% on A100/H100);
  ``attention_efficiency`` (0.55, 0.45) on Hopper and Blackwell (FlashAttention-3 / cuDNN reach 60-75% of peak
  forward, FlashAttention-2 about 35%), (0.6, 0.5) on A100 (FlashAttention-2 reports 50-73% forward).
  These are round, documented global figures, the same for every model and layout.
- ``cpu``: a placeholder shape for a small x86 machine (2 cores, 64 x 64 blocks, 20 us per operator); its
  figures are rough, not measured - a CPU is planned with `tensorpar calibrate --device cpu` and
  `plan --hardware`, which measure them (on this project's loaded 2-core VM the best fp32 GEMM measured
  50-175 GFLOP/s and the memory bandwidth 6-26 GB/s, depending on the load).
"""

from __future__ import annotations

import dataclasses
import math

from tensorpar.errors import TensorparError

# AdamW's step, memory-bound: read the gradient, read and write the fp32 master and both moments (on the device or,
# offloaded, on the host)
OPTIMIZER_BYTES_PER_ELEMENT = 28


def optimizer_bytes_per_element(state_bytes: int = 4) -> int:
    """OPTIMIZER_BYTES_PER_ELEMENT with AdamW's two moments of `state_bytes` each (2: --optimizer-state-dtype bf16,
    which reads and writes 8 bytes less an element)."""
    return OPTIMIZER_BYTES_PER_ELEMENT - 4 * (4 - state_bytes)


@dataclasses.dataclass(frozen=True)
class DeviceCurve:
    """The kernel-level speed of one device (see the module docstring for the model and the sources)."""

    name: str
    gemm_efficiency: dict  # {"bf16": f, "fp8": f, "fp32": f}: fraction of the datasheet peak for large GEMMs
    units: int  # SMs / CUs / cores: output tiles computed at once
    tile_m: int = 128
    tile_n: int = 256
    k_overhead: float = 128.0
    wave_quantization: float = 0.5
    launch_s: float = 4e-6
    hbm_efficiency: float = 0.85
    attention_efficiency: tuple = (0.55, 0.45)  # flash attention forward, backward: fraction of the bf16 peak
    source: str = ""

    def efficiency(self, dtype: str) -> float:
        if dtype in self.gemm_efficiency:
            return self.gemm_efficiency[dtype]
        return self.gemm_efficiency["bf16"]


_MAMF = "stas00/ml-engineering compute/accelerator/README.md, Maximum Achievable Matmul FLOPS table"

CURVES: dict[str, DeviceCurve] = {
    "a100": DeviceCurve("a100", {"bf16": 0.859, "fp32": 0.859}, units=108, attention_efficiency=(0.6, 0.5),
                        source=f"{_MAMF} (A100 SXM 267.9/312); 108 SMs"),
    "h100": DeviceCurve("h100", {"bf16": 0.803, "fp8": 0.709, "fp32": 0.803}, units=132,
                        source=f"{_MAMF} (H100/H200 SXM 794.5/989, fp8 H100 SXM 1402.6/1979); 132 SMs"),
    "h200": DeviceCurve("h200", {"bf16": 0.803, "fp8": 0.734, "fp32": 0.803}, units=132,
                        source=f"{_MAMF} (H100/H200 SXM 794.5/989, fp8 1453.4/1979); 132 SMs"),
    "b200": DeviceCurve("b200", {"bf16": 0.776, "fp8": 0.763, "fp32": 0.776}, units=148,
                        source=f"{_MAMF} (B200 SXM 1745/2250, fp8 3432.5/4500); 148 SMs"),
    "mi300x": DeviceCurve("mi300x", {"bf16": 0.601, "fp8": 0.601, "fp32": 0.601}, units=304,
                          attention_efficiency=(0.4, 0.3),
                          source=f"{_MAMF} (MI300X 781.9/1300, ROCm 6.2); 304 CUs; fp8 assumed as bf16"),
    "cpu": DeviceCurve("cpu", {"bf16": 0.2, "fp32": 0.75}, units=2, tile_m=64, tile_n=64, k_overhead=32.0,
                       wave_quantization=1.0, launch_s=20e-6, hbm_efficiency=0.6, attention_efficiency=(0.3, 0.25),
                       source="placeholder for a 2-core x86 machine: calibrate ('tensorpar calibrate --device cpu')"),
}

_FAMILY = {"a100-80gb": "a100", "a100-40gb": "a100", "h100-80gb": "h100", "h200": "h200", "b200": "b200",
           "mi300x": "mi300x", "cpu": "cpu"}


def curve_for(gpu_name: str) -> DeviceCurve:
    """The curve of a catalog GPU (`tensorpar.config.hardware` name)."""
    key = _FAMILY.get(gpu_name, gpu_name)
    if key not in CURVES:
        raise TensorparError(f"no compute curve for device '{gpu_name}'; known: {', '.join(sorted(CURVES))} "
                             f"(or measure one with 'tensorpar calibrate')")
    return CURVES[key]


def gemm_time(m: float, n: float, k: float, peak: float, hbm_bandwidth: float, curve: DeviceCurve,
              dtype: str = "bf16", nbytes: int = 2) -> float:
    """Seconds of one C[m, n] = A[m, k] B[k, n] GEMM (see the module docstring)."""
    if m <= 0 or n <= 0 or k <= 0:
        return 0.0
    tiles = math.ceil(m / curve.tile_m) * math.ceil(n / curve.tile_n)
    exact = tiles / curve.units
    waves = exact + curve.wave_quantization * (math.ceil(exact) - exact)
    rate = peak * curve.efficiency(dtype) / curve.units
    t_math = waves * 2.0 * curve.tile_m * curve.tile_n * (k + curve.k_overhead) / rate
    t_mem = (m * k + k * n + m * n) * nbytes / (hbm_bandwidth * curve.hbm_efficiency)
    return max(t_math, t_mem) + curve.launch_s


def memory_time(nbytes: float, hbm_bandwidth: float, curve: DeviceCurve, kernels: int = 0) -> float:
    """Seconds to stream `nbytes` through HBM in `kernels` launches."""
    return nbytes / (hbm_bandwidth * curve.hbm_efficiency) + kernels * curve.launch_s


def flash_attention_time(batch_heads: float, s_q: float, s_kv: float, head_dim: float, peak: float,
                         curve: DeviceCurve, causal: bool = True) -> tuple[float, float]:
    """(forward, backward) seconds of flash attention over `batch_heads` (batch x local query heads)."""
    pairs = s_q * s_kv * (0.5 if causal and s_q == s_kv else 1.0)
    fwd_flops = 4.0 * batch_heads * pairs * head_dim
    fwd = fwd_flops / (peak * curve.attention_efficiency[0]) + curve.launch_s
    bwd = 2.5 * fwd_flops / (peak * curve.attention_efficiency[1]) + curve.launch_s
    return fwd, bwd
