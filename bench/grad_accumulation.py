#!/usr/bin/env python
"""The fp32 gradient accumulation of bf16 parameters: what each micro-batch's `FlatBuffer.add_grad` costs, and what
other forms of the same add would.

With bf16 parameters every micro-batch adds each parameter's bf16 gradient into its slice of the fp32 flat buffer
(`flat[offset : offset + n].add_(grad)`). On CUDA that mixed-dtype add runs as an unvectorised kernel (the fourth
H200 run: 52 ms of llama-1b's 586 ms step, about 0.9 TB/s). This times, for one flat buffer of `--elements`
elements cut into slices of `--slice` elements (at offsets of `--misalign` elements past a multiple of 16, to see
whether alignment matters), a pass over every slice of:

    mixed      flat_slice.add_(grad)                      (today's)
    cast-add   flat_slice.add_(grad.float())              (a vectorised cast, then a vectorised fp32 add)
    compiled   torch.compile of the cast-add, one kernel   (if the backend compiles here)

The median of `--repeat` passes after one untimed pass, in ms, and the bytes each form must move over that time:
10 per element (read the bf16 gradient and the fp32 sum, write the sum), 18 for the cast-add (which also writes and
reads an fp32 copy of the gradient). The forms' results must be equal (the same fp32 sums). The last line is
``cast-add/mixed=X compiled/mixed=Y`` (time ratios).

    .venv/bin/python bench/grad_accumulation.py                               # CPU, small
    python bench/grad_accumulation.py --device cuda --elements 1236000000 --slice 4194304
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch


def forms(compile_ok: bool):
    out = {"mixed": lambda flat, grad: flat.add_(grad),
           "cast-add": lambda flat, grad: flat.add_(grad.float())}
    if compile_ok:
        out["compiled"] = torch.compile(lambda flat, grad: flat.add_(grad.float()), dynamic=True)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--elements", type=int, default=64 * 2**20)
    p.add_argument("--slice", type=int, default=2**20)
    p.add_argument("--misalign", type=int, default=0, help="elements past a multiple of 16 where each slice starts")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--no-compile", action="store_true")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    step = -(-args.slice // 16) * 16 + 16
    offsets = [o + args.misalign for o in range(0, args.elements - step, step)]
    grads = [torch.randn(args.slice, dtype=torch.bfloat16, device=device) for _ in range(min(8, len(offsets)))]
    compile_ok = not args.no_compile
    if compile_ok:
        from tensorpar.models.compile import compile_problem
        problem = compile_problem()
        if problem:
            print(f"compiled: skipped ({problem})")
            compile_ok = False
    results, sums = {}, {}
    for name, add in forms(compile_ok).items():
        flat = torch.zeros(args.elements, dtype=torch.float32, device=device)

        def one_pass():
            for i, off in enumerate(offsets):
                add(flat[off : off + args.slice], grads[i % len(grads)])

        one_pass()
        times = []
        for _ in range(args.repeat):
            sync()
            t0 = time.perf_counter()
            one_pass()
            sync()
            times.append(time.perf_counter() - t0)
        results[name] = statistics.median(times)
        sums[name] = flat.double().sum().item()
    n = len(offsets) * args.slice
    print(f"{n:,} elements in {len(offsets)} slices of {args.slice:,} (misaligned by {args.misalign}), "
          f"{device}, torch {torch.__version__}")
    for name, seconds in results.items():
        moved = n * (18 if name == "cast-add" else 10)
        print(f"  {name:<10}{1e3 * seconds:9.2f} ms  {moved / seconds / 1e9:8.1f} GB/s moved")
    same = len({round(v, 3) for v in sums.values()}) == 1
    print("sums equal" if same else f"sums differ: {sums}")
    base = results["mixed"]
    print(" ".join(f"{name}/mixed={seconds / base:.2f}" for name, seconds in results.items() if name != "mixed"))
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
