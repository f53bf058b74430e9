"""`tensorpar serve` with and without prefix caching on requests that share a long system prompt: time to first token,
output tokens/s, and the prompt tokens found cached.

    python bench/prefix_cache.py [--checkpoint HF_FOLDER] [--tp 2] [--system-words 300] [--clients 4]

Every request is the same system text (--system-words words of the folder's text) and a question of its own (12
words at a random place), answered in 8 to --max-tokens tokens (EOS ignored), streamed by closed-loop clients; the
same requests go to a server started with --no-prefix-caching and to one with it (the default). Without
--checkpoint it saves the small random Llama of bench/serve.py. The last line holds the ratios:

    ttft_p50 off/on=X.XX tokens/s on/off=Y.YY cached=Z% of prompt tokens
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from serve import Server, load  # noqa: E402
from serving_model import TEXT, save_llama  # noqa: E402  (bench/serve.py puts tests/ on the path)


def workload(args) -> list[tuple[str, int]]:
    rng = random.Random(0)
    words = (TEXT * (1 + args.system_words // len(TEXT.split()))).split()
    system = " ".join(words[:args.system_words])
    out = []
    for _ in range(args.clients * args.requests_per_client):
        start = rng.randrange(len(words) - 12)
        out.append((f"{system}\nQuestion: {' '.join(words[start:start + 12])}", rng.randint(8, args.max_tokens)))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", help="a Hugging Face model folder (default: a small random Llama)")
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--device", default=None)
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--requests-per-client", type=int, default=4)
    p.add_argument("--system-words", type=int, default=300)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    args = p.parse_args()
    requests = workload(args)
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        folder = args.checkpoint or save_llama(tmp, hidden=args.hidden, layers=args.layers, heads=8, kv_heads=4,
                                               ffn=4 * args.hidden, context=args.context)
        for mode, flags in (("off", ["--no-prefix-caching"]), ("on", [])):
            server = Server(folder, args, *flags)
            try:
                load(server.port, folder, requests[:1], 1)  # warm-up (and, with caching, the system prompt cached)
                queried = server.metric("prefix_cache_queries_total")
                hits = server.metric("prefix_cache_hits_total")
                r = load(server.port, folder, requests, args.clients)
                r["cached"] = (server.metric("prefix_cache_hits_total") - hits) / max(
                    1.0, server.metric("prefix_cache_queries_total") - queried)
            finally:
                server.stop()
            rows[mode] = r
            print(f"prefix caching {mode:>3}: {r['tokens_per_s']:8.1f} tok/s  ttft p50/p90/p99 "
                  f"{'/'.join(f'{x * 1e3:.0f}' for x in r['ttft'])} ms  itl p50 {r['itl'][0] * 1e3:.0f} ms  "
                  f"cached {100 * r['cached']:.0f}% of prompt tokens", flush=True)
    on, off = rows["on"], rows["off"]
    print(f"ttft_p50 off/on={off['ttft'][0] / on['ttft'][0]:.2f} tokens/s on/off="
          f"{on['tokens_per_s'] / off['tokens_per_s']:.2f} cached={100 * on['cached']:.0f}% of prompt tokens")


if __name__ == "__main__":
    main()
