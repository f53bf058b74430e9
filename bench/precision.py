#!/usr/bin/env python
"""fp32 vs bf16 vs fp16 training: the same run (`tensorpar train`'s defaults: the tiny preset on the embedded corpus,
16 x 128 tokens a step) in each precision.

bf16 and fp16 keep bf16/fp16 parameters, activations and gradients with fp32 master weights in the optimizer;
fp16 adds dynamic loss scaling. Each run is `tensorpar.training.train` in this process (one rank). Printed: the
final training loss (mean of the last 10 steps) and validation loss of each, the relative difference to fp32,
the fp16 loss-scale history (skipped steps, final scale) and the seconds each took; the last line is

    bf16/fp32=X.XXXX fp16/fp32=Y.YYYY     (ratios of the final training losses)

    .venv/bin/python bench/precision.py                    # 200 steps, 15 minutes or more on 2 cores
    .venv/bin/python bench/precision.py --global-batch-size 8 --seq-len 64    # a quarter of the tokens, ~5 min
    .venv/bin/python bench/precision.py --steps 20          # a quick check

On a CPU without native bf16/fp16 matmuls the low-precision runs are far slower than fp32 (emulated); the
point here is the loss, not the speed.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from tensorpar.training import TrainOptions, train


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--global-batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    results = {}
    for dtype in ("fp32", "bf16", "fp16"):
        t0 = time.perf_counter()
        s = train(TrainOptions(model="tiny", dtype=dtype, steps=a.steps, global_batch_size=a.global_batch_size,
                               seq_len=a.seq_len, device=a.device, val_every=0, progress=False, metrics=None,
                               out_dir=None))
        tail = [r["loss"] for r in s["history"][-10:]]
        results[dtype] = dict(loss=sum(tail) / len(tail), val=s["final_val_loss"], seconds=time.perf_counter() - t0,
                              history=s["history"])
    ref = results["fp32"]
    print(f"tiny preset, embedded corpus, {a.steps} steps of {a.global_batch_size} x {a.seq_len} tokens, "
          f"{a.device}, torch {torch.__version__}")
    print(f"{'dtype':6} {'loss (last 10)':>15} {'vs fp32':>9} {'val loss':>9} {'vs fp32':>9} {'seconds':>8}")
    for dtype, r in results.items():
        print(f"{dtype:6} {r['loss']:15.4f} {100 * (r['loss'] / ref['loss'] - 1):+8.2f}% {r['val']:9.4f} "
              f"{100 * (r['val'] / ref['val'] - 1):+8.2f}% {r['seconds']:8.1f}")
    scales = [h["loss_scale"] for h in results["fp16"]["history"]]
    skipped = [h["step"] for h in results["fp16"]["history"] if h["skipped"]]
    print(f"fp16 loss scale: start {scales[0]:g}, end {scales[-1]:g}, skipped steps {skipped or 'none'}")
    print(f"bf16/fp32={results['bf16']['loss'] / ref['loss']:.4f} fp16/fp32={results['fp16']['loss'] / ref['loss']:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
