"""Check the planner's shipped compute curve against a calibrated profile of the same device.

    python bench/device_curve_check.py PROFILE.json CURVE [PEAK_TFLOPS] [HBM_TB_S]

prints, for every GEMM the profile measured, the measured time and the time `planning.devices.gemm_time`
predicts with the shipped curve CURVE (e.g. h100) and the datasheet peak, and the median / worst error; then
times flash attention (torch SDPA, causal) forward and backward at a few shapes when CUDA is available."""

from __future__ import annotations

import json
import statistics
import sys

import torch

from tensorpar.planning.devices import CURVES, flash_attention_time, gemm_time


def main(path, curve_name, peak_tflops=989.4, hbm_tbs=3.35):
    prof = json.load(open(path))
    curve = CURVES[curve_name]
    peak, hbm = float(peak_tflops) * 1e12, float(hbm_tbs) * 1e12
    errs = []
    for p in prof["gemms"].get("bf16", []):
        pred = gemm_time(p["m"], p["n"], p["k"], peak, hbm, curve, "bf16")
        errs.append(pred / p["seconds"] - 1)
        print(f"{p['m']:>6} {p['n']:>6} {p['k']:>6}  measured {p['flops_per_s'] / 1e12:7.1f} TFLOP/s "
              f"{p['seconds'] * 1e6:10.1f} us  predicted {pred * 1e6:10.1f} us  {100 * errs[-1]:+6.1f}%")
    if errs:
        print(f"bf16 GEMMs: median |error| {100 * statistics.median(abs(e) for e in errs):.1f}%, "
              f"worst {100 * max(errs, key=abs):+.1f}%, best measured {max(p['flops_per_s'] for p in prof['gemms']['bf16']) / 1e12:.0f} TFLOP/s")
    if torch.cuda.is_available():
        for b, heads, s, d in ((1, 32, 4096, 128), (1, 8, 8192, 128), (2, 16, 2048, 128)):
            q, k, v = (torch.randn(b, heads, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                       for _ in range(3))
            f = lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)  # noqa: E731
            for _ in range(3):
                f().sum().backward()
            torch.cuda.synchronize()
            ev = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
            ev[0].record()
            for _ in range(10):
                o = f()
            ev[1].record()
            for _ in range(10):
                f().backward(torch.ones_like(o))
            ev[2].record()
            torch.cuda.synchronize()
            fwd = ev[0].elapsed_time(ev[1]) / 10 / 1e3
            both = ev[1].elapsed_time(ev[2]) / 10 / 1e3
            pf, pb = flash_attention_time(b * heads, s, s, d, peak, curve)
            flops = 2 * b * heads * s * s * d  # causal forward: 4 b h s^2 d / 2
            print(f"attention b={b} heads={heads} s={s}: fwd {fwd * 1e3:.3f} ms ({flops / fwd / 1e12:.0f} TFLOP/s, "
                  f"model {pf * 1e3:.3f} ms), fwd+bwd {both * 1e3:.3f} ms (model {(pf + pb) * 1e3:.3f} ms)")


if __name__ == "__main__":
    main(*sys.argv[1:])
