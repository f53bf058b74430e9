"""`tensorpar serve` of a Phi-3 model with longrope (original length 8) against transformers' greedy `generate`:
a prompt shorter than the original length that generates past it (transformers recomputes its cache there; the
server recomputes the sequence), one of exactly that length (recomputed at its first new token), one already longer
(the long factors from its first token, over every chunk of its prefill), one that never reaches it; each alone and
all four in one batch, every prompt prefilled in chunks of a 5-token budget, the batch in a pool of one context (32
tokens), which preempts some of them. One server (TP 1) for the module."""

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from serving_model import http_json, metric, save_phi3_longrope, start_server, stop_server  # noqa: E402

ORIGINAL = 8
# (prompt, new tokens): crosses the original length while generating; starts at it; starts past it; stays short
CASES = [([5, 17, 42, 8, 9], 10), ([1, 2, 3, 4, 5, 6, 7, 8], 5), ([60, 3, 71, 14, 22, 9, 30, 41, 2, 88, 13, 6, 50], 6),
         ([33, 4, 91], 4)]
CROSSING = 2  # of CASES: the first two have short-factor keys cached when they pass the original length


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    folder = save_phi3_longrope(tmp_path_factory.mktemp("phi3"), original=ORIGINAL)
    log = open(tmp_path_factory.mktemp("log") / "serve.log", "w+")
    proc, port = start_server(folder, log, "--token-budget", "5", "--block-size", "4",
                               "--kv-cache-tokens", "32", "--max-running", "4", "--served-model-name", "phi3")
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder).float().eval()
    yield port, hf
    stop_server(proc)
    log.close()


def _hf_greedy(hf, prompt: list[int], new: int) -> tuple[list[int], list[float]]:
    """transformers' greedy continuation of `prompt` alone: (token ids, the log-prob of each)."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=new,
                          output_logits=True, return_dict_in_generate=True)
    tokens = out.sequences[0, len(prompt):]
    logprobs = torch.stack(out.logits)[:, 0].log_softmax(-1).gather(-1, tokens[:, None])[:, 0]
    return tokens.tolist(), logprobs.tolist()


def _completions(port: int, prompts: list[list[int]], new: int) -> list[tuple[list[int], list[float]]]:
    """The server's greedy continuation of every prompt (one request): (token ids, their log-probs); the word of
    token i is "w<i>"."""
    status, text = http_json(port, "POST", "/v1/completions", {"model": "phi3", "prompt": prompts,
                                                                "max_tokens": new, "temperature": 0, "logprobs": 0})
    assert status == 200, text
    choices = sorted(json.loads(text)["choices"], key=lambda c: c["index"])
    return [([int(w[1:]) for w in c["text"].split()], c["logprobs"]["token_logprobs"]) for c in choices]


def _check(got: list[tuple[list[int], list[float]]], expected: list[tuple[list[int], list[float]]]) -> None:
    """The same tokens, and log-probs within float32 rounding."""
    assert [tokens for tokens, _ in got] == [tokens for tokens, _ in expected]
    for (_, lp), (_, hf_lp) in zip(got, expected):
        assert torch.allclose(torch.tensor(lp), torch.tensor(hf_lp), atol=1e-4), (lp, hf_lp)


def test_longrope_greedy_equals_transformers_alone_and_batched(served):
    port, hf = served
    expected = [_hf_greedy(hf, prompt, new) for prompt, new in CASES]
    _check([_completions(port, [prompt], new)[0] for prompt, new in CASES], expected)
    assert metric(port, "rope_recomputes_total") == CROSSING
    assert metric(port, "preemptions_total") == 0  # a recompute at the switch is not a preemption for memory
    longest = max(new for _, new in CASES)
    _check(_completions(port, [prompt for prompt, _ in CASES], longest),
           [_hf_greedy(hf, prompt, longest) for prompt, _ in CASES])
    assert metric(port, "rope_recomputes_total") > CROSSING and metric(port, "preemptions_total") > 0
