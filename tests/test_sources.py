"""`tensorpar eval` and `train --init-from` on Hugging Face folders report what transformers computes."""

import json

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

from harness import run_cli  # noqa: E402
from test_eval import evaluate_in_worker  # noqa: E402
from test_hf import HF_CONFIGS, _hf_model  # noqa: E402

SEQ_LEN = 15


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """name -> (folder, token file, transformers' eval loss per the eval contract)."""
    out = {}
    tokens = np.random.default_rng(0).integers(0, 1001, size=5 * (SEQ_LEN + 1) + 7)  # 5 windows + a remainder
    for name in ("llama", "gpt2"):  # one KV head (replicated at TP 2, 4); vocab 1001 (padded at TP 2, 4)
        torch.manual_seed(7)
        model = _hf_model(HF_CONFIGS[name]())
        folder = tmp_path_factory.mktemp(name)
        model.save_pretrained(folder, safe_serialization=True)
        data = folder / "tokens.npy"
        np.save(data, tokens.astype(np.int32))
        windows = torch.from_numpy(tokens[: 5 * (SEQ_LEN + 1)]).view(5, SEQ_LEN + 1)
        with torch.no_grad():
            logits = model(windows[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), windows[:, 1:].flatten()).item()
        out[name] = (folder, data, loss)
    return out


@pytest.mark.parametrize("name", ["llama", "gpt2"])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_eval_reports_the_transformers_loss(saved, pools, name, tp):
    folder, data, expected = saved[name]
    if (name, tp) == ("gpt2", 2):  # the command, run by the pool's ranks; the others call its function
        outputs = pools(tp).run(run_cli, ["eval", "--checkpoint", folder, "--tp", tp, "--data", data,
                                          "--seq-len", SEQ_LEN, "--batch-size", "2"])
        assert outputs[0][0] == 0, outputs[0][2]
        result = json.loads(outputs[0][1].strip().splitlines()[-1])
    else:
        result = pools(tp).run(evaluate_in_worker, checkpoint=str(folder), tp=tp, data=str(data), seq_len=SEQ_LEN,
                               batch_size=2)[0]
    assert result["tokens"] == 5 * SEQ_LEN
    assert abs(result["loss"] - expected) <= 1e-4 * expected, (result, expected)
    assert abs(result["perplexity"] - np.exp(expected)) <= 1e-3 * np.exp(expected)


def check_init_from(folder, data, seq_len):
    from tensorpar.training import TrainOptions

    from harness import train

    summary = train(TrainOptions(init_from=str(folder), data=str(data), tp=2, steps=1, seq_len=seq_len,
                              global_batch_size=2, val_every=0, val_fraction=0.0, progress=False, device="cpu"))
    return summary["history"][0]["loss"]


def test_train_init_from_starts_at_the_transformers_loss(pools, saved):
    from tensorpar.data import TokenDataset, load_tokens

    folder, data, _ = saved["llama"]
    model = _hf_model(HF_CONFIGS["llama"]())
    model.load_state_dict(transformers.LlamaForCausalLM.from_pretrained(folder).state_dict())
    batch = TokenDataset(load_tokens(str(data), None), SEQ_LEN, val_fraction=0.0).global_batch(0, 0, 2)
    with torch.no_grad():
        logits = model(batch[:, :-1]).logits
    expected = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten()).item()
    for loss in pools(2).run(check_init_from, folder, data, SEQ_LEN):
        assert abs(loss - expected) <= 1e-5 * expected
