"""`tensorpar calibrate [--device cpu|cuda] --out profile.json`: measure this machine for the planner.

Times GEMMs over a sweep of shapes (per dtype), the memory bandwidth, the host (copies to and from it, an AdamW step
there) and the collectives by size and group
(`tensorpar.planning.calibration`), fits the planner's compute curve and alpha-beta link to them and writes
everything as JSON; ``tensorpar plan --hardware profile.json`` then plans for this machine.
"""

from __future__ import annotations

import json

import torch

from tensorpar.config import applicability
from tensorpar.config.fields import add_options, options_from_args
from tensorpar.config.options import CalibrateOptions
from tensorpar.errors import TensorparError
from tensorpar.planning.calibration import calibrate
from tensorpar.planning.devices import OPTIMIZER_BYTES_PER_ELEMENT


def add_parser(sub) -> None:
    p = sub.add_parser("calibrate", help="measure GEMMs, bandwidth and collectives of this machine for `plan`")
    add_options(p, CalibrateOptions)
    p.set_defaults(run=run)


def run(args, argv=None) -> int:
    options = options_from_args(CalibrateOptions, args, "calibrate")
    if options.ranks < 1:
        raise TensorparError(f"--ranks must be a positive integer, got {options.ranks}")
    applicability.check("calibrate", options)
    if options.threads is not None:
        if options.threads < 1:
            raise TensorparError(f"--threads must be a positive integer, got {options.threads}")
        torch.set_num_threads(options.threads)
    dtypes = tuple(d.strip() for d in options.dtypes.split(",") if d.strip()) if options.dtypes else None
    profile = calibrate(options.device, ranks=options.ranks, measure_comm=not options.no_collectives,
                        threads=options.threads, dtypes=dtypes, sustain_s=options.sustain)
    with open(options.out, "w") as f:
        json.dump(profile, f, indent=1)
    for dt, peak in profile["peak_flops"].items():
        c = profile["curves"][dt]
        print(f"{dt}: best GEMM {peak / 1e12:.3f} TFLOP/s; curve level {c['gemm_efficiency']:.2f} of it, tile "
              f"{c['tile_m']}, k_overhead {c['k_overhead']:.0f}, "
              f"wave quantization {c['wave_quantization']}, launch {c['launch_s'] * 1e6:.0f} us")
    for dt, kept in profile.get("sustained", {}).items():
        print(f"{dt} sustained: {kept['m']}x{kept['n']}x{kept['k']} for {kept['seconds']:.0f} s: swept at "
              f"{kept['swept_flops_per_s'] / 1e12:.3f} TFLOP/s, {kept['first_flops_per_s'] / 1e12:.3f} in the first "
              f"windows, {kept['last_flops_per_s'] / 1e12:.3f} at the end (keeps {kept['ratio']:.0%}; the plan uses "
              f"level x {kept['ratio']:.2f})")
    print(f"memory bandwidth {profile['hbm_bandwidth'] / 1e9:.1f} GB/s")
    host = profile["host_link"]
    print(f"host link {host['device_to_host'] / 1e9:.1f} GB/s to the host, {host['host_to_device'] / 1e9:.1f} back; "
          f"an AdamW step on the host {profile['host_optimizer_bandwidth'] / 1e9:.1f} GB/s "
          f"({profile['host_optimizer_bandwidth'] / OPTIMIZER_BYTES_PER_ELEMENT / 1e6:.0f} M elements/s)")
    if "link" in profile:
        print(f"collectives over {options.ranks} ranks: {profile['link']['bandwidth'] / 1e9:.2f} GB/s, "
              f"latency {profile['link']['latency'] * 1e6:.0f} us")
    print(f"wrote {options.out}")
    return 0
