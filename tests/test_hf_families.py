"""The Llama-style families users bring against transformers itself (tests/family_models.py: Qwen2, Qwen3, Qwen3-MoE,
Mistral, Gemma 2, Gemma 3 text, Phi-3, OLMo 2): a folder written by `save_pretrained` loads with its config mapped
field by field, gives transformers' logits, exports back bit for bit to a folder transformers loads, evaluates to
transformers' loss at TP 1, 2 and 4 and generates transformers' greedy tokens at TP 1 and 2 (prompts longer than the
sliding windows, left-padded in a batch); a field tensorpar cannot compute is refused naming it."""

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file  # noqa: E402

from tensorpar.checkpoints.hf import check_hf_folder, load_hf_folder, save_hf_folder  # noqa: E402
from tensorpar.checkpoints.hf_config import config_from_hf, config_to_hf  # noqa: E402
from tensorpar.commands.generate import generate_text  # noqa: E402
from tensorpar.config.options import GenerateOptions  # noqa: E402
from tensorpar.data import ByteTokenizer  # noqa: E402
from tensorpar.errors import TensorparError  # noqa: E402
from tensorpar.models import Transformer, load_full_state_dict  # noqa: E402

from checks import rel_err  # noqa: E402
from family_models import (  # noqa: E402
    CONFIGS,
    NAMES,
    NEW_TOKENS,
    PROMPTS,
    SEQ,
    WINDOWS,
    eval_in_worker,
    families,  # noqa: F401  (a fixture)
    generate_in_worker,
)
from test_eval import evaluate_in_worker  # noqa: E402

TOL = 1e-5
SAMPLING = dict(greedy=True, temperature=1.0, top_k=0, top_p=1.0, seed=0)


@pytest.mark.parametrize("name", NAMES)
def test_folder_loads_computes_transformers_logits_and_exports_back(families, tmp_path, name):
    folder, model = families[name]["folder"], families[name]["model"]
    cfg, state = load_hf_folder(folder)
    assert cfg.family == name and check_hf_folder(folder) == cfg  # the launcher's header-only check agrees
    windows = families["windows"]
    ours = Transformer(cfg, init=False)
    load_full_state_dict(ours, state, "test")
    with torch.no_grad():
        assert rel_err(ours.eval()(windows[:, :-1]), model(windows[:, :-1]).logits) <= TOL

    save_hf_folder(tmp_path / "out", cfg, state)
    original, exported = load_file(f"{folder}/model.safetensors"), load_file(str(tmp_path / "out/model.safetensors"))
    assert set(exported) == set(original) and all(torch.equal(exported[k], original[k]) for k in original)
    hf = json.loads((tmp_path / "out/config.json").read_text())
    assert config_from_hf(hf) == cfg
    # What transformers' own config class makes of the export maps back to the same config, and its model holds the
    # same tensors as the original.
    assert config_from_hf(type(model.config).from_dict(hf).to_dict()) == cfg
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").state_dict()
    expected = model.state_dict()
    assert set(reloaded) == set(expected) and all(torch.equal(reloaded[k], expected[k]) for k in expected)


def _folders(families) -> dict:
    return {name: families[name]["folder"] for name in NAMES}


def test_eval_command_at_tp_1_matches_transformers(families):
    """`tensorpar eval`'s work as its one rank runs it (the mesh of a world of one)."""
    for name in NAMES:
        r = evaluate_in_worker(checkpoint=families[name]["folder"], data=families["data"], seq_len=SEQ, batch_size=3)
        assert r["tokens"] == WINDOWS * SEQ
        assert abs(r["loss"] - families[name]["loss"]) <= TOL * families[name]["loss"], (name, r, families[name])


@pytest.mark.parametrize("tp", [2, 4])
def test_eval_loss_matches_transformers_at_tp(pools, families, tp):
    """TP 4 splits the 2 KV heads (1 for Qwen3) over more ranks than there are heads; the vocabulary of 257 pads."""
    for rank, losses in enumerate(pools(tp).run(eval_in_worker, _folders(families), families["windows"], tp)):
        for name, loss in losses.items():
            expected = families[name]["loss"]
            assert abs(loss - expected) <= TOL * expected, (name, tp, rank, loss, expected)


def test_qwen3_moe_over_expert_parallel_ranks(pools, families):
    """Qwen3-MoE's experts split over 2 expert-parallel ranks (`tensorpar eval --ep 2`'s work on its two ranks)."""
    expected = families["qwen3_moe"]["loss"]
    for r in pools(2).run(evaluate_in_worker, checkpoint=families["qwen3_moe"]["folder"], data=families["data"],
                          seq_len=SEQ, batch_size=3, ep=2):
        assert abs(r["loss"] - expected) <= TOL * expected, (r, expected)


def test_greedy_generate_matches_transformers(pools, families):
    """At TP 1 (`tensorpar generate`'s work) and TP 2: prompts longer than the windows, batched and left-padded."""
    for name in NAMES:
        options = GenerateOptions(checkpoint=families[name]["folder"], device="cpu", max_new_tokens=NEW_TOKENS,
                                  greedy=True, ignore_eos=True)
        assert generate_text(options, ByteTokenizer(), PROMPTS, SAMPLING, None)[0] == families[name]["tokens"], name
    for rank, tokens in enumerate(pools(2).run(generate_in_worker, _folders(families), 2)):
        for name in NAMES:
            assert tokens[name] == families[name]["tokens"], (name, rank, tokens[name], families[name]["tokens"])


def _refused(name: str, changes: dict, needle: str):
    hf = {**CONFIGS[name]().to_dict(), **changes}
    with pytest.raises(TensorparError) as e:
        config_from_hf(hf)
    assert "\n" not in str(e.value) and needle in str(e.value), str(e.value)


def test_fields_tensorpar_cannot_compute_are_refused():
    _refused("gemma3_text", {"use_bidirectional_attention": True}, "use_bidirectional_attention=True")
    _refused("gemma3_text", {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e4},
                                                 "sliding_attention": {"rope_type": "linear", "factor": 2.0}}},
             "rope_parameters.sliding_attention.rope_type='linear'")
    _refused("qwen2", {"layer_types": ["full_attention", "chunked_attention"]}, "layer_types=")
    _refused("qwen3", {"rope_parameters": {"rope_type": "ntk-by-parts", "rope_theta": 1e4}},
             "rope_parameters.rope_type='ntk-by-parts' (supported: default, linear, dynamic, yarn, longrope, llama3)")
    _refused("qwen3", {"partial_rotary_factor": 0.5}, "partial_rotary_factor=0.5 (qwen3 rotates whole heads)")
    _refused("phi3", {"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0],
                                          "long_factor": [1.0, 2.0], "partial_rotary_factor": 0.5}},
             "short_factor must hold 2 numbers")
    _refused("olmo2", {"hidden_act": "gelu"}, "hidden_act='gelu'")
    _refused("gemma2", {"sliding_window": 0}, "sliding_window=0")
    _refused("mistral", {"model_type": "bert"}, "model_type='bert' (an unsupported model type; supported: gpt2, "
                                                "llama, mistral, qwen2")


def test_export_refuses_what_the_family_cannot_hold():
    cfg = config_from_hf(CONFIGS["mistral"]().to_dict())
    for changes, needle in [(dict(qk_norm="head"), "MistralForCausalLM equivalent: qk_norm='head' (needs 'none')"),
                            (dict(layer_types=("full_attention", "sliding_attention")), "layer_types"),
                            (dict(family="qwen2"), "qkv_bias=False (needs True)")]:
        with pytest.raises(TensorparError, match=needle.replace("(", r"\(").replace(")", r"\)")):
            config_to_hf(cfg.replace(**changes))
    gemma3 = config_from_hf(CONFIGS["gemma3_text"]().to_dict())
    with pytest.raises(TensorparError, match="rope_local_theta=None"):
        config_to_hf(gemma3.replace(rope_local_theta=None))


def test_gemma3s_attention_soft_cap_is_left_unapplied_as_transformers_leaves_it(tmp_path):
    """Gemma3TextConfig takes attn_logit_softcapping and Gemma3Attention never applies it: a folder that sets it
    loads with a warning and gives transformers' logits (applying the cap of 0.5 moves them by 0.4, relative); a
    config with the cap set has no Gemma 3 equivalent to export."""
    from family_models import hf_model

    model = hf_model("gemma3_text", 5)
    model.config.attn_logit_softcapping = 0.5
    model.save_pretrained(tmp_path / "hf", safe_serialization=True)
    with pytest.warns(UserWarning, match="attn_logit_softcapping=0.5 is not applied: transformers' Gemma3ForCausalLM"):
        cfg, state = load_hf_folder(str(tmp_path / "hf"))
    assert cfg.attn_logit_softcap is None
    ours = Transformer(cfg, init=False)
    load_full_state_dict(ours, state, "test")
    ids = torch.randint(0, cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = model(ids).logits
        assert rel_err(ours.eval()(ids), expected) <= TOL
        capped = Transformer(cfg.replace(attn_logit_softcap=0.5), init=False)
        load_full_state_dict(capped, state, "test")
        assert rel_err(capped.eval()(ids), expected) > 100 * TOL  # the cap binds: leaving it out is what matters
    with pytest.raises(TensorparError, match=r"attn_logit_softcap=0.5 \(needs None"):
        config_to_hf(cfg.replace(attn_logit_softcap=0.5))


def test_unsupported_model_type_is_named_before_any_rank_starts(cli, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert"}))
    (tmp_path / "model.safetensors").write_bytes(b"")
    code, _, err = cli("eval", "--checkpoint", tmp_path, "--data", tmp_path / "config.json", "--seq-len", "8")
    assert code == 2 and "model_type='bert' (an unsupported model type; supported: gpt2, llama" in err, err
    assert len(err.strip().splitlines()) == 1
