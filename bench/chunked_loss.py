#!/usr/bin/env python
"""The LM head + vocab-parallel loss, unfused (logits [N, V], then `vocab_parallel_cross_entropy`) vs fused per chunk
of tokens (`chunked_head_cross_entropy`): peak memory and time of one forward + backward, one process (TP 1).

Each variant runs in a fresh subprocess: the inputs (h [N, H], W [V, H], targets) are allocated first, then the
forward and backward run `--repeat` + 1 times. Memory: the peak of the first forward + backward above what the
process held just before it, on CPU the kernel's resident-set high-water mark (VmHWM, reset through
/proc/self/clear_refs; the gradients dh and dW are in it), on CUDA `torch.cuda.max_memory_allocated`. Time: the
median of the `--repeat` runs after the first. The last line is

    memory chunked/unfused=X time chunked/unfused=Y

    .venv/bin/python bench/chunked_loss.py                              # 8192 tokens x 128,256 vocabulary, H 64
    .venv/bin/python bench/chunked_loss.py --hidden 4096 --device cuda  # on a GPU
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

from tensorpar.distributed.comm import Group
from tensorpar.tensor_parallel import chunked_head_cross_entropy, vocab_parallel_cross_entropy


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


class _Peak:
    """Peak memory above the current level, from `start()` to `bytes()`."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def start(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
        else:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # resets VmHWM to the current RSS
            self.base = _status_kib("VmRSS") * 1024

    def bytes(self) -> int:
        if self.cuda:
            torch.cuda.synchronize()
            return torch.cuda.max_memory_allocated() - self.base
        return _status_kib("VmHWM") * 1024 - self.base


def run_variant(a) -> dict:
    device = torch.device(a.device)
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    group = Group.single("tp")
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[a.dtype]
    h = torch.randn(a.tokens, a.hidden, device=device).to(dtype).requires_grad_()
    weight = (torch.randn(a.vocab, a.hidden, device=device) / a.hidden**0.5).to(dtype).requires_grad_()
    targets = torch.randint(0, a.vocab, (a.tokens,), device=device)

    def step():
        h.grad = weight.grad = None
        if a.variant == "unfused":
            loss = vocab_parallel_cross_entropy(F.linear(h, weight), targets, group, vocab_size=a.vocab)
        else:
            loss = chunked_head_cross_entropy(h, weight, None, targets, group, vocab_size=a.vocab,
                                              chunk_tokens=a.chunk)
        loss.backward()
        return loss.item()

    peak = _Peak(device)
    peak.start()
    loss = step()
    peak_bytes = peak.bytes()
    seconds = []
    for _ in range(a.repeat):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - t0)
    return {"peak_bytes": peak_bytes, "seconds": statistics.median(seconds), "loss": loss}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--chunk", type=int, default=1024, help="tokens per chunk of the fused variant")
    p.add_argument("--repeat", type=int, default=1, help="timed runs after the first (the median is reported)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32", help="of h and W (the loss is fp32 in both)")
    p.add_argument("--variant", choices=("unfused", "chunked"), help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.variant:
        print(json.dumps(run_variant(a)))
        return 0
    print(f"{a.tokens} tokens x {a.vocab} vocabulary, hidden {a.hidden}, chunk {a.chunk}, {a.dtype}, {a.device}, "
          f"{a.threads} threads")
    results = {}
    for variant in ("unfused", "chunked"):
        args = [arg for arg in sys.argv[1:]] + ["--variant", variant]
        out = subprocess.run([sys.executable, __file__, *args], check=True, capture_output=True, text=True).stdout
        results[variant] = r = json.loads(out.strip().splitlines()[-1])
        print(f"{variant:>8}: peak {r['peak_bytes'] / 2**30:7.3f} GiB  forward+backward {r['seconds']:7.3f} s  "
              f"loss {r['loss']:.6f}")
    u, c = results["unfused"], results["chunked"]
    print(f"memory chunked/unfused={c['peak_bytes'] / u['peak_bytes']:.3f} "
          f"time chunked/unfused={c['seconds'] / u['seconds']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
