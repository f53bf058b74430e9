"""A small Llama saved by transformers with a real tokenizer and a chat template: what the serving tests and
bench/serve.py serve, and what transformers and lm-eval's `hf` model read back. Built locally, nothing downloaded."""

from __future__ import annotations

import torch

TEXT = ("The quick brown fox jumps over the lazy dog. A tensor-parallel model splits its attention heads and its "
        "feed-forward neurons across ranks; every rank holds a shard of the weights. Question: what is two plus "
        "two? Answer: four. The capital of France is Paris, and the capital of Italy is Rome. ")
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def build_tokenizer(vocab_size: int = 400):
    """A byte-level BPE tokenizer trained on TEXT, as transformers' PreTrainedTokenizerFast."""
    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = tokenizers.Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([TEXT * 4], trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def save_llama(folder, *, seed: int = 7, hidden: int = 64, layers: int = 2, heads: int = 4, kv_heads: int = 2,
               ffn: int = 128, context: int = 256) -> str:
    """Save the model and its tokenizer in `folder`; the vocabulary is the tokenizer's, made odd (it does not divide
    by the TP size: the last shard is padded)."""
    import transformers

    tokenizer = build_tokenizer()
    vocab = len(tokenizer) + (1 - len(tokenizer) % 2)
    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn,
                                      num_hidden_layers=layers, num_attention_heads=heads,
                                      num_key_value_heads=kv_heads, max_position_embeddings=context,
                                      bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                                      tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config).float().eval()
    with torch.no_grad():
        for p in model.parameters():  # away from HF's zero biases and unit norms; a wider spread of logits
            p.add_(torch.randn_like(p) * 0.05)
        model.lm_head.weight.mul_(8.0)
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    return str(folder)


def word_tokenizer(vocab_size: int):
    """A word-level tokenizer whose token i is the word "w<i>": a text decodes back to its token ids exactly (a
    random model's bytes would not)."""
    import tokenizers
    from tokenizers import models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = tokenizers.Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab_size)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok)  # no special tokens: decoding skips none


def save_phi3_longrope(folder, *, original: int = 8, context: int = 32, seed: int = 11) -> str:
    """A small random Phi-3 with longrope (short factors up to `original` tokens, long ones far apart from them),
    partial rotary and a window as tests/family_models.py builds it (a window of 12: wide enough that what the first
    tokens' keys carry reaches the last), and a word-level tokenizer; no EOS (every continuation runs its length)."""
    import transformers

    vocab = 97
    config = transformers.Phi3Config(
        vocab_size=vocab, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=context, original_max_position_embeddings=original,
        sliding_window=12, partial_rotary_factor=0.5, bos_token_id=None, eos_token_id=None, pad_token_id=None,
        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0, 1.2, 1.5, 2.0],
                         "long_factor": [3.0, 5.0, 8.0, 12.0], "partial_rotary_factor": 0.5})
    torch.manual_seed(seed)
    model = transformers.Phi3ForCausalLM(config).float().eval()
    with torch.no_grad():
        for p in model.parameters():  # away from zero biases and unit norms; a wider spread of logits
            p.add_(torch.randn_like(p) * 0.1)
        model.lm_head.weight.mul_(4.0)
    model.save_pretrained(folder, safe_serialization=True)
    word_tokenizer(vocab).save_pretrained(folder)
    return str(folder)


def http_json(port: int, method: str, path: str, body=None, timeout: float = 60) -> tuple[int, str]:
    """(status, body text) of one plain HTTP request to a local server: `body`, if any, sent as JSON, or as it is when
    it is already bytes or text (a malformed request)."""
    import http.client
    import json

    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        data = body if body is None or isinstance(body, (bytes, str)) else json.dumps(body)
        conn.request(method, path, body=data, headers={"content-type": "application/json"})
        response = conn.getresponse()
        return response.status, response.read().decode()
    finally:
        conn.close()


def metric(port: int, name: str) -> float:
    """The value of the server's Prometheus metric tensorpar_serve_<name> (labels included in `name`)."""
    text = http_json(port, "GET", "/metrics")[1]
    return float(next(line.split()[-1] for line in text.splitlines() if line.startswith(f"tensorpar_serve_{name} ")))


class ServerDidNotStart(RuntimeError):
    """The server exited, or did not answer /health in time: the message holds its output."""


def launch_server(folder: str, log, *flags: str, threads: int = 1):
    """Start `tensorpar serve --checkpoint folder *flags` on a free port, its output to the open file `log`, without
    waiting for it: (process, port)."""
    import os
    import subprocess
    import sys

    from tensorpar.distributed.launch import free_port

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "tensorpar", "serve", "--checkpoint", folder, "--port", str(port),
                             *flags], env=dict(os.environ, OMP_NUM_THREADS=str(threads)), stdout=log,
                            stderr=subprocess.STDOUT)
    return proc, port


def wait_until_serving(proc, port: int, log, wait_s: float = 90) -> None:
    """Return once the server answers /health; ServerDidNotStart (the process killed, its output in the message)
    when it exits first or `wait_s` pass."""
    import time

    deadline = time.monotonic() + wait_s
    while True:
        try:
            if http_json(port, "GET", "/health", timeout=1)[0] == 200:
                return
        except OSError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            log.seek(0)
            out = log.read()
            raise ServerDidNotStart(f"the server did not start:\n{out.decode() if isinstance(out, bytes) else out}")
        time.sleep(0.2)


def start_server(folder: str, log, *flags: str, wait_s: float = 90):
    """`launch_server`, then `wait_until_serving`: (process, port) of a server that answers."""
    proc, port = launch_server(folder, log, *flags)
    wait_until_serving(proc, port, log, wait_s)
    return proc, port


def stop_server(proc, wait_s: float = 30) -> None:
    """SIGTERM (the server drains), then kill if it has not stopped within `wait_s`."""
    import signal
    import subprocess

    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(wait_s)
        except subprocess.TimeoutExpired:
            proc.kill()
