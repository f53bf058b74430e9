#!/usr/bin/env python
"""Attention within packed documents at long sequences: the peak memory and the step time of training the tiny
model at seq-len 8192 on a JSONL corpus of ~256-token documents, by kernel (`--document-attention`):

    none     no --document-mask (causal attention across documents: the reference's cost)
    dense    --document-mask with SDPA and the [S, S] boolean mask (the kernel before the varlen one)
    varlen   --document-mask, documents gathered into padded per-length batches, SDPA causal, no mask
    flex     --document-mask by compiled flex_attention and a block mask (CUDA only)

Each variant runs in a process of its own (`tensorpar.training.train`, one rank, `--steps` steps of one window),
which reports its peak resident memory (ru_maxrss: the whole process, torch included), on CUDA the allocator's peak,
the median step time after the first, its wall time and its CPU seconds (all threads, the whole run: on a shared
machine the steadier figure). The last line is

    varlen/dense memory=X.XX step=Y.YY cpu=Z.ZZ varlen/none ...   (ratios of the peaks, step times, CPU seconds)

    .venv/bin/python bench/document_attention.py                       # CPU, about 2 minutes on 2 cores
    .venv/bin/python bench/document_attention.py --device cuda --model llama-1b --dtype bf16 \
        --variants none,dense,varlen,flex --steps 5
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

import torch


def write_corpus(path: str, tokens: int, doc_bytes: int = 256) -> None:
    """A JSONL file of documents of ~`doc_bytes` bytes (byte-level tokens; an EOS follows each) from the embedded
    corpus, `tokens` bytes in all."""
    from tensorpar.data.corpus import default_corpus_text

    text = default_corpus_text().encode("ascii", "ignore").decode()
    text = (text * (tokens // len(text) + 1))[:tokens]
    with open(path, "w") as f:
        for i, start in enumerate(range(0, len(text), doc_bytes)):
            n = doc_bytes - 64 + (37 * i) % 128  # 192 to 319 bytes
            f.write(json.dumps({"text": text[start:start + n]}) + "\n")


def child(a) -> None:
    """One variant in this process: its measurements as one JSON line."""
    from tensorpar.training import TrainOptions, train

    torch.set_num_threads(a.threads)
    t0, cpu0 = time.perf_counter(), time.process_time()
    s = train(TrainOptions(model=a.model, dtype=a.dtype, seq_len=a.seq_len, global_batch_size=1, steps=a.steps,
                           warmup_steps=0,
                           data=a.data, data_cache=a.cache, document_mask=a.child != "none",
                           document_attention="auto" if a.child == "none" else a.child, device=a.device,
                           val_every=0, val_fraction=0.0, progress=False, metrics=None, out_dir=None))
    steps = [r["step_time_s"] for r in s["history"]]
    out = {"wall_s": time.perf_counter() - t0, "cpu_s": time.process_time() - cpu0,
           "step_s": statistics.median(steps[1:] or steps),
           "first_step_s": steps[0], "max_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
           "loss": s["history"][-1]["loss"]}
    if a.device == "cuda":
        out["cuda_peak_mib"] = max(r["memory_mib"].get("allocated", 0.0) for r in s["history"])
    print(json.dumps(out), flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny")
    p.add_argument("--seq-len", type=int, default=8192)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="fp32")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--variants", default="none,dense,varlen")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--data", help=argparse.SUPPRESS)
    p.add_argument("--cache", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        child(a)
        return 0
    folder = tempfile.mkdtemp()
    data = os.path.join(folder, "docs.jsonl")
    write_corpus(data, (a.seq_len + 1) * (a.steps + 1))
    print(f"model {a.model} ({a.dtype}), one window of {a.seq_len} tokens a step, documents of 192-319 bytes (byte tokens), "
          f"{a.steps} steps, {a.device}, torch {torch.__version__}, {a.threads} threads", flush=True)
    print(f"{'variant':8} {'step s':>8} {'1st step s':>10} {'wall s':>7} {'CPU s':>7} {'peak RSS MiB':>12} "
          f"{'CUDA peak MiB':>13}", flush=True)
    results = {}
    for name in a.variants.split(","):
        cmd = [sys.executable, __file__, "--child", name, "--data", data, "--cache", os.path.join(folder, "cache"),
               "--model", a.model, "--seq-len", str(a.seq_len), "--steps", str(a.steps), "--device", a.device,
               "--dtype", a.dtype,
               "--threads", str(a.threads)]
        line = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1]
        r = results[name] = json.loads(line)
        print(f"{name:8} {r['step_s']:8.2f} {r['first_step_s']:10.2f} {r['wall_s']:7.1f} {r['cpu_s']:7.1f} "
              f"{r['max_rss_mib']:12.0f} "
              f"{r.get('cuda_peak_mib', float('nan')):13.0f}", flush=True)
    mem = "cuda_peak_mib" if a.device == "cuda" else "max_rss_mib"
    pairs = (("varlen", "dense"), ("varlen", "none"), ("flex", "dense"), ("flex", "varlen"))
    ratios = [f"{x}/{y} memory={results[x][mem] / results[y][mem]:.2f} "
              f"step={results[x]['step_s'] / results[y]['step_s']:.2f} cpu={results[x]['cpu_s'] / results[y]['cpu_s']:.2f}"
              for x, y in pairs if x in results and y in results]
    print(" ".join(ratios))
    return 0


if __name__ == "__main__":
    sys.exit(main())
