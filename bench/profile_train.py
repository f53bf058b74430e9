#!/usr/bin/env python
"""Profile `tensorpar train` in this process (one rank) with torch.profiler and print where the time goes.

    python bench/profile_train.py --model llama-1b --device cuda --dtype bf16 --seq-len 2048 \\
        --micro-batch-size 4 --global-batch-size 16 --steps 4

Any `tensorpar train` option is accepted (`--key value`, `--flag`). The table lists the operators with the
most self device time (CUDA) or self CPU time, over the whole run including its first step; `--trace FILE`
also writes a Chrome trace (chrome://tracing, Perfetto).
"""

from __future__ import annotations

import argparse
import sys

import torch
from torch.profiler import ProfilerActivity, profile


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=30)
    p.add_argument("--trace", default=None)
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
    print(f"mean MFU {summary['mfu']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
