"""`tensorpar serve` checked by real clients: one server (TP 2, two local ranks) for the module, talked to with the
`openai` client, raw HTTP and lm-eval's `local-completions` model, against transformers, `tensorpar generate` and
lm-eval's `hf` model on the same Hugging Face folder. Its last test stops it with SIGTERM."""

import collections
import http.client
import json
import signal
import sys
import threading
import time

import pytest
import torch

openai = pytest.importorskip("openai")
transformers = pytest.importorskip("transformers")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")


from harness import run_cli  # noqa: E402
from serving_model import http_json, launch_server, metric, save_llama, stop_server, wait_until_serving  # noqa: E402

PROMPTS = ["The quick brown fox", "Question: what is two plus"]
NEW = 12
QUEUE = 70  # --max-queue: sequences waiting at most


class Served:
    def __init__(self, folder, port, proc, log):
        self.folder, self.port, self.proc, self.log = folder, port, proc, log
        self.url = f"http://127.0.0.1:{port}"
        self.client = openai.OpenAI(base_url=f"{self.url}/v1", api_key="none", max_retries=0, timeout=60)
        self.hf = transformers.AutoModelForCausalLM.from_pretrained(folder).float().eval()
        self.tok = transformers.AutoTokenizer.from_pretrained(folder)

    def request(self, method, path, body=None) -> tuple[int, str]:
        """(status, body text) of one plain HTTP request."""
        return http_json(self.port, method, path, body)

    def metric(self, name) -> float:
        return metric(self.port, name)

    def hf_greedy(self, ids, new=NEW) -> list[int]:
        ids = torch.tensor([ids])
        with torch.no_grad():
            out = self.hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=new)
        return out[0, ids.shape[1]:].tolist()


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return save_llama(tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="module")
def served(folder, tmp_path_factory):
    log = open(tmp_path_factory.mktemp("log") / "serve.log", "w+")
    proc, port = launch_server(folder, log, "--tp", "2", "--max-queue", str(QUEUE), "--token-budget", "256",
                               "--block-size", "8")
    served = Served(folder, port, proc, log)  # transformers loads the reference while the ranks start
    wait_until_serving(proc, port, log)
    yield served
    stop_server(proc)
    log.close()


# -- refused before any rank starts -------------------------------------------------------------------------------


@pytest.mark.parametrize("flags,needle", [
    (["--pp", "2"], "drop --pp"),
    (["--sequence-parallel"], "drop --sequence-parallel"),
    (["--kv-cache-tokens", "100"], "give at least 256"),
    (["--port", "70000"], "--port must be in [0, 65535]"),
    (["--max-running", "0"], "--max-running must be at least 1"),
    (["--max-queue", "0"], "--max-queue must be at least 1"),
])
def test_bad_options_are_refused_in_one_line(cli, folder, flags, needle):
    code, _, err = cli("serve", "--checkpoint", folder, "--tp", "2", *flags)
    assert code == 2 and needle in err and len(err.strip().splitlines()) == 1, err


def test_a_port_another_process_listens_on_is_refused_before_the_model_loads(cli, folder):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code, _, err = cli("serve", "--checkpoint", folder, "--tp", "2", "--port", str(port))
    assert code == 2 and err.strip() == (f"tensorpar: error: --host 127.0.0.1 --port {port}: cannot serve there "
                                         f"(another process listens on it)"), err


def test_without_the_serve_extra_the_install_line(cli, folder, monkeypatch):
    monkeypatch.setitem(sys.modules, "uvicorn", None)  # as if not installed
    code, _, err = cli("serve", "--checkpoint", folder)
    assert code == 2 and "pip install 'tensorpar[serve]'" in err and "uvicorn" in err, err


# -- what is generated -------------------------------------------------------------------------------------------


def _generate_cli(pools, folder, prompts, *flags) -> list[str]:
    """`tensorpar generate --json` at TP 2 (on the test pool's ranks): rank 0's text of each prompt."""
    argv = ["generate", "--checkpoint", folder, "--tp", "2", "--max-new-tokens", NEW, "--json", *flags]
    for prompt in prompts:
        argv += ["--prompt", prompt]
    code, out, err = pools(2).run(run_cli, argv)[0]
    assert code == 0, err
    return [json.loads(line)["text"] for line in out.splitlines()]


def test_greedy_completions_equal_transformers_and_generate(served, pools):
    expected = [served.tok.decode(served.hf_greedy(served.tok(p, add_special_tokens=False).input_ids),
                                  skip_special_tokens=True) for p in PROMPTS]
    whole = served.client.completions.create(model=served.folder, prompt=PROMPTS, max_tokens=NEW, temperature=0)
    assert [c.text for c in sorted(whole.choices, key=lambda c: c.index)] == expected
    assert whole.usage.completion_tokens > 0 and whole.choices[0].finish_reason in ("length", "stop")
    for prompt, text in zip(PROMPTS, expected):
        stream = served.client.completions.create(model=served.folder, prompt=prompt, max_tokens=NEW, temperature=0,
                                                  stream=True)
        chunks = list(stream)
        assert "".join(c.choices[0].text for c in chunks) == text and chunks[-1].choices[0].finish_reason
    assert _generate_cli(pools, served.folder, PROMPTS, "--greedy") == expected
    stop = expected[0][4:7]  # the continuation ends before a stop string, which is not returned
    out = served.client.completions.create(model=served.folder, prompt=PROMPTS[0], max_tokens=NEW, temperature=0,
                                           stop=[stop, "never"])
    assert out.choices[0].text == expected[0][: expected[0].find(stop)] and out.choices[0].finish_reason == "stop"


def test_chat_equals_transformers(served):
    messages = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "What is two plus two?"}]
    text = served.tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    expected = served.tok.decode(served.hf_greedy(served.tok(text, add_special_tokens=False).input_ids),
                                 skip_special_tokens=True)
    whole = served.client.chat.completions.create(model=served.folder, messages=messages, max_tokens=NEW,
                                                  temperature=0)
    assert whole.choices[0].message.content == expected and whole.choices[0].message.role == "assistant"
    chunks = list(served.client.chat.completions.create(model=served.folder, messages=messages, max_tokens=NEW,
                                                        temperature=0, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[-1].choices[0].finish_reason
    # vLLM's /tokenize and /detokenize: the ids the request above was given, and back
    code, body = served.request("POST", "/tokenize", {"model": served.folder, "messages": messages})
    ids = served.tok(text, add_special_tokens=False).input_ids
    assert code == 200 and json.loads(body)["tokens"] == ids, body
    assert served.request("POST", "/detokenize", {"tokens": ids}) == (200, json.dumps({"prompt": text},
                                                                                      separators=(",", ":")))


def test_a_shared_system_prompt_is_computed_once(served):
    """Prefix caching: the second conversation starts from the first one's cached blocks (block size 8) of their
    common tokens, answers as transformers does, and says how many prompt tokens it found cached."""
    system = {"role": "system", "content": "You split attention heads and feed-forward neurons across ranks. " * 3}
    hits = served.metric("prefix_cache_hits_total")
    ids, cached = [], []
    for question in ("What is two plus two?", "What is the capital of France?"):
        messages = [system, {"role": "user", "content": question}]
        text = served.tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        ids.append(served.tok(text, add_special_tokens=False).input_ids)
        expected = served.tok.decode(served.hf_greedy(ids[-1]), skip_special_tokens=True)
        out = served.client.chat.completions.create(model=served.folder, messages=messages, max_tokens=NEW,
                                                    temperature=0)
        assert out.choices[0].message.content == expected
        cached.append(out.usage.prompt_tokens_details.cached_tokens)
    common = next(i for i, (a, b) in enumerate(zip(*ids)) if a != b)
    # the first finds at most the template's opening block ("<|system|>" is 10 tokens of this small vocabulary),
    # cached by any chat before it
    assert common >= 24 and cached[0] in (0, 8) and cached[1] == min(common, len(ids[1]) - 1) // 8 * 8, cached
    assert served.metric("prefix_cache_hits_total") - hits == sum(cached)
    chunks = list(served.client.chat.completions.create(model=served.folder, messages=messages, max_tokens=NEW,
                                                        temperature=0, stream=True,
                                                        stream_options={"include_usage": True}))
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == (len(ids[1]) - 1) // 8 * 8  # all it may find


def test_logprobs_equal_the_models_log_softmax(served):
    """echo + logprobs: the prompt's tokens and the greedy continuation's, with their top 5, as log_softmax."""
    ids = served.tok(PROMPTS[1], add_special_tokens=False).input_ids
    new = served.hf_greedy(ids, 4)
    out = served.client.completions.create(model=served.folder, prompt=ids, max_tokens=len(new), temperature=0,
                                           echo=True, logprobs=5, extra_body={"ignore_eos": True})
    lp = out.choices[0].logprobs
    full = ids + new
    with torch.no_grad():
        reference = torch.log_softmax(served.hf(torch.tensor([full])).logits[0].double(), dim=-1)
    assert lp.token_logprobs[0] is None and len(lp.token_logprobs) == len(full)
    for p in range(1, len(full)):
        assert abs(lp.token_logprobs[p] - reference[p - 1, full[p]].item()) <= 1e-5, p
        # Keyed by token text, as OpenAI's: tokens with the same text (partial UTF-8 bytes) share one entry.
        ref_top = reference[p - 1].topk(6).values.tolist()
        assert abs(max(lp.top_logprobs[p].values()) - ref_top[0]) <= 1e-5, p
        assert all(min(abs(v - r) for r in ref_top + [lp.token_logprobs[p]]) <= 1e-5
                   for v in lp.top_logprobs[p].values()), p
    zero = served.client.completions.create(model=served.folder, prompt=ids, max_tokens=0, echo=True, logprobs=1)
    assert zero.choices[0].logprobs.token_logprobs == lp.token_logprobs[: len(ids)]
    assert zero.usage.completion_tokens == 0


def test_seeded_sampling_depends_on_the_seed_alone(served, pools):
    body = dict(model=served.folder, prompt=PROMPTS[0], max_tokens=NEW, temperature=0.8, top_p=0.9, seed=123,
                extra_body={"ignore_eos": True})
    alone = served.client.completions.create(**body).choices[0].text
    results = {}

    def call(name, **kw):
        results[name] = served.client.completions.create(**{**body, **kw}).choices[0].text

    threads = [threading.Thread(target=call, args=("again",))]
    threads += [threading.Thread(target=call, args=(f"other{i}",), kwargs=dict(prompt=PROMPTS[1], seed=i))
                for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results["again"] == alone  # in a batch with others: the same tokens
    batch = served.client.completions.create(**{**body, "prompt": [PROMPTS[1], PROMPTS[0]]}).choices
    assert batch[1].text == alone  # the second prompt of one request too: every prompt as if alone
    assert served.client.completions.create(**{**body, "seed": 124}).choices[0].text != alone
    assert _generate_cli(pools, served.folder, PROMPTS[:1], "--temperature", "0.8", "--top-p", "0.9", "--seed", "123",
                         "--ignore-eos") == [alone]


def _penalized_greedy(hf, ids, new, presence, frequency):
    """Greedy decoding with OpenAI's penalties written out: logit[j] -= frequency * count[j] + presence * (count > 0)
    over the continuation's tokens."""
    out, counts = [], collections.Counter()
    for _ in range(new):
        with torch.no_grad():
            logits = hf(torch.tensor([ids + out])).logits[0, -1].double()
        for token, count in counts.items():
            logits[token] -= frequency * count + presence
        out.append(int(logits.argmax()))
        counts[out[-1]] += 1
    return out


def test_penalties_min_tokens_stop_tokens_and_min_p_equal_their_definitions(served, pools):
    """vLLM's sampling fields beyond OpenAI's, at TP 2 (each rank penalizes its own half of the vocabulary):
    repetition_penalty and min_tokens against transformers' generate, presence and frequency penalties against
    their formula, min_p = 1 sampling the most likely token."""
    ids = served.tok(PROMPTS[0], add_special_tokens=False).input_ids
    body = dict(model=served.folder, prompt=ids, max_tokens=NEW, temperature=0, extra_body={"ignore_eos": True})

    def complete(**extra):
        return served.client.completions.create(**{**body, "extra_body": {**body["extra_body"], **extra}}).choices[0]

    def hf_generate(**kw):
        with torch.no_grad():
            out = served.hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                     do_sample=False, max_new_tokens=NEW, **kw)
        return out[0, len(ids):].tolist()

    def text(token_ids):
        return served.tok.decode(token_ids, skip_special_tokens=True)

    plain = served.hf_greedy(ids)
    repeated = hf_generate(repetition_penalty=1.5)
    assert repeated != plain  # the penalty changes this continuation: a comparison that can fail
    assert complete(repetition_penalty=1.5).text == text(repeated)
    penalized = _penalized_greedy(served.hf, ids, NEW, presence=0.8, frequency=1.5)
    assert penalized != plain
    assert complete(presence_penalty=0.8, frequency_penalty=1.5).text == text(penalized)
    for flags, expected in ((["--repetition-penalty", "1.5"], repeated),
                            (["--presence-penalty", "0.8", "--frequency-penalty", "1.5"], penalized)):
        assert _generate_cli(pools, served.folder, PROMPTS[:1], "--greedy", "--ignore-eos", *flags) == [text(expected)]

    # The greedy continuation's second token as a stop token: it ends the completion there, unless min_tokens holds
    # it back (here it comes again after the third token); as in vLLM, a stop token that is not a special token is
    # part of the text.
    stop = plain[1]
    stopped = complete(stop_token_ids=[stop])
    assert stopped.text == text(plain[:2]) and stopped.finish_reason == "stop"
    later = hf_generate(min_new_tokens=3, eos_token_id=[stop])
    assert later[-1] == stop and len(later) > 3 and stop not in later[:3]  # the case this checks
    held = complete(stop_token_ids=[stop], min_tokens=3)
    assert held.text == text(later) and held.finish_reason == "stop"

    sampled = dict(temperature=2.0, seed=5, max_tokens=NEW)
    hot = served.client.completions.create(**{**body, **sampled}).choices[0].text
    only_top = served.client.completions.create(**{**body, **sampled, "extra_body": {"ignore_eos": True,
                                                                                       "min_p": 1.0}})
    assert hot != only_top.choices[0].text == text(plain)


# -- lm-eval -----------------------------------------------------------------------------------------------------

MC_DOCS = [
    {"question": "The capital of France is", "choices": ["Paris", "Rome", "the dog"], "answer": 0},
    {"question": "The quick brown fox jumps over the", "choices": ["lazy dog", "capital", "Italy"], "answer": 0},
    {"question": "Question: what is two plus two? Answer:", "choices": ["four", "Paris", "brown"], "answer": 0},
    {"question": "A tensor-parallel model splits its", "choices": ["attention heads", "fox", "Rome"], "answer": 0},
]


def _task_dir(tmp_path):
    data = tmp_path / "mc.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in MC_DOCS))
    (tmp_path / "tiny_mc.yaml").write_text(
        "task: tiny_mc\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
        f"    test: {data}\ntest_split: test\noutput_type: multiple_choice\n"
        "doc_to_text: '{{question}}'\ndoc_to_choice: '{{choices}}'\ndoc_to_target: '{{answer}}'\n"
        "metric_list:\n  - metric: acc\n")
    return str(tmp_path)


def test_lm_eval_local_completions_equals_its_hf_model(served, tmp_path):
    lm_eval = pytest.importorskip("lm_eval")
    from lm_eval.tasks import TaskManager

    tasks = TaskManager(include_path=_task_dir(tmp_path), include_defaults=False)  # not lm-eval's thousands
    runs = {}
    for name, args in (("local-completions", dict(model=served.folder, base_url=f"{served.url}/v1/completions",
                                                  tokenizer_backend="huggingface", max_retries=1)),
                       ("hf", dict(pretrained=served.folder, dtype="float32", device="cpu"))):
        runs[name] = lm_eval.simple_evaluate(model=name, model_args=args, tasks=["tiny_mc"], task_manager=tasks,
                                             log_samples=True, batch_size=1, random_seed=0, bootstrap_iters=0)
    served_lls, hf_lls = ([[r[0][0] for r in s["resps"]] for s in sorted(run["samples"]["tiny_mc"],
                                                                           key=lambda s: s["doc_id"])]
                          for run in (runs["local-completions"], runs["hf"]))
    assert len(served_lls) == len(MC_DOCS) and all(len(x) == 3 for x in served_lls)
    assert max(abs(a - b) for x, y in zip(served_lls, hf_lls) for a, b in zip(x, y)) <= 1e-4
    assert runs["local-completions"]["results"]["tiny_mc"]["acc,none"] == runs["hf"]["results"]["tiny_mc"]["acc,none"]


# -- load, bad input, shutdown -----------------------------------------------------------------------------------


def _stream_client(port, body, stop_after, out, i):
    """POST a streamed completion and read it: to [DONE], or close the connection after `stop_after` events."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    try:
        conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"content-type": "application/json"})
        response = conn.getresponse()
        events, finish = 0, None
        for line in response:
            line = line.decode().strip()
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                out[i] = ("done", events, finish)
                return
            events += 1
            finish = json.loads(line[6:])["choices"][0]["finish_reason"] or finish
            if stop_after is not None and events >= stop_after:
                out[i] = ("left", events, None)
                return  # closing the connection mid-stream
        out[i] = ("cut", events, finish)
    finally:
        conn.close()


def test_64_streaming_clients_some_leaving(served):
    """Every client that stays gets its whole answer; those that leave free their blocks: the pool ends empty."""
    clients, new = 64, 24
    out = [None] * clients
    threads = []
    for i in range(clients):
        body = dict(model=served.folder, prompt=PROMPTS[i % 2] + " " * (i % 5), max_tokens=new, temperature=0.7,
                    seed=i, stream=True, ignore_eos=True)
        stop_after = 3 if i % 4 == 3 else None
        threads.append(threading.Thread(target=_stream_client, args=(served.port, body, stop_after, out, i)))
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    stayed = [o for i, o in enumerate(out) if i % 4 != 3]
    assert all(o == ("done", new, "length") for o in stayed), [o for o in stayed if o != ("done", new, "length")]
    assert all(o is not None and o[0] in ("left", "done") for o in out)
    deadline = time.monotonic() + 10
    while (served.metric("kv_blocks_used"), served.metric("running_sequences")) != (0, 0):
        assert time.monotonic() < deadline, "the KV pool did not empty"
        time.sleep(0.1)
    assert served.metric("queue_length") == 0 and served.metric('requests_total{outcome="cancelled"}') >= 1
    again = served.client.completions.create(model=served.folder, prompt=PROMPTS[0], max_tokens=3, temperature=0)
    assert again.choices[0].finish_reason


BAD = [  # (body, HTTP status, the error's param, a word of its message)
    (b"{not json", 400, None, "JSON"),
    ({"model": None, "prompt": "hi"}, 400, "model", "required"),  # model None: the field left out
    ({"model": "other", "prompt": "hi"}, 404, "model", "does not exist"),
    ({"prompt": "hi", "max_tokens": -1}, 400, "max_tokens", "at least 0"),
    ({"prompt": "hi", "max_tokens": "ten"}, 400, "max_tokens", "integer"),
    ({"prompt": "hi", "temperature": 3}, 400, "temperature", "[0.0, 2.0]"),
    ({"prompt": [], "max_tokens": 1}, 400, "prompt", "prompt"),
    ({"prompt": [5, 100000]}, 400, "prompt", "vocabulary"),
    ({"prompt": "word " * 400, "max_tokens": 10}, 400, "max_tokens", "maximum context length"),
    ({"prompt": "hi", "frequency_penalty": 2.5}, 400, "frequency_penalty", "[-2.0, 2.0]"),
    ({"prompt": "hi", "logit_bias": {"5": 1}}, 400, "logit_bias", "not supported"),
    ({"prompt": "hi", "max_tokens": 2, "min_tokens": 3}, 400, "min_tokens", "at most max_tokens"),
    ({"prompt": "hi", "stop_token_ids": [10 ** 6]}, 400, "stop_token_ids", "vocabulary"),
    ({"prompt": "hi", "logprobs": 99}, 400, "logprobs", "[0, 20]"),
    # 80 sequences, more than the queue of 70 ever holds: no retry helps (a full queue's 429: tests/test_scheduler.py)
    ({"prompt": ["a", "b", "c", "d", "e"], "n": 16, "max_tokens": 1}, 400, "n", "more than the server queues at once"),
]


def test_bad_requests_get_their_error_and_the_server_keeps_serving(served):
    for body, status, param, word in BAD:
        if isinstance(body, dict):
            body = {k: v for k, v in {"model": served.folder, **body}.items() if v is not None}
        code, text = served.request("POST", "/v1/completions", body)
        assert code == status, (body, code, text)
        error = json.loads(text)["error"]
        assert error["param"] == param and word in error["message"] and error["type"], (body, error)
    code, text = served.request("POST", "/v1/chat/completions", {"model": served.folder, "messages": "hi"})
    assert code == 400 and json.loads(text)["error"]["param"] == "messages"
    with pytest.raises(openai.BadRequestError, match="at least 0"):
        served.client.completions.create(model=served.folder, prompt="hi", max_tokens=-1)
    models = served.client.models.list()
    assert [m.id for m in models.data] == [served.folder]
    assert served.request("GET", "/health") == (200, '{"status":"ok"}')
    assert served.client.completions.create(model=served.folder, prompt="hi", max_tokens=2, temperature=0).choices


def _children(pid) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(c) for c in f.read().split()]


def _alive(pid) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_sigterm_drains_in_flight_requests_and_stops_every_rank(served):
    """Last in this module: it stops the server."""
    ranks = _children(served.proc.pid)
    assert len(ranks) == 2
    out = [None]
    body = dict(model=served.folder, prompt=PROMPTS[0], max_tokens=40, temperature=0, stream=True, ignore_eos=True)
    client = threading.Thread(target=_stream_client, args=(served.port, body, None, out, 0))
    client.start()
    deadline = time.monotonic() + 30
    while served.metric("running_sequences") == 0:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    served.proc.send_signal(signal.SIGTERM)
    assert served.proc.wait(60) == 0
    client.join(10)
    assert out[0] == ("done", 40, "length")  # the request in flight got its whole answer
    assert not any(_alive(pid) for pid in ranks)
