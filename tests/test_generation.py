"""`tensorpar generate`: the KV-cache path computes the uncached logits, greedy decoding is transformers' at every
TP size, batches equal prompts alone, sampling is seeded, identical across TP sizes and keeps transformers' top-k /
top-p sets, and the command line checks its input before starting any rank."""

import json
import types

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper  # noqa: E402

from tensorpar.layers.micro_batch import MicroBatchContext
from tensorpar.models.placement import Placement
from tensorpar.checkpoints.sources import load_model_source  # noqa: E402
from tensorpar.cli import main  # noqa: E402
from tensorpar.distributed.comm import Group  # noqa: E402
from tensorpar.errors import TensorparError  # noqa: E402
from tensorpar.inference.generation import generate, keep_threshold, select_tokens  # noqa: E402
from tensorpar.inference.kv_cache import KVCache  # noqa: E402
from tensorpar.models import Transformer, load_full_state_dict  # noqa: E402

from harness import mesh  # noqa: E402
from test_cli import tensorpar  # noqa: E402
from test_hf import HF_CONFIGS, _hf_model  # noqa: E402

NEW = 12
PROMPTS = [[5, 17, 400, 999, 3, 250, 42], [611, 7, 88]]  # different lengths: the second is left-padded in a batch
SAMPLING = dict(greedy=False, temperature=0.8, top_k=50, top_p=0.9)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """name -> (folder, transformers' greedy new ids per prompt, its EOS id) for a GPT-2 with vocab 1001 (padded at
    TP 2 and 4) and a Llama with one KV head (replicated at TP 2 and 4)."""
    out = {}
    for name in ("gpt2", "llama"):
        torch.manual_seed(11)
        model = _hf_model(HF_CONFIGS[name]())
        folder = tmp_path_factory.mktemp(name)
        model.save_pretrained(folder, safe_serialization=True)
        expected = []
        for prompt in PROMPTS:
            ids = torch.tensor([prompt])
            with torch.no_grad():
                out_ids = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=NEW)
            expected.append(out_ids[0, len(prompt):].tolist())
        out[name] = (folder, expected, model.generation_config.eos_token_id)
    return out


def _load(folder, m=None):
    cfg, state = load_model_source(str(folder))
    model = Transformer(cfg, m, init=False)
    load_full_state_dict(model, state, "test")
    return model.eval()


# -- the cached path computes the uncached logits ----------------------------------------------------------------


def check_cached_logits(tp, folder):
    """Largest |cached - uncached| logit over: prefill, a 3-token chunk, single tokens, and a left-padded batch."""
    model = _load(folder, mesh(tp) if tp > 1 else None)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 1001, (2, 10), generator=g)
    errors = []
    with torch.no_grad():
        full = model(ids)  # [2, 10, V_local]
        cache = KVCache.for_model(model, 2, 10)
        errors.append((model.forward_cached(ids[:, :4], cache) - full[:, 3]).abs().max())  # prefill: is_causal
        errors.append((model.forward_cached(ids[:, 4:7], cache) - full[:, 6]).abs().max())  # chunk: explicit mask
        for t in range(7, 10):  # one token: attends to everything
            errors.append((model.forward_cached(ids[:, t:t + 1], cache, start_pos=t) - full[:, t]).abs().max())
        assert cache.length == 10

        # Row 0 is 6 tokens left-padded by 4: it must see only its own tokens, at positions 0..5, then 6.
        short = ids[0, :6]
        batch = torch.cat([torch.cat([torch.zeros(4, dtype=torch.long), short])[None], ids[1:]])
        cache = KVCache.for_model(model, 2, 11, pad=[4, 0])
        logits = model.forward_cached(batch, cache)
        errors.append((logits[0] - model(short[None])[0, -1]).abs().max())
        errors.append((logits[1] - full[1, -1]).abs().max())
        nxt = torch.tensor([[77], [78]])
        logits = model.forward_cached(nxt, cache)
        errors.append((logits[0] - model(torch.cat([short, nxt[0]])[None])[0, -1]).abs().max())
        errors.append((logits[1] - model(torch.cat([ids[1], nxt[1]])[None])[0, -1]).abs().max())
    return max(e.item() for e in errors)


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_cached_logits_equal_the_full_forward_tp1(saved, name):
    assert check_cached_logits(1, saved[name][0]) <= 2e-5


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_cached_logits_equal_the_full_forward_tp2(pools, saved, name):
    for rank, err in enumerate(pools(2).run(check_cached_logits, 2, str(saved[name][0]))):
        assert err <= 2e-5, f"rank {rank}: {err}"


def test_cache_refuses_sequence_parallelism_and_overflow(saved):
    cfg, _ = load_model_source(str(saved["llama"][0]))
    model = Transformer(cfg, None, seed=0).eval()
    cache = KVCache.for_model(model, 1, 4)
    with pytest.raises(TensorparError, match="KV cache full"), torch.no_grad():
        model.forward_cached(torch.zeros(1, 5, dtype=torch.long), cache)
    attn = model.layers["0"].attn
    attn.sequence_parallel = True
    with pytest.raises(TensorparError, match="without sequence parallelism"):
        attn(torch.zeros(1, 2, cfg.hidden_size), MicroBatchContext(kv_cache=KVCache.for_model(model, 1, 4)))


# -- greedy and sampling: transformers, batches, seeds, TP sizes --------------------------------------------------


def check_generate(tp, folder, eos):
    """Everything the generation tests compare, computed on every rank of a TP group."""
    model = _load(folder, mesh(tp) if tp > 1 else None)
    return {
        "greedy": generate(model, PROMPTS, NEW, eos_id=eos),
        "alone": [generate(model, [p], NEW, eos_id=eos)[0] for p in PROMPTS],
        "sample0": generate(model, PROMPTS, NEW, seed=0, **SAMPLING),
        "sample0_alone": [generate(model, [p], NEW, seed=0, **SAMPLING)[0] for p in PROMPTS],
        "sample1": generate(model, PROMPTS, NEW, seed=1, **SAMPLING),
        "top_p": generate(model, PROMPTS, NEW, greedy=False, temperature=1.5, top_p=0.95, seed=2),
        "full": generate(model, PROMPTS, NEW, greedy=False, seed=2),
        "top1": generate(model, PROMPTS, NEW, greedy=False, top_k=1, temperature=3.0, seed=4, eos_id=eos),
    }


@pytest.fixture(scope="module")
def tp1_results(saved):
    return {name: check_generate(1, folder, eos) for name, (folder, _, eos) in saved.items()}


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_tp1_greedy_batches_and_sampling(saved, tp1_results, name):
    r = tp1_results[name]
    expected = saved[name][1]
    assert r["greedy"] == expected  # transformers' model.generate(do_sample=False)
    assert r["alone"] == expected  # a batch of different lengths = each prompt alone
    assert r["top1"] == expected  # top-k 1 is greedy, whatever the temperature and seed
    assert r["sample0"] == r["sample0_alone"]
    assert r["sample0"] == check_generate(1, saved[name][0], saved[name][2])["sample0"]  # reproducible
    assert r["sample0"] != r["sample1"]  # and the seed matters
    assert all(len(ids) == NEW for ids in r["sample0"] + r["top_p"] + r["full"])


@pytest.mark.parametrize("tp,name", [(2, "gpt2"), (2, "llama"), (4, "gpt2"), (4, "llama")])
def test_tp_generation_equals_tp1(pools, saved, tp1_results, tp, name):
    folder, expected, eos = saved[name]
    results = pools(tp).run(check_generate, tp, str(folder), eos)
    for rank, r in enumerate(results):
        assert r["greedy"] == expected, f"rank {rank}"
        assert r == tp1_results[name], f"rank {rank}: {r} vs TP=1 {tp1_results[name]}"


# -- the sampler itself -------------------------------------------------------------------------------------------


def _hf_keep(logits, top_k, top_p):
    scores = logits.clone()
    if top_k:
        scores = TopKLogitsWarper(top_k)(None, scores)
    if top_p < 1:
        scores = TopPLogitsWarper(top_p)(None, scores)
    return torch.isfinite(scores)


def check_keep_set(tp, logits, top_k, top_p):
    """This rank's slice of the kept set [B, V_local] for dense logits [B, V] (the vocabulary padded to TP)."""
    group = mesh(tp).tp_group if tp > 1 else Group.single()
    vocab = logits.shape[-1]
    local = -(-vocab // tp)
    padded = torch.full((logits.shape[0], local * tp), float("-inf"), dtype=logits.dtype)
    padded[:, :vocab] = logits
    shard = padded[:, group.rank * local:(group.rank + 1) * local]
    threshold = keep_threshold(shard, group, top_k, top_p)
    return shard >= threshold[:, None]


KEEP_CASES = [(50, 1.0), (0, 0.9), (0, 0.99), (40, 0.7), (2000, 0.5)]


def _keep_logits():
    g = torch.Generator().manual_seed(5)
    # Peaked rows (small nucleus) and a flat one (a nucleus of ~900 tokens: more than the first candidates).
    return torch.cat([torch.randn(3, 1001, generator=g, dtype=torch.float64) * 3,
                      torch.randn(1, 1001, generator=g, dtype=torch.float64) * 0.05])


@pytest.mark.parametrize("tp", [1, 2])
def test_top_k_top_p_keep_transformers_sets(pools, tp):
    logits = _keep_logits()
    for top_k, top_p in KEEP_CASES:
        expected = _hf_keep(logits, min(top_k, 1001), top_p)
        shards = [check_keep_set(1, logits, top_k, top_p)] if tp == 1 else \
            pools(tp).run(check_keep_set, tp, logits, top_k, top_p)
        kept = torch.cat(shards, dim=-1)[:, :1001]
        assert torch.equal(kept, expected), (top_k, top_p, kept.sum(-1), expected.sum(-1))
    assert expected[3].sum() > 100  # the flat row's nucleus grew past the first candidates


def test_sampling_frequencies_follow_the_filtered_softmax():
    logits = torch.tensor([[2.0, 1.5, 1.0, 0.0, -1.0, float("-inf")]])  # the last: vocabulary padding
    model = types.SimpleNamespace(tp_group=Group.single(), cfg=types.SimpleNamespace(vocab_size=5),
                                  mask_padding=lambda x: x)
    draws = 4000
    for kw in (dict(temperature=1.0), dict(temperature=2.0, top_k=3), dict(temperature=1.0, top_p=0.8)):
        counts = torch.zeros(6)
        for seed in range(draws):
            counts[select_tokens(logits, model, greedy=False, seed=seed, step=0, **kw)] += 1
        scores = logits[0, :5] / kw["temperature"]
        keep = _hf_keep(scores[None].double(), kw.get("top_k", 0), kw.get("top_p", 1.0))[0]
        probs = torch.softmax(scores.masked_fill(~keep, float("-inf")), -1)
        assert counts[5] == 0
        assert (counts[:5] / draws - probs).abs().max() < 0.03, (kw, counts / draws, probs)


# -- the command line ---------------------------------------------------------------------------------------------


def test_cli_tp2_json_equals_transformers_greedy(saved):
    folder, expected, _ = saved["gpt2"]
    proc, _ = tensorpar("generate", "--checkpoint", str(folder), "--tp", "2", "--json", "--max-new-tokens", str(NEW),
                        *[a for p in PROMPTS for a in ("--prompt-ids", ",".join(map(str, p)))])
    assert proc.returncode == 0, proc.stderr
    lines = [json.loads(line) for line in proc.stdout.strip().splitlines()]
    assert [line["ids"] for line in lines] == expected
    assert all(set(line) == {"ids", "text", "tokens_per_s"} and line["tokens_per_s"] > 0 for line in lines)


def test_cli_bad_input_exits_2_with_one_line(saved, cli):
    code, _, err = cli("generate", "--checkpoint", saved["llama"][0], "--tp", "3", "--prompt-ids", "1",
                       "--max-new-tokens", "4")
    assert code == 2, err
    assert err.splitlines() == ["tensorpar: error: num_heads = 4 is not divisible by the tensor-parallel size 3; "
                                "TP sizes that divide it: [1, 2, 4]"]


@pytest.mark.parametrize("args,needle", [
    (["--prompt-ids", "1", "--prompt", "a"], "either --prompt or --prompt-ids"),
    ([], "either --prompt or --prompt-ids"),
    (["--prompt-ids", "1,x"], "not a comma-separated list of integers"),
    (["--prompt-ids", "1,,2"], "--prompt-ids '1,,2' has an empty item (item 2)"),
    (["--prompt-ids", "1,2,"], "--prompt-ids '1,2,' has an empty item (item 3)"),
    (["--prompt-ids", "1 2"], "not a comma-separated list of integers"),
    (["--prompt-ids", "1,,2"], "'1,,2' has an empty item (item 2)"),
    (["--prompt-ids", "1 2,3"], "'1 2,3' is not a comma-separated list of integers"),
    (["--prompt-ids", "1", "--fp8-recipe", "rowwise"], "--fp8-recipe rowwise needs --dtype fp8"),
    (["--prompt-ids", "1", "--expert-gemm", "loop"], "--expert-gemm loop needs a mixture-of-experts model"),
    (["--prompt-ids", "3,1001"], "outside the vocabulary [0, 1001): [1001]"),
    (["--prompt", ""], "prompt 0 is empty"),
    (["--prompt-ids", "1", "--temperature", "0"], "temperature must be a number of at least 1e-05, got 0.0"),
    (["--prompt-ids", "1", "--temperature", "1e-300"], "temperature must be a number of at least 1e-05"),
    (["--prompt-ids", "1", "--top-p", "1.5"], "top-p must be in (0, 1]"),
    (["--prompt-ids", "1", "--top-k", "-1"], "top-k must be >= 0"),
    (["--prompt-ids", "1", "--greedy", "--seed", "3"], "--greedy takes no sampling options"),
    (["--prompt-ids", "1", "--greedy", "--min-p", "0.1"], "--greedy takes no sampling options (got --min-p)"),
    (["--prompt-ids", "1", "--min-p", "1.5"], "min-p must be in [0, 1]"),
    (["--prompt-ids", "1", "--repetition-penalty", "0"], "repetition-penalty must be a positive number"),
    (["--prompt-ids", "1", "--presence-penalty", "3"], "presence-penalty must be in [-2, 2]"),
    (["--prompt-ids", "1", "--max-new-tokens", "0"], "--max-new-tokens must be at least 1"),
    (["--prompt-ids", "1,2", "--max-new-tokens", "64"], "exceeds the model's 64 learned positions"),
    (["--prompt-ids", "1", "--sequence-parallel"], "without sequence parallelism"),
    (["--prompt-ids", "1", "--pp", "2"], "--pp must be 1"),
    (["--prompt-ids", "1", "--tp", "2", "--dp", "2"], "exactly --tp processes"),
    (["--prompt-ids", "1", "--checkpoint", "/nonexistent/model"], "'/nonexistent/model' does not exist"),
])
def test_cli_checks_before_launch(saved, capsys, args, needle):
    argv = ["generate", "--checkpoint", str(saved["gpt2"][0]), "--max-new-tokens", "4", *args]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("tensorpar: error: ") and needle in err, err


def check_uncached_greedy(tp):
    """The training run's sample (`greedy_generate`: no cache, whole sequence each step, right-padded under
    sequence parallelism) gives the KV-cache generator's greedy tokens, with and without SP."""
    from tensorpar.inference.greedy import greedy_generate
    from tensorpar.models import get_config

    m = mesh(tp=tp)
    cfg = get_config("tiny-gpt2").replace(num_layers=2)
    prompt = [5, 17, 200, 3, 99]  # odd length: padded under SP at tp=2
    expected = generate(Transformer(cfg, m, seed=3), [prompt], 8)[0]
    plain = greedy_generate(Transformer(cfg, m, seed=3), prompt, 8)
    sp = greedy_generate(Transformer(cfg, Placement.on(m, sequence_parallel=True), seed=3), prompt, 8)
    return expected, plain, sp


@pytest.mark.parametrize("tp", [1, 2])
def test_uncached_greedy_sample_equals_cached_generation(pools, tp):
    for expected, plain, sp in pools(tp).run(check_uncached_greedy, tp):
        assert plain == expected and sp == expected, (expected, plain, sp)


def test_a_checkpoints_eos_comes_from_the_step_folder_latest_names(tmp_path):
    """A tensorpar checkpoint keeps its tokenizer's files, generation_config.json included, in its step folders."""
    from tensorpar.commands.generate import eos_ids

    step = tmp_path / "step-000002"
    step.mkdir()
    (tmp_path / "latest").write_text("step-000002\n")
    (step / "tokenizer.json").write_text("{}")
    (step / "generation_config.json").write_text('{"eos_token_id": [7, 9]}')
    assert eos_ids(str(tmp_path), tokenizer=None) == [7, 9]


@pytest.mark.parametrize("prompts, needle", [
    (torch.tensor([[1, 2, 3]]), r"prompts must be a list of prompts.*got Tensor \(pass ids.tolist\(\)\)"),
    ([1, 2, 3], r"prompt 0 is int 1, not a list of token ids.*passed as \[\[1, 2, 3\]\]"),
    ([[1, 2.5]], r"prompt 0 holds other values than integer token ids: \[1, 2.5\]"),
])
def test_generate_names_a_prompt_of_the_wrong_shape_or_type(saved, prompts, needle):
    """A tensor, one flat prompt or float ids failed deep inside with a TypeError or RuntimeError (or, for 2.5,
    were truncated to 2 without a word)."""
    model = _load(saved["llama"][0])
    with pytest.raises(TensorparError, match=needle):
        generate(model, prompts, 2)


def test_greedy_generate_checks_its_prompt_as_generate_does(saved):
    """greedy_generate ran an out-of-vocabulary id into the embedding (an IndexError, a device assert on CUDA), an
    empty prompt into a float tensor, and returned [] for a negative token count."""
    from tensorpar.inference import greedy_generate

    model = _load(saved["llama"][0])
    for prompt, count, needle in (([5, 1001], 2, r"outside the vocabulary \[0, 1001\): \[1001\]"),
                                  ([], 2, "prompt 0 is empty"), ([5], -1, "max-new-tokens must be >= 0")):
        with pytest.raises(TensorparError, match=needle):
            greedy_generate(model, prompt, count)
    assert greedy_generate(model, [5, 17], 3) == generate(model, [[5, 17]], 3)[0]
