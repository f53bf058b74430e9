#!/usr/bin/env python
"""Profile `tensorpar train` in this process (one rank) with torch.profiler and print where the time goes.

    python bench/profile_train.py --model llama-1b --device cuda --dtype bf16 --seq-len 2048 \\
        --micro-batch-size 4 --global-batch-size 16 --steps 4

Any `tensorpar train` option is accepted (`--key value`, `--flag`). The table lists the operators with the
most self device time (CUDA) or self CPU time, over the whole run including its first step; `--trace FILE`
also writes a Chrome trace (chrome://tracing, Perfetto). On CUDA, `--kernels N` then sums every device activity
(kernels, copies) by kind (GEMMs split into fp8 and the rest, attention, inductor's fused kernels, elementwise,
reductions, copies, the optimizer, collectives) and lists the N kernels with the most time, in ms per step.
"""

from __future__ import annotations

import argparse
import collections
import re
import sys

import torch
from torch.profiler import ProfilerActivity, profile


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=30)
    p.add_argument("--trace", default=None)
    p.add_argument("--kernels", type=int, default=0, help="CUDA: device time by kind, and the N longest kernels")
    args, rest = p.parse_known_args(argv)
    from tensorpar.config.fields import add_options, options_from_args
    from tensorpar.training import TrainOptions, train

    train_parser = argparse.ArgumentParser(prog="tensorpar train")
    add_options(train_parser, TrainOptions)
    rest += ["--no-progress", "--sample-tokens", "0", "--val-fraction", "0", "--val-every", "0"]
    options = options_from_args(TrainOptions, train_parser.parse_args(rest), "train")
    cuda = torch.cuda.is_available() and options.device != "cpu"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        summary = train(options)
    key = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    print(prof.key_averages().table(sort_by=key, row_limit=args.rows))
    if args.trace:
        prof.export_chrome_trace(args.trace)
    if cuda and args.kernels:
        print(kernel_table(prof, options.steps, args.kernels))
    print(f"mean MFU {summary['mfu']:.3f}")
    return 0


# A device activity's kind, by its name: the first pattern that matches (fp8 GEMMs before the others).
KINDS = [("GEMM fp8", r"(gemm|nvjet|xmma|cutlass).*(e4m3|e5m2|f8)|_qq|scaled_mm"),
         ("GEMM", r"gemm|nvjet|xmma|cutlass|cublas"),
         ("attention", r"flash|fmha|attention|cudnn"),
         ("inductor (fused)", r"^triton_"),
         ("collectives", r"nccl"),
         ("optimizer", r"multi_tensor|adam"),
         ("copies", r"(?i)memcpy|memset|copy"),
         ("reductions", r"reduce|softmax|norm"),
         ("elementwise", r"elementwise|vectorized|unrolled|index|scatter|gather|fill")]


def kind_of(name: str) -> str:
    return next((kind for kind, pattern in KINDS if re.search(pattern, name)), "other")


def kernel_table(prof, steps: int, rows: int) -> str:
    """Device time per step (ms) by kind, then the `rows` kernels with the most, over the profiled run."""
    from torch.autograd import DeviceType

    by_kind, by_name = collections.Counter(), collections.Counter()
    for ev in prof.profiler.kineto_results.events():
        if ev.device_type() == DeviceType.CUDA:
            ms = ev.duration_ns() / 1e6 / steps
            by_kind[kind_of(ev.name())] += ms
            by_name[ev.name()] += ms
    total = sum(by_kind.values())
    lines = [f"device time per step, by kind (over {steps} steps): {total:.1f} ms"]
    lines += [f"  {kind:<18}{ms:>10.1f} ms {100 * ms / total:5.1f}%" for kind, ms in by_kind.most_common()]
    lines.append(f"the {rows} longest kernels (ms per step, kind):")
    lines += [f"  {ms:>8.2f}  {kind_of(name):<18} {name[:110]}" for name, ms in by_name.most_common(rows)]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
