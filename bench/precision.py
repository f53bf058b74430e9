#!/usr/bin/env python
"""fp32 vs bf16 vs fp16 vs fp8 training: the same run (`tensorpar train`'s defaults: the tiny preset on the embedded
corpus, 16 x 128 tokens a step) in each precision.

bf16 and fp16 keep bf16/fp16 parameters, activations and gradients with fp32 master weights in the optimizer;
fp16 adds dynamic loss scaling; fp8-tensorwise and fp8-rowwise are bf16 with the parallel linears' GEMMs in fp8
(`--dtype fp8 --fp8-recipe ...`). Each run is `tensorpar.training.train` in this process (one rank). Printed: the
final training loss (mean of the last 10 steps) and validation loss of each, the relative difference to fp32,
the fp16 loss-scale history (skipped steps, final scale) and the seconds each took; the last line is

    bf16/fp32=X.XXXX fp16/fp32=Y.YYYY ...    (ratios of the final training losses; fp8 also against bf16)

    .venv/bin/python bench/precision.py                    # 200 steps, 15 minutes or more on 2 cores
    .venv/bin/python bench/precision.py --global-batch-size 8 --seq-len 64    # a quarter of the tokens, ~5 min
    .venv/bin/python bench/precision.py --steps 20          # a quick check
    .venv/bin/python bench/precision.py --precisions fp32,bf16,fp8-tensorwise,fp8-rowwise
    .venv/bin/python bench/precision.py --precisions fp32,fp32+bf16-states   # AdamW's moments in bf16
                                                            # (--optimizer-state-dtype bf16; "+bf16-states" on any)
    .venv/bin/python bench/precision.py --device cuda --model llama-1b --precisions bf16,fp8-tensorwise --steps 50
                                                            # a GPU: bf16 vs fp8 step time (fp8/bf16 ratio)

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
    p.add_argument("--micro-batch-size", type=int, default=None, help="default: the whole global batch at once")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--model", default="tiny")
    p.add_argument("--precisions", default="fp32,bf16,fp16,fp8-tensorwise,fp8-rowwise",
                   help="comma-separated: fp32, bf16, fp16, fp8-tensorwise, fp8-rowwise, each optionally with "
                        "+bf16-states (the first is the reference)")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    results = {}
    for name in a.precisions.split(","):
        precision, _, states = name.partition("+")
        dtype, _, recipe = precision.partition("-")
        t0 = time.perf_counter()
        s = train(TrainOptions(model=a.model, dtype=dtype, fp8_recipe=recipe or "tensorwise", steps=a.steps,
                               optimizer_state_dtype="bf16" if states == "bf16-states" else "fp32",
                               global_batch_size=a.global_batch_size, micro_batch_size=a.micro_batch_size,
                               seq_len=a.seq_len, device=a.device,
                               val_every=0, progress=False, metrics=None, out_dir=None))
        tail = [r["loss"] for r in s["history"][-10:]]
        steps = [r["step_time_s"] for r in s["history"][len(s["history"]) // 2:]]  # after warm-up
        results[name] = dict(loss=sum(tail) / len(tail), val=s["final_val_loss"], seconds=time.perf_counter() - t0,
                             step=sorted(steps)[len(steps) // 2], history=s["history"])
        print(f"{name}: loss (last 10) {results[name]['loss']:.4f}, val {results[name]['val']}, "
              f"{results[name]['seconds']:.0f} s", file=sys.stderr, flush=True)
    report(a, results)
    return 0


def report(a, results: dict) -> None:
    names = list(results)
    ref = results[names[0]]
    print(f"{a.model}, embedded corpus, {a.steps} steps of {a.global_batch_size} x {a.seq_len} tokens, "
          f"{a.device}, torch {torch.__version__}")
    print(f"{'precision':15} {'loss (last 10)':>15} {'vs ' + names[0]:>9} {'val loss':>9} {'vs ' + names[0]:>9} "
          f"{'step s':>8} {'seconds':>8}")
    for name, r in results.items():
        val = f"{r['val']:9.4f} {100 * (r['val'] / ref['val'] - 1):+8.2f}%" if r["val"] is not None else " " * 19
        print(f"{name:15} {r['loss']:15.4f} {100 * (r['loss'] / ref['loss'] - 1):+8.2f}% {val} {r['step']:8.3f} "
              f"{r['seconds']:8.1f}")
    if "fp16" in results:
        scales = [h["loss_scale"] for h in results["fp16"]["history"]]
        skipped = [h["step"] for h in results["fp16"]["history"] if h["skipped"]]
        print(f"fp16 loss scale: start {scales[0]:g}, end {scales[-1]:g}, skipped steps {skipped or 'none'}")
    ratios = [f"{n}/{names[0]}={results[n]['loss'] / ref['loss']:.4f}" for n in names[1:]]
    if "bf16" in results:
        ratios += [f"{n}/bf16 loss={results[n]['loss'] / results['bf16']['loss']:.4f} "
                   f"step time={results[n]['step'] / results['bf16']['step']:.3f}" for n in names if "fp8" in n]
    print(" ".join(ratios))


if __name__ == "__main__":
    sys.exit(main())
