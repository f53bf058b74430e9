"""`tensorpar serve` under load: output tokens/s and latency percentiles at several concurrencies, continuous vs
static batching, transformers' `generate` on one process, and how many sequences the paged KV pool holds.

    python bench/serve.py [--checkpoint HF_FOLDER] [--tp 2] [--concurrency 1,4,16,64] [--device cpu|cuda]

Without --checkpoint it saves a small random Llama (with a byte-level BPE tokenizer; tests/serving_model.py) in a
temporary folder. Each request asks for a prompt of the folder's text and a random number of new tokens (8 to
--max-tokens, EOS ignored), streamed; the clients are threads, each sending its next request when its previous one
has finished (closed loop), `--requests-per-client` each. For every concurrency and batching mode it prints output
tokens/s, time to first token and inter-token latency (p50 / p90 / p99). Then transformers' generate runs the same
requests in batches of the concurrency (one process, left-padded, greedy), and a server whose pool holds
4 context-length sequences' tokens takes 64 clients: the most sequences it ran at once is compared with the 4 a
preallocated cache of that memory holds. The last line holds the ratios:

    c16/c1=X.XX continuous/static@16=Y.YY continuous/transformers@16=Z.ZZ paged/preallocated=N/4

On a GPU: python bench/serve.py --device cuda --tp 1 --hidden 2048 --layers 16 (one GPU per rank: --tp <= GPUs).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import statistics
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))


from serving_model import (  # noqa: E402
    TEXT, ServerDidNotStart, launch_server, metric, save_llama, stop_server, wait_until_serving)


class Server:
    def __init__(self, folder: str, args, *extra: str):
        self.log = tempfile.TemporaryFile()
        device = ["--device", args.device] if args.device else []
        self.proc, self.port = launch_server(folder, self.log, "--tp", str(args.tp), "--max-queue", "1024", *device,
                                             *extra, threads=args.threads)
        try:
            wait_until_serving(self.proc, self.port, self.log, wait_s=180)
        except ServerDidNotStart as e:
            raise SystemExit(str(e)) from None

    def metric(self, name: str) -> float:
        return metric(self.port, name)

    def stop(self) -> None:
        stop_server(self.proc, wait_s=60)


def stream(port, body) -> tuple[float, list[float], int]:
    """(time to first token, inter-token gaps, tokens) of one streamed completion."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    t0 = time.perf_counter()
    times = []
    try:
        conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"content-type": "application/json"})
        for line in conn.getresponse():
            if line.startswith(b"data: {"):
                times.append(time.perf_counter())
    finally:
        conn.close()
    return times[0] - t0, [b - a for a, b in zip(times, times[1:])], len(times)


def workload(args, clients: int) -> list[tuple[str, int]]:
    """(prompt, new tokens) of every request at this concurrency: the same for every mode."""
    rng = random.Random(clients)
    words = TEXT.split()
    out = []
    for _ in range(clients * args.requests_per_client):
        start = rng.randrange(len(words) - args.prompt_words)
        out.append((" ".join(words[start:start + args.prompt_words]), rng.randint(8, args.max_tokens)))
    return out


def load(port: int, model: str, requests: list[tuple[str, int]], clients: int) -> dict:
    """Run `requests` over `clients` closed-loop clients; tokens/s and latency percentiles."""
    jobs = list(enumerate(requests))
    lock = threading.Lock()
    ttft, itl, tokens = [], [], [0]

    def client():
        while True:
            with lock:
                if not jobs:
                    return
                i, (prompt, new) = jobs.pop(0)
            body = dict(model=model, prompt=prompt, max_tokens=new, temperature=0.8, seed=i, stream=True,
                        ignore_eos=True)
            first, gaps, n = stream(port, body)
            with lock:
                ttft.append(first)
                itl.extend(gaps)
                tokens[0] += n

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seconds = time.perf_counter() - t0
    return dict(tokens_per_s=tokens[0] / seconds, ttft=percentiles(ttft), itl=percentiles(itl), tokens=tokens[0])


def percentiles(values: list[float]) -> tuple[float, float, float]:
    if len(values) < 2:
        return (values[0],) * 3 if values else (0.0,) * 3
    q = statistics.quantiles(values, n=100, method="inclusive")
    return q[49], q[89], q[98]


def transformers_generate(folder: str, requests: list[tuple[str, int]], batch: int, threads: int) -> float:
    """Output tokens/s of transformers' generate on one process: the requests in batches, left-padded, greedy."""
    import torch
    import transformers

    torch.set_num_threads(threads)
    tok = transformers.AutoTokenizer.from_pretrained(folder, padding_side="left")
    tok.pad_token = tok.pad_token or tok.eos_token
    model = transformers.AutoModelForCausalLM.from_pretrained(folder).float().eval()
    tokens, t0 = 0, time.perf_counter()
    for i in range(0, len(requests), batch):
        part = requests[i:i + batch]
        enc = tok([p for p, _ in part], return_tensors="pt", padding=True, add_special_tokens=False)
        new = max(n for _, n in part)  # a static batch runs until its longest request is done
        with torch.no_grad():
            model.generate(**enc, do_sample=False, max_new_tokens=new, min_new_tokens=new)
        tokens += sum(n for _, n in part)  # the tokens the requests asked for; the rest is the batch's waste
    return tokens / (time.perf_counter() - t0)


def paged_capacity(folder: str, args, context: int) -> tuple[int, int]:
    """(the most sequences a server whose pool holds 4 full-context sequences runs at once under 64 clients, the
    sequences it preempted); every request must get all its tokens."""
    server = Server(folder, args, "--kv-cache-tokens", str(4 * context), "--max-running", "64")
    most, done = [0], threading.Event()

    def watch():
        while not done.is_set():
            most[0] = max(most[0], int(server.metric("running_sequences")))
            time.sleep(0.01)

    watcher = threading.Thread(target=watch)
    watcher.start()
    requests = workload(args, 64)[:64]
    try:
        result = load(server.port, folder, requests, 64)
        preempted = int(server.metric("preemptions_total"))
    finally:
        done.set()
        watcher.join()
        server.stop()
    if result["tokens"] != sum(n for _, n in requests):
        raise SystemExit(f"the paged run returned {result['tokens']} tokens of {sum(n for _, n in requests)}")
    return most[0], preempted


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", help="a Hugging Face model folder (default: a small random Llama)")
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--device", default=None)
    p.add_argument("--concurrency", default="1,4,16,64")
    p.add_argument("--requests-per-client", type=int, default=2)
    p.add_argument("--prompt-words", type=int, default=12)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank (transformers: tp x this)")
    args = p.parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        folder = args.checkpoint or save_llama(tmp, hidden=args.hidden, layers=args.layers, heads=8, kv_heads=4,
                                               ffn=4 * args.hidden, context=512)
        with open(os.path.join(folder, "config.json")) as f:
            context = json.load(f)["max_position_embeddings"]
        rows = {}
        for mode in ("continuous", "static"):
            server = Server(folder, args, "--batching", mode, "--max-running", str(max(levels)))
            try:
                load(server.port, folder, workload(args, 1)[:2], 1)  # warm-up
                for c in levels:
                    rows[mode, c] = load(server.port, folder, workload(args, c), c)
                    r = rows[mode, c]
                    print(f"{mode:>10} c={c:<3} {r['tokens_per_s']:8.1f} tok/s  ttft p50/p90/p99 "
                          f"{'/'.join(f'{x * 1e3:.0f}' for x in r['ttft'])} ms  itl p50/p90/p99 "
                          f"{'/'.join(f'{x * 1e3:.0f}' for x in r['itl'])} ms", flush=True)
            finally:
                server.stop()
        hf = {c: transformers_generate(folder, workload(args, c), c, args.threads * args.tp) for c in levels}
        for c in levels:
            print(f"transformers generate (1 process, batch {c}): {hf[c]:.1f} tok/s", flush=True)
        most, preempted = paged_capacity(folder, args, context)
        print(f"paged pool of 4 x {context} tokens: at most {most} sequences at once (preallocated: 4), "
              f"{preempted} preemptions, every token delivered")
    top = 16 if 16 in levels else levels[-1]
    base = rows["continuous", levels[0]]["tokens_per_s"]
    print(f"c{top}/c{levels[0]}={rows['continuous', top]['tokens_per_s'] / base:.2f} "
          f"continuous/static@{top}={rows['continuous', top]['tokens_per_s'] / rows['static', top]['tokens_per_s']:.2f} "
          f"continuous/transformers@{top}={rows['continuous', top]['tokens_per_s'] / hf[top]:.2f} "
          f"paged/preallocated={most}/4")


if __name__ == "__main__":
    main()
