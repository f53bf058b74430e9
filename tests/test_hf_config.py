"""Hugging Face config.json <-> ModelConfig for GPT-2 and Llama, and what has no equivalent."""

import json

import pytest

transformers = pytest.importorskip("transformers")
from tensorpar.checkpoints.hf import load_hf_folder  # noqa: E402
from tensorpar.checkpoints.hf_config import config_from_hf, config_to_hf  # noqa: E402
from tensorpar.errors import TensorparError  # noqa: E402
from tensorpar.models import get_config  # noqa: E402

from test_hf import HF_CONFIGS, LLAMA3_ROPE, _gpt2, _llama, hf_models  # noqa: F401  (hf_models: a fixture)


def test_config_mapping(hf_models):  # noqa: F811 - the fixture imported from test_hf
    cfg = load_hf_folder(hf_models["gpt2"][0])[0]
    assert (cfg.family, cfg.vocab_size, cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.kv_heads) == \
        ("gpt2", 1001, 64, 2, 4, 4)
    assert (cfg.ffn_hidden_size, cfg.max_seq_len, cfg.norm, cfg.activation, cfg.position, cfg.tie_embeddings,
            cfg.bias, cfg.gated_mlp, cfg.dropout) == (256, 64, "layernorm", "gelu_new", "learned", True, True, False, 0)
    cfg = load_hf_folder(hf_models["gpt2-untied"][0])[0]
    assert (cfg.ffn_hidden_size, cfg.activation, cfg.tie_embeddings) == (96, "gelu", False)

    cfg = load_hf_folder(hf_models["llama"][0])[0]
    assert (cfg.family, cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.kv_heads, cfg.ffn_hidden_size) == \
        ("llama", 64, 2, 4, 1, 128)
    assert (cfg.norm, cfg.norm_eps, cfg.activation, cfg.gated_mlp, cfg.position, cfg.rope_theta, cfg.rope_scaling,
            cfg.tie_embeddings, cfg.bias, cfg.dropout) == \
        ("rmsnorm", 1e-6, "silu", True, "rope", 10000.0, None, False, False, 0)
    assert load_hf_folder(hf_models["llama-bias"][0])[0].bias is True

    cfg = load_hf_folder(hf_models["llama3"][0])[0]
    assert cfg.rope_theta == 500000.0 and cfg.tie_embeddings and cfg.rope_scaling == LLAMA3_ROPE
    # transformers 4 layout: top-level rope_theta, rope_scaling with "type"; and a config without the original
    # length (transformers then uses max_position_embeddings).
    legacy = {k: v for k, v in _llama().to_dict().items() if k != "rope_parameters"}
    legacy.update(rope_theta=500000.0, rope_scaling={**LLAMA3_ROPE, "type": "llama3"}, tie_word_embeddings=True)
    del legacy["rope_scaling"]["rope_type"]
    assert config_from_hf(legacy) == cfg.replace(num_kv_heads=1)
    del legacy["rope_scaling"]["original_max_position_embeddings"]
    assert config_from_hf(legacy).rope_scaling["original_max_position_embeddings"] == 64
    # Defaults: GPT2Config's when a field is left out.
    assert config_from_hf({"model_type": "gpt2"}) == get_config("gpt2-124m")


@pytest.mark.parametrize("name", ["gpt2", "gpt2-untied", "llama", "llama-bias", "llama3"])
def test_config_to_hf_round_trip(name):
    cfg = config_from_hf(HF_CONFIGS[name]().to_dict())
    hf = config_to_hf(cfg)
    cls = transformers.GPT2Config if cfg.family == "gpt2" else transformers.LlamaConfig
    assert config_from_hf(cls.from_dict(hf).to_dict()) == cfg  # what transformers makes of it maps back
    assert config_from_hf(json.loads(json.dumps(hf))) == cfg


@pytest.mark.parametrize("model_type,field,value", [
    ("bert", "model_type", "bert"),
    ("llama", "hidden_act", "gelu"),
    ("llama", "head_dim", 15),  # RoPE needs an even head size (a head size of its own is fine: 32, say)
    ("llama", "attention_bias", "yes"),
    ("llama", "rope_type", "proportional"),  # transformers' Gemma-4 RoPE: not one tensorpar computes
    ("llama", "num_key_value_heads", 3),
    ("gpt2", "activation_function", "quick_gelu"),
    ("gpt2", "scale_attn_by_inverse_layer_idx", True),
    ("gpt2", "n_embd", "64"),
    ("llama", "initializer_range", -0.02),
])
def test_config_refusals(model_type, field, value):
    hf = (_gpt2() if model_type == "gpt2" else _llama()).to_dict()
    if field == "model_type":
        hf["model_type"] = value
    elif field == "mlp_bias":
        hf.update(attention_bias=True, mlp_bias=value)
    elif field == "rope_type":
        hf["rope_parameters"] = {"rope_type": value, "factor": 2.0, "rope_theta": 10000.0}
    else:
        hf[field] = value
    with pytest.raises(TensorparError) as e:
        config_from_hf(hf)
    msg = str(e.value)
    assert "\n" not in msg and field in msg and repr(value) in msg, msg


def test_initializer_range_is_the_std_a_model_from_the_config_starts_with():
    """DeepSeek-V3's config says 0.006: a model trained from it starts there, not at the 0.02 of a field ignored."""
    from tensorpar.models import Transformer

    hf = dict(_llama().to_dict(), initializer_range=0.006)
    cfg = config_from_hf(hf)
    assert cfg.init_std == 0.006 and config_from_hf(config_to_hf(cfg)) == cfg
    embedding = Transformer(cfg, None).state_dict()["embed.weight"]
    assert abs(embedding.std().item() - 0.006) < 0.0005
    assert config_from_hf({k: v for k, v in hf.items() if k != "initializer_range"}).init_std == 0.02
    assert config_from_hf(dict(hf, initializer_range=None)).init_std == 0.02  # a folder loads whatever init it says
    assert config_from_hf(dict(hf, initializer_range=0)).init_std == 0.0


def test_export_refuses_configs_without_hf_equivalent():
    relu = get_config("tiny").replace(activation="relu", gated_mlp=False)
    with pytest.raises(TensorparError, match="activation='relu'"):
        config_to_hf(relu)
    with pytest.raises(TensorparError, match="num_kv_heads"):
        config_to_hf(get_config("tiny-gpt2").replace(num_kv_heads=2))
