#!/usr/bin/env python
"""Context parallelism at long sequence length: activation memory per rank, and how evenly the ranks work.

    .venv/bin/python bench/context_parallel.py                  # seq 8192, the tiny Llama, cp 1 and cp 4
    .venv/bin/python bench/context_parallel.py --seq-len 4096 --cp 2 4
    .venv/bin/python bench/context_parallel.py --seq-len 4096 --cp 4 --doc-len 256   # + packed documents

For each CP size (world = cp processes over gloo, one thread each) the tiny Llama preset runs one
forward and backward of one sequence; measured per rank:

- activation memory: the bytes of every tensor autograd saves for backward during the forward
  (distinct storages, summed: torch.autograd.graph.saved_tensors_hooks), i.e. what a rank holds
  between its forward and its backward;
- attention compute time: the CPU seconds the ring spends attending (forward and backward), not waiting
  for blocks (`ContextSplit.compute_seconds`), for the zigzag and the contiguous split. Measured twice:
  in the cp processes running at once (on a machine with fewer cores than cp ranks they compete for
  cores and caches, which blurs the comparison), and one rank after another in this process, each
  rank's ring fed the blocks its neighbours would send by a stand-in group (the compute alone).

- with ``--doc-len D``: the same one-rank-at-a-time ring compute (zigzag) with a document mask, the sequence
  packed with documents of D tokens (an EOS every D tokens), against the unmasked ring: the blocks each
  rank attends (counted by the ring, forward and backward) and its compute seconds. A block the documents
  leave empty is skipped, so with D much shorter than a chunk (seq / 2 cp) a rank attends little more than
  its two diagonal blocks.

The last line reads ``cpN/cp1 activations=X.XX zigzag max/min=Y.YY contiguous max/min=Z.ZZ`` for the
largest N given, followed by `` documents/full compute=R.RR blocks=A/B`` (the most loaded rank's) with --doc-len.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

import torch


def _saved_bytes(fn) -> int:
    """Bytes of the distinct storages autograd saves while `fn()` runs."""
    storages: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sum(storages.values())


def worker(args) -> None:
    torch.set_num_threads(1)
    import tensorpar
    from tensorpar.context_parallel.ring_attention import ContextSplit, ring_attention
    from tensorpar.models import get_config
    from tensorpar.models.build import build_transformer

    cp = int(os.environ.get("WORLD_SIZE", "1"))
    mesh = tensorpar.init_mesh(tp=1, cp=cp, timeout=600)
    cfg = get_config(args.model)
    torch.manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (1, args.seq_len + 1))
    model = build_transformer(cfg, mesh, seed=1)
    model.train()
    loss, saved = _saved_bytes(lambda: model(ids[:, :-1], ids[:, 1:]))
    loss.backward()
    result = {"rank": mesh.rank, "cp": cp, "saved_bytes": saved, "loss": loss.item()}
    if cp > 1:
        for split in ("zigzag", "contiguous"):
            ctx = ContextSplit(mesh.cp_group, args.seq_len, split, "ring", compute_seconds=[0.0])
            local = args.seq_len // cp
            q = torch.randn(1, cfg.num_heads, local, cfg.head_dim, requires_grad=True)
            k = torch.randn(1, cfg.kv_heads, local, cfg.head_dim, requires_grad=True)
            v = torch.randn(1, cfg.kv_heads, local, cfg.head_dim, requires_grad=True)
            for _ in range(args.repeats):
                ring_attention(q, k, v, ctx).sum().backward()
            result[f"{split}_seconds"] = ctx.compute_seconds[0]
    with open(args.out, "w") as f:
        json.dump(result, f)
    mesh.destroy()


class _Done:
    def wait(self):
        pass


class LoopbackRing:
    """A stand-in CP group for one rank of the ring: what it receives is the block the real ring would bring
    (K and V of the right rank; gradients arrive as zeros, their values do not change the work)."""

    def __init__(self, rank: int, size: int, blocks):
        self.rank, self.size, self.name, self.blocks = rank, size, "cp", blocks
        self.received = {}

    def isend(self, tensor, dst, tag=0):
        return _Done()

    def irecv(self, tensor, src, tag=0):
        kind, which = tag % 4, tag // 4  # ring_attention's tags: (direction or gradient) + 4 x tensor index
        if kind in (0, 1):  # K or V blocks, forward or backward: the s-th receive brings rank (rank - 1 - s)'s
            count = self.received.get((kind, which), 0)
            self.received[(kind, which)] = count + 1
            tensor.copy_(self.blocks[(self.rank - 1 - count) % self.size][which])
        else:
            tensor.zero_()
        return _Done()


def packed_documents(seq_len: int, doc_len: int):
    """The packed documents of one window with an EOS every `doc_len` tokens."""
    from tensorpar.functional.document_mask import PackedDocuments

    ids = torch.zeros(1, seq_len, dtype=torch.long)
    ids[:, doc_len - 1::doc_len] = 1
    return PackedDocuments.from_tokens(ids, eos_id=1)


def sequential_times(args, cp: int, split: str, doc_len: int | None = None) -> tuple[list[float], list[int]]:
    """Each rank's ring compute, one rank after another in this process (one thread): no competition. Returns
    (seconds, blocks attended in one forward and backward) per rank; with `doc_len`, under a document mask."""
    from tensorpar.context_parallel.ring_attention import ContextSplit, ring_attention
    from tensorpar.models import get_config

    torch.set_num_threads(1)
    cfg = get_config(args.model)
    local = args.seq_len // cp
    documents = packed_documents(args.seq_len, doc_len) if doc_len else None
    torch.manual_seed(0)
    blocks = {r: (torch.randn(1, cfg.kv_heads, local, cfg.head_dim), torch.randn(1, cfg.kv_heads, local, cfg.head_dim))
              for r in range(cp)}
    seconds, attended = [[0.0] for _ in range(cp)], [[0] for _ in range(cp)]
    for repeat in range(args.repeats + 1):  # round-robin over the ranks; the first round warms up, untimed
        for rank in range(cp):
            timer = seconds[rank] if repeat else [0.0]
            ctx = ContextSplit(LoopbackRing(rank, cp, blocks), args.seq_len, split, "ring", compute_seconds=timer,
                               attended_blocks=attended[rank] if repeat == 1 else [0])
            q = torch.randn(1, cfg.num_heads, local, cfg.head_dim, requires_grad=True)
            k, v = (t.clone().requires_grad_() for t in blocks[rank])
            ring_attention(q, k, v, ctx, documents=documents).sum().backward()
    return [t[0] for t in seconds], [b[0] for b in attended]


def document_lines(args, cp: int, full: list[float], full_blocks: list[int]) -> tuple[str, str]:
    """(report line, last-line suffix) of the ring under a document mask of --doc-len tokens, against `full`."""
    masked, blocks = sequential_times(args, cp, "zigzag", args.doc_len)
    worst = max(range(cp), key=lambda r: masked[r])
    per_rank = ", ".join(f"{t:.2f} s ({b}/{f} blocks)" for t, b, f in zip(masked, blocks, full_blocks))
    ratio = max(masked) / max(full)
    line = (f"      documents of {args.doc_len} tokens (chunks of {args.seq_len // (2 * cp)}), zigzag, one rank at a "
            f"time: {per_rank}; max {ratio:.2f} x unmasked")
    return line, f" documents/full compute={ratio:.2f} blocks={blocks[worst]}/{full_blocks[worst]}"


def run(args, cp: int, tmp: str) -> list[dict]:
    port = 29500 + (os.getpid() % 1000) + cp
    procs, outs = [], []
    for rank in range(cp):
        out = os.path.join(tmp, f"cp{cp}-rank{rank}.json")
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(cp), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        argv = [sys.executable, __file__, "--worker", "--out", out, "--seq-len", str(args.seq_len), "--model",
                args.model, "--repeats", str(args.repeats)]
        procs.append(subprocess.Popen(argv, env=env))
        outs.append(out)
    for p in procs:
        if p.wait() != 0:
            raise SystemExit(f"a cp={cp} worker failed")
    return [json.load(open(o)) for o in outs]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--cp", type=int, nargs="+", default=[4])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--repeats", type=int, default=3, help="ring forward+backward repeats for the timing")
    parser.add_argument("--doc-len", type=int, default=0,
                        help="also time the ring under a document mask, documents of this many tokens")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        base = run(args, 1, tmp)[0]
        print(f"seq {args.seq_len}, {args.model}: cp 1 saves {base['saved_bytes'] / 2**20:.1f} MiB for backward "
              f"(loss {base['loss']:.6f})")
        last = ""
        for cp in args.cp:
            ranks = run(args, cp, tmp)
            mem = [r["saved_bytes"] for r in ranks]
            ratio = max(mem) / base["saved_bytes"]
            zig = [r["zigzag_seconds"] for r in ranks]
            con = [r["contiguous_seconds"] for r in ranks]
            saved = ", ".join(f"{m / 2**20:.1f}" for m in mem)
            losses = ", ".join(f"{r['loss']:.6f}" for r in ranks)
            print(f"cp {cp}: saved per rank {saved} MiB (max {ratio:.2f} x cp 1); losses {losses}")
            (alone, full_blocks), (alone_con, _) = (sequential_times(args, cp, split)
                                                    for split in ("zigzag", "contiguous"))
            for label, zig, con in (("all ranks at once", zig, con), ("one rank at a time", alone, alone_con)):
                zig_s, con_s = ", ".join(f"{t:.2f}" for t in zig), ", ".join(f"{t:.2f}" for t in con)
                print(f"      attention compute per rank ({label}), zigzag: {zig_s} s (max/min "
                      f"{max(zig) / min(zig):.2f}); contiguous: {con_s} s (max/min {max(con) / min(con):.2f})")
            last = (f"cp{cp}/cp1 activations={ratio:.2f} zigzag max/min={max(zig) / min(zig):.2f} "
                    f"contiguous max/min={max(con) / min(con):.2f} (one rank at a time)")
            if args.doc_len:
                line, suffix = document_lines(args, cp, alone, full_blocks)
                print(line)
                last += suffix
        print(last)
    return 0


if __name__ == "__main__":
    sys.exit(main())
