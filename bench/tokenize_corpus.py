#!/usr/bin/env python
"""Tokens per second of data preparation: tensorpar's tokenizer pass vs a single-threaded loop.

    .venv/bin/python bench/tokenize_corpus.py                  # a 100 MB JSONL corpus, 2 threads
    .venv/bin/python bench/tokenize_corpus.py --size-mb 10     # a quick check

The bench writes a JSONL corpus of `--size-mb` MB (synthetic English-like documents: words drawn from a
Zipf distribution over a fixed word list, seeded), trains a byte-level BPE tokenizer (vocabulary
`--vocab`, with <|endoftext|>) on its first 4 MB, and then tokenizes the whole corpus twice, each in a
fresh process pinned to `--threads` cores:

- prepare: `tensorpar.data.tokenize_source`, what `tensorpar prepare-data` and `train --data` run: JSONL
  read in batches of 1024 documents, `Tokenizer.encode_batch` (the library's Rust thread pool,
  RAYON_NUM_THREADS = --threads), each document's ids plus EOS written to a Megatron .bin/.idx;
- loop: the plain loop a user writes first: for each line, `json.loads`, `Tokenizer.encode(text)`, the ids
  plus EOS appended to a uint16 array written at the end (RAYON_NUM_THREADS=1).

Both must produce the same token stream (checked). Times are wall-clock seconds of the whole pass (read,
parse, tokenize, write); the CPU seconds of each pass and the share of the machine other processes used
meanwhile are printed too (the machine may be shared). With `--repeat N` the passes alternate N times and
the fastest of each kind counts. The last line reads ``prepare=X tok/s loop=Y tok/s speedup=Z.ZZ``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import subprocess
import tempfile
import time

import numpy as np

WORDS = ("the of and to in is was for that with as on by it from at his an were are which this be or has had "
         "not first one their its new after but who they have her she two been other when there all during into "
         "school time may years more most only over city some world would where later up such used many can "
         "state about national out known university united then made team under states high year three "
         "system american between well film since series second being game government no war both part "
         "century early while long including music through four both group number became around season each "
         "family these several day any life based north following south public water large general people "
         "training parallel tensor pipeline gradient optimizer sequence attention layer model data").split()


def write_corpus(path: str, size_mb: float, seed: int = 0) -> int:
    """A JSONL file of about `size_mb` MB of documents; returns the number of documents."""
    rng = np.random.default_rng(seed)
    ranks = np.arange(1, len(WORDS) + 1)
    p = 1.0 / ranks
    p /= p.sum()
    target, written, docs = int(size_mb * 1e6), 0, 0
    with open(path, "w", encoding="utf-8") as f:
        while written < target:
            lengths = rng.integers(50, 600, size=256)
            picks = rng.choice(len(WORDS), size=int(lengths.sum()), p=p)
            start = 0
            lines = []
            for n in lengths:
                words = [WORDS[i] for i in picks[start:start + n]]
                start += n
                words[0] = words[0].capitalize()
                text = " ".join(words) + f". Document {docs} ends here, number {rng.integers(10**6)}."
                lines.append(json.dumps({"id": docs, "text": text}) + "\n")
                docs += 1
            chunk = "".join(lines)
            f.write(chunk)
            written += len(chunk.encode())
    return docs


def train_tokenizer(corpus: str, vocab: int, out: str) -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    texts, size = [], 0
    with open(corpus, encoding="utf-8") as f:
        for line in f:
            texts.append(json.loads(line)["text"])
            size += len(line)
            if size > 4e6:
                break
    tok.train_from_iterator(texts, trainer)
    tok.save(out)
    return out


def run_prepare(corpus: str, tokenizer: str, prefix: str) -> dict:
    from tensorpar.data import HFTokenizer, tokenize_source

    info = tokenize_source(corpus, HFTokenizer(tokenizer), "text", prefix, progress=False)
    return {"tokens": info["tokens"], "seconds": info["seconds"], "documents": info["documents"]}


def run_loop(corpus: str, tokenizer: str, out: str) -> dict:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(tokenizer)
    eos = tok.token_to_id("<|endoftext|>")
    started = time.perf_counter()
    ids: list[int] = []
    docs = 0
    with open(corpus, encoding="utf-8") as f:
        for line in f:
            ids.extend(tok.encode(json.loads(line)["text"], add_special_tokens=False).ids)
            ids.append(eos)
            docs += 1
    np.asarray(ids, dtype=np.uint16).tofile(out)
    return {"tokens": len(ids), "seconds": time.perf_counter() - started, "documents": docs}


def _child(args) -> None:
    """One measured pass in this (fresh, pinned) process; prints its result as JSON."""
    if hasattr(os, "sched_setaffinity"):
        cores = sorted(os.sched_getaffinity(0))[: args.threads]
        os.sched_setaffinity(0, cores)
    fn = run_prepare if args.child == "prepare" else run_loop
    result = fn(args.corpus, args.tokenizer_file, args.out)
    usage = resource.getrusage(resource.RUSAGE_SELF)  # every thread of this process, start-up included
    result["cpu_seconds"] = usage.ru_utime + usage.ru_stime
    print(json.dumps(result))


def _cpu_jiffies() -> tuple[int, int] | None:
    """(busy, total) CPU time of the whole machine in clock ticks, from /proc/stat (None elsewhere)."""
    try:
        with open("/proc/stat") as f:
            values = [int(v) for v in f.readline().split()[1:]]
    except OSError:
        return None
    idle = values[3] + (values[4] if len(values) > 4 else 0)
    return sum(values) - idle, sum(values)


def _measure(kind: str, args, corpus: str, tokenizer: str, out: str) -> dict:
    """One pass in a child process; its result plus `other_load`: the share of the machine's CPU time that
    processes other than this pass used meanwhile (the machine is shared)."""
    before, own_before = _cpu_jiffies(), resource.getrusage(resource.RUSAGE_CHILDREN)
    result = _run_child(kind, args, corpus, tokenizer, out)
    after, own_after = _cpu_jiffies(), resource.getrusage(resource.RUSAGE_CHILDREN)
    if before and after:
        tick = os.sysconf("SC_CLK_TCK")
        own = (own_after.ru_utime + own_after.ru_stime) - (own_before.ru_utime + own_before.ru_stime)
        busy, total = (after[0] - before[0]) / tick, (after[1] - before[1]) / tick
        result["other_load"] = max(0.0, (busy - own) / total) if total else 0.0
    return result


def _run_child(kind: str, args, corpus: str, tokenizer: str, out: str) -> dict:
    threads = args.threads if kind == "prepare" else 1
    env = dict(os.environ, RAYON_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="true",
               OMP_NUM_THREADS="1")
    cmd = [sys.executable, __file__, "--child", kind, "--corpus", corpus, "--tokenizer-file", tokenizer,
           "--out", out, "--threads", str(args.threads)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if proc.returncode:
        sys.exit(f"{kind} failed:\n{proc.stderr}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mb", type=float, default=100.0, help="size of the generated JSONL corpus")
    parser.add_argument("--threads", type=int, default=2, help="cores for tensorpar's pass (the loop gets 1)")
    parser.add_argument("--vocab", type=int, default=8192, help="BPE vocabulary size")
    parser.add_argument("--repeat", type=int, default=1, help="passes of each kind, alternated; the fastest counts")
    parser.add_argument("--workdir", default=None, help="keep the corpus and outputs here (default: a temp dir)")
    parser.add_argument("--child", choices=("prepare", "loop"), help=argparse.SUPPRESS)
    parser.add_argument("--corpus", help=argparse.SUPPRESS)
    parser.add_argument("--tokenizer-file", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child(args)
        return
    work = args.workdir or tempfile.mkdtemp(prefix="tensorpar-tokenize-")
    os.makedirs(work, exist_ok=True)
    corpus = os.path.join(work, "corpus.jsonl")
    t0 = time.perf_counter()
    docs = write_corpus(corpus, args.size_mb)
    size = os.path.getsize(corpus)
    print(f"corpus: {corpus}, {size / 1e6:.1f} MB, {docs:,} documents (written in {time.perf_counter() - t0:.1f}s)")
    tokenizer = train_tokenizer(corpus, args.vocab, os.path.join(work, "tokenizer.json"))
    print(f"tokenizer: byte-level BPE, vocabulary {args.vocab}, trained on the first 4 MB")
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    print(f"machine: {cores} cores available; tensorpar pass pinned to {args.threads}, loop to 1 thread")
    runs = {"prepare": [], "loop": []}
    for _ in range(args.repeat):  # alternated, so that a burst of other load hits both
        runs["prepare"].append(_measure("prepare", args, corpus, tokenizer, os.path.join(work, "prepared")))
        runs["loop"].append(_measure("loop", args, corpus, tokenizer, os.path.join(work, "loop.bin")))
    prepare, loop = (min(runs[k], key=lambda r: r["seconds"]) for k in ("prepare", "loop"))
    a = np.fromfile(os.path.join(work, "prepared.bin"), dtype=np.uint16)
    b = np.fromfile(os.path.join(work, "loop.bin"), dtype=np.uint16)
    if not np.array_equal(a, b):
        sys.exit("the two passes produced different token streams")
    for name, r in (("prepare", prepare), ("loop", loop)):
        load = f", other load {100 * r['other_load']:.0f}% of the machine" if "other_load" in r else ""
        print(f"{name:8s} {r['tokens']:,} tokens in {r['seconds']:.1f}s = {r['tokens'] / r['seconds']:,.0f} tokens/s "
              f"({size / 1e6 / r['seconds']:.2f} MB/s of JSONL, {r['cpu_seconds']:.1f} CPU-s{load})"
              + ("; all runs: " + ", ".join(f"{x['seconds']:.1f}s" for x in runs[name]) if args.repeat > 1 else ""))
        if r.get("other_load", 0) > 0.05:
            print(f"warning: other processes used {100 * r['other_load']:.0f}% of the CPU during '{name}': its "
                  f"figure is low")
    print(f"same token stream: yes ({a.size:,} tokens)")
    p, lp = prepare["tokens"] / prepare["seconds"], loop["tokens"] / loop["seconds"]
    print(f"prepare={p:,.0f} tok/s loop={lp:,.0f} tok/s speedup={p / lp:.2f}")


if __name__ == "__main__":
    main()
