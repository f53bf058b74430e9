"""Hugging Face import and export against transformers itself, on small random GPT-2 and Llama models.

Each model is built with transformers in this process (every parameter perturbed, so that zero
biases and unit norms cannot hide a wrong mapping), saved with `save_pretrained`, and its logits
and loss are the reference: tensorpar must reproduce them from the saved folder at TP 1, 2 and 4.
"""

import json
import shutil

import pytest
import torch

transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file, save_file  # noqa: E402

from tensorpar.models.placement import Placement
from tensorpar.checkpoints.hf import (  # noqa: E402
    check_hf_folder,
    hf_to_tensorpar,
    is_hf_folder,
    load_hf_folder,
    save_hf_folder,
    tensorpar_to_hf,
)
from tensorpar.checkpoints.sources import load_config  # noqa: E402
from tensorpar.checkpoints.hf_config import config_from_hf  # noqa: E402
from tensorpar.errors import TensorparError  # noqa: E402
from tensorpar.models import Transformer, full_state_dict, load_full_state_dict  # noqa: E402

from checks import rel_err  # noqa: E402
from harness import mesh  # noqa: E402

TOL = 1e-5


LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               # With head_dim 16 and theta 5e5 the wavelengths (6.3, 32, 167, ...) hit all three llama3 bands.
               "original_max_position_embeddings": 64}


def _gpt2(**kw):
    return transformers.GPT2Config(vocab_size=1001, n_embd=64, n_layer=2, n_head=4, n_positions=64,
                                   bos_token_id=0, eos_token_id=0, **kw)


def _llama(**kw):
    args = dict(vocab_size=1001, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=1, max_position_embeddings=64)
    return transformers.LlamaConfig(**{**args, **kw})


HF_CONFIGS = {
    "gpt2": lambda: _gpt2(),  # tied, gelu_new; vocab 1001 does not divide by TP
    "gpt2-untied": lambda: _gpt2(tie_word_embeddings=False, activation_function="gelu", n_inner=96),
    "llama": lambda: _llama(),  # one KV head: replicated at TP 2 and 4; untied
    "llama-bias": lambda: _llama(num_key_value_heads=2, attention_bias=True, mlp_bias=True, rms_norm_eps=1e-5),
    "llama3": lambda: _llama(num_key_value_heads=2, tie_word_embeddings=True, rope_theta=500000.0,
                             rope_scaling=dict(LLAMA3_ROPE)),
}


def _hf_model(config):
    cls = transformers.GPT2LMHeadModel if config.model_type == "gpt2" else transformers.LlamaForCausalLM
    config._attn_implementation = "eager"
    model = cls(config).float().eval()
    with torch.no_grad():
        for p in model.parameters():  # random biases and norm weights, not HF's zeros and ones
            p.add_(torch.randn_like(p) * 0.05)
    return model


def _batch(seed=1, seq=16):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 1001, (2, seq), generator=g)
    labels = ids.clone()
    labels[0, :3] = -100
    labels[1, 7] = -100
    # HF shifts the labels inside the model; tensorpar takes targets already aligned with the inputs.
    targets = torch.full_like(labels, -100)
    targets[:, :-1] = labels[:, 1:]
    return ids, labels, targets


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory):
    """name -> (folder, HF logits, HF loss) of a saved random model."""
    ids, labels, _ = _batch()
    out = {}
    for i, (name, make) in enumerate(HF_CONFIGS.items()):
        torch.manual_seed(100 + i)
        model = _hf_model(make())
        folder = tmp_path_factory.mktemp(name)
        model.save_pretrained(folder, safe_serialization=True)
        with torch.no_grad():
            logits = model(ids).logits
            loss = model(ids, labels=labels).loss
        out[name] = (folder, logits, loss)
    return out


def _tensorpar_logits_loss(cfg, state, ids, targets, m=None):
    model = Transformer(cfg, m, init=False)
    load_full_state_dict(model, state, "test")
    model.eval()
    with torch.no_grad():
        return model(ids), model(ids, targets)


@pytest.mark.parametrize("name", list(HF_CONFIGS))
def test_name_mapping_round_trip_is_bit_exact(hf_models, name):
    folder = hf_models[name][0]
    cfg = config_from_hf(json.loads((folder / "config.json").read_text()))
    saved = load_file(str(folder / "model.safetensors"))
    state = hf_to_tensorpar(saved, cfg)
    assert set(state) == set(dict(Transformer(cfg, Placement.on(device="meta"), init=False).named_parameters()))
    back = tensorpar_to_hf(state, cfg)
    assert set(back) == set(saved)
    for key, tensor in saved.items():
        assert back[key].dtype == tensor.dtype and torch.equal(back[key], tensor), key

    # Base-model names without the prefix, GPT-2's mask buffers and a stored tied lm_head (the embedding's copy)
    # change nothing.
    prefix = "transformer." if cfg.family == "gpt2" else "model."
    bare = {k.removeprefix(prefix): v for k, v in saved.items()}
    if cfg.family == "gpt2":
        bare["h.0.attn.bias"] = torch.ones(1, 1, 64, 64, dtype=torch.bool)
        bare["h.1.attn.masked_bias"] = torch.tensor(-1e4)
    if cfg.tie_embeddings:
        bare["lm_head.weight"] = bare["wte.weight" if cfg.family == "gpt2" else "embed_tokens.weight"].clone()
    other = hf_to_tensorpar(bare, cfg)
    assert set(other) == set(state) and all(torch.equal(other[k], state[k]) for k in state)
    if cfg.tie_embeddings:
        # One unlike the embedding: transformers 5 then leaves the two untied, so reading the embedding as the head
        # would compute another model; refused, naming the field.
        bare["lm_head.weight"] = torch.zeros_like(bare["lm_head.weight"])
        with pytest.raises(TensorparError, match="tie_word_embeddings = true but 'lm_head.weight' differs"):
            hf_to_tensorpar(bare, cfg)


def test_name_mapping_refusals(hf_models):
    folder = hf_models["llama"][0]
    cfg = config_from_hf(json.loads((folder / "config.json").read_text()))
    saved = load_file(str(folder / "model.safetensors"))
    missing = {k: v for k, v in saved.items() if k != "lm_head.weight"}
    with pytest.raises(TensorparError, match="missing.*lm_head.weight"):
        hf_to_tensorpar(missing, cfg)
    with pytest.raises(TensorparError, match="model.layers.2.mlp.up_proj.weight"):
        hf_to_tensorpar({**saved, "model.layers.2.mlp.up_proj.weight": torch.zeros(128, 64)}, cfg)
    with pytest.raises(TensorparError, match=r"k_proj.weight' has shape \(32, 64\).*\(16, 64\)"):
        hf_to_tensorpar({**saved, "model.layers.0.self_attn.k_proj.weight": torch.zeros(32, 64)}, cfg)


@pytest.mark.parametrize("name", list(HF_CONFIGS))
def test_tp1_logits_and_loss_match_transformers(hf_models, name):
    folder, hf_logits, hf_loss = hf_models[name]
    cfg, state = load_hf_folder(folder)
    assert check_hf_folder(folder) == cfg  # the launcher's header-only check agrees
    ids, _, targets = _batch()
    logits, loss = _tensorpar_logits_loss(cfg, state, ids, targets)
    assert logits.shape == hf_logits.shape
    assert rel_err(logits, hf_logits) <= TOL, f"logits: {rel_err(logits, hf_logits):.2e}"
    assert rel_err(loss, hf_loss) <= TOL, f"loss {loss.item()} vs transformers {hf_loss.item()}"


def check_hf_tp(tp, folder, ids, targets):
    """On every rank: load the folder at this TP size; (loss, this rank's logits shard, vocab start)."""
    m = mesh(tp=tp)
    cfg, state = load_hf_folder(folder)
    logits, loss = _tensorpar_logits_loss(cfg, state, ids, targets, m)
    return loss.item(), logits, m.tp_group.rank * logits.shape[-1]


@pytest.mark.parametrize("tp,name", [(2, "gpt2"), (4, "gpt2"), (2, "llama"), (4, "llama")])
def test_tp_loss_matches_transformers(pools, hf_models, tp, name):
    folder, hf_logits, hf_loss = hf_models[name]
    ids, _, targets = _batch()
    for rank, (loss, shard, start) in enumerate(pools(tp).run(check_hf_tp, tp, str(folder), ids, targets)):
        assert abs(loss - hf_loss.item()) <= TOL * abs(hf_loss.item()), f"rank {rank}: {loss} vs {hf_loss.item()}"
        valid = min(shard.shape[-1], 1001 - start)  # the last rank's shard ends in vocabulary padding
        expected = hf_logits[..., start:start + valid]
        assert rel_err(shard[..., :valid], expected) <= TOL, f"rank {rank} logits"


def _embedding_grad(tp, folder, ids, targets):
    """On every rank: (this rank's rows of the embedding's gradient after one backward, their first id)."""
    m = mesh(tp=tp) if tp > 1 else None
    cfg, state = load_hf_folder(folder)
    model = Transformer(cfg, m, init=False)
    load_full_state_dict(model, state, "test")
    model(ids, targets).backward()
    return model.embed.weight.grad, model.embed.vocab_start


@pytest.fixture(scope="module")
def padded_llama(tmp_path_factory):
    """(folder, batch with the pad token as input, transformers' embedding gradient) of a Llama whose config names
    a pad token: transformers builds its embedding with padding_idx, a row that no lookup trains."""
    torch.manual_seed(7)
    model = _hf_model(_llama(pad_token_id=600))
    folder = tmp_path_factory.mktemp("llama-pad")
    model.save_pretrained(folder, safe_serialization=True)
    ids, labels, targets = _batch()
    ids[:, 4:6] = 600
    model(ids, labels=labels).loss.backward()
    return folder, ids, targets, model.model.embed_tokens.weight.grad


@pytest.mark.parametrize("tp", [1, 2])  # 1001 rows: the pad's row on the second rank's 501
def test_the_padding_row_gets_no_gradient_as_in_transformers(pools, padded_llama, tp):
    folder, ids, targets, expected = padded_llama
    assert load_hf_folder(folder)[0].pad_token_id == 600 and expected[600].abs().max() == 0
    runs = [_embedding_grad(1, str(folder), ids, targets)] if tp == 1 else pools(2).run(
        _embedding_grad, 2, str(folder), ids, targets)
    for grad, start in runs:
        rows = min(grad.shape[0], 1001 - start)
        assert rel_err(grad[:rows], expected[start:start + rows]) <= TOL
    assert runs[-1][0][600 - runs[-1][1]].abs().max() == 0


def test_the_padding_row_survives_the_round_trip(padded_llama, tmp_path):
    cfg, state = load_hf_folder(padded_llama[0])
    save_hf_folder(tmp_path / "out", cfg, state)
    assert json.loads((tmp_path / "out" / "config.json").read_text())["pad_token_id"] == 600
    assert load_hf_folder(tmp_path / "out")[0] == cfg


def test_weights_holding_nan_are_refused_naming_the_tensor(hf_models, tmp_path):
    folder = _copy(hf_models["llama"][0], tmp_path)
    saved = load_file(str(folder / "model.safetensors"))
    saved["model.norm.weight"][3] = float("nan")
    save_file(saved, str(folder / "model.safetensors"), metadata={"format": "pt"})
    cfg, state = load_hf_folder(folder)
    with pytest.raises(TensorparError, match="the folder: 'final_norm.weight' holds NaN or infinite values"):
        load_full_state_dict(Transformer(cfg, init=False), state, "the folder")


def test_a_pad_token_outside_the_vocabulary_is_refused():
    with pytest.raises(TensorparError, match="pad_token_id.*1001.*expected a token id within the vocabulary"):
        config_from_hf(_llama(pad_token_id=1001).to_dict())
    assert config_from_hf(_llama(pad_token_id=-1).to_dict()).pad_token_id == 1000  # as nn.Embedding counts it


def test_is_hf_folder(hf_models, tmp_path):
    assert is_hf_folder(hf_models["gpt2"][0]) and is_hf_folder(str(hf_models["llama"][0]))
    assert not is_hf_folder(tmp_path / "nope") and not is_hf_folder(tmp_path)
    (tmp_path / "config.json").write_text('{"model_type": "bert"}')
    (tmp_path / "model.safetensors").write_bytes(b"")
    assert not is_hf_folder(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    assert not is_hf_folder(tmp_path)
    shutil.copy(hf_models["gpt2"][0] / "config.json", tmp_path / "config.json")
    assert is_hf_folder(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    assert not is_hf_folder(tmp_path)


def test_sharded_folder_loads_like_single_file(hf_models, tmp_path):
    torch.manual_seed(7)
    model = _hf_model(HF_CONFIGS["llama"]())
    model.save_pretrained(tmp_path / "one", safe_serialization=True)
    model.save_pretrained(tmp_path / "sharded", safe_serialization=True, max_shard_size="100KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    assert len(list((tmp_path / "sharded").glob("*.safetensors"))) > 1
    cfg, state = load_hf_folder(tmp_path / "one")
    cfg2, state2 = load_hf_folder(tmp_path / "sharded")
    assert cfg == cfg2 and set(state) == set(state2) and all(torch.equal(state[k], state2[k]) for k in state)
    # A shard the index names but that is gone.
    next((tmp_path / "sharded").glob("model-00002-*.safetensors")).unlink()
    with pytest.raises(TensorparError, match="model-00002-.*does not exist"):
        load_hf_folder(tmp_path / "sharded")


def _copy(folder, tmp_path):
    dst = tmp_path / "copy"
    shutil.copytree(folder, dst)
    return dst


def test_load_errors(hf_models, tmp_path):
    with pytest.raises(TensorparError, match="nope.*does not exist"):
        load_hf_folder(tmp_path / "nope")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(TensorparError, match="config.json.*does not exist"):
        load_hf_folder(empty)
    shutil.copy(hf_models["gpt2"][0] / "config.json", empty / "config.json")
    with pytest.raises(TensorparError, match="no \\*.safetensors files"):
        load_hf_folder(empty)
    (empty / "pytorch_model.bin").write_bytes(b"")
    for load in (load_hf_folder, load_config):  # what the commands check before any rank starts, then load
        with pytest.raises(TensorparError, match=r"no \*.safetensors files \(found pytorch_model.bin: only safe"):
            load(str(empty))
    (empty / "pytorch_model.bin").unlink()
    (empty / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_act": "relu"}))
    with pytest.raises(TensorparError, match="config.json.*hidden_act='relu'"):
        load_hf_folder(empty)

    folder = _copy(hf_models["gpt2"][0], tmp_path)
    weights = folder / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    for load in (load_hf_folder, load_config):
        with pytest.raises(TensorparError, match="cannot read safetensors file .*model.safetensors"):
            load(str(folder))


def test_wrong_or_missing_tensor_errors(hf_models, tmp_path):
    folder = _copy(hf_models["gpt2"][0], tmp_path)
    weights = folder / "model.safetensors"
    saved = load_file(str(weights))
    save_file({**saved, "transformer.h.1.mlp.c_fc.weight": torch.zeros(64, 200)}, str(weights),
              metadata={"format": "pt"})
    for load in (load_hf_folder, load_config):  # the launcher's check finds it from the header alone
        with pytest.raises(TensorparError, match=r"model.safetensors.*'transformer.h.1.mlp.c_fc.weight' has shape "
                                                 r"\(64, 200\), the config expects \(64, 256\)"):
            load(str(folder))
    save_file({k: v for k, v in saved.items() if k != "transformer.ln_f.bias"}, str(weights),
              metadata={"format": "pt"})
    for load in (load_hf_folder, load_config):
        with pytest.raises(TensorparError, match="missing.*transformer.ln_f.bias"):
            load(str(folder))
    # An integer weight would be cast into the float parameter without a word.
    save_file({**saved, "transformer.h.0.mlp.c_fc.bias": saved["transformer.h.0.mlp.c_fc.bias"].to(torch.int32)},
              str(weights), metadata={"format": "pt"})
    for load in (load_hf_folder, load_config):
        with pytest.raises(TensorparError, match=r"'transformer.h.0.mlp.c_fc.bias' is int32; weights must be "
                                                 r"float16, bfloat16, float32 or float64"):
            load(str(folder))


@pytest.mark.parametrize("name", ["gpt2-untied", "llama3", "llama-bias"])
def test_save_hf_folder_loads_in_transformers(tmp_path, name):
    """A tensorpar model saved as a HF folder: transformers computes tensorpar's logits, and loading it back
    gives the same tensors bit for bit."""
    cfg = config_from_hf(HF_CONFIGS[name]().to_dict())
    model = Transformer(cfg, seed=3).eval()
    state = full_state_dict(model)
    save_hf_folder(tmp_path / "out", cfg, state)
    assert is_hf_folder(tmp_path / "out")
    hf_cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert hf_cfg["architectures"] == ["GPT2LMHeadModel" if cfg.family == "gpt2" else "LlamaForCausalLM"]
    cfg2, state2 = load_hf_folder(tmp_path / "out")
    assert cfg2 == cfg and all(torch.equal(state2[k], state[k]) for k in state)

    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", attn_implementation="eager").eval()
    assert hf.dtype == torch.float32
    ids, labels, targets = _batch(seed=2)
    with torch.no_grad():
        assert rel_err(hf(ids).logits, model(ids)) <= TOL
        assert rel_err(hf(ids, labels=labels).loss, model(ids, targets)) <= TOL
    # Saving again into the same folder overwrites it; a folder holding a sharded checkpoint is refused.
    save_hf_folder(tmp_path / "out", cfg, state)
    (tmp_path / "out" / "model-00001-of-00002.safetensors").write_bytes(b"")
    with pytest.raises(TensorparError, match="already holds another checkpoint"):
        save_hf_folder(tmp_path / "out", cfg, state)
