"""Hugging Face DeepSeek-V3 and GLM-4.5 folders against transformers itself: import, export, `tensorpar eval` at TP 1,
2 and 4, EP 2 and TP 2 x EP 2, greedy `tensorpar generate`, and the latent KV cache's size.

Two tiny random models are written by transformers' `save_pretrained`, every parameter and the routers' balancing
biases perturbed (so that routing is decided by them and a wrong mapping shows): DeepSeek-V3 with latent attention
(q_lora_rank, kv_lora_rank, decoupled rotary keys, interleaved rotary weights, v_head_dim != qk_head_dim), YaRN with
mscale, 8 experts in 4 groups of which each token sees 2, routed_scaling_factor 2.5 and a dense first layer;
GLM-4.5 with grouped-query attention, q/k/v biases, 12-wide heads (not hidden / heads) with their query / key norms,
RoPE on half of each head and 8 experts in one group.
"""

import dataclasses

import pytest
import torch

transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file  # noqa: E402

from tensorpar.checkpoints.hf import check_hf_folder, load_hf_folder, save_hf_folder  # noqa: E402
from tensorpar.checkpoints.hf_config import config_from_hf, config_to_hf  # noqa: E402
from tensorpar.errors import TensorparError  # noqa: E402
from tensorpar.inference.kv_cache import KVCache  # noqa: E402
from tensorpar.models import Transformer, get_config, load_full_state_dict  # noqa: E402

from hf_references import generate_in_worker, on_ranks, saved_references  # noqa: E402
from test_eval import evaluate_in_worker  # noqa: E402

TOL = 1e-5
VOCAB, SEQ, WINDOWS = 200, 16, 6
PROMPTS = [[5, 17, 42, 8], [99, 3, 150, 61, 7, 120, 33]]
NEW_TOKENS = 6
COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=3,
              num_attention_heads=4, n_shared_experts=1, n_routed_experts=8, num_experts_per_tok=2,
              first_k_dense_replace=1, max_position_embeddings=64, bos_token_id=None, eos_token_id=None,
              pad_token_id=None)
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16,
        "beta_fast": 32, "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 1.0}
HF_CONFIGS = {
    "deepseek_v3": lambda: transformers.DeepseekV3Config(
        **COMMON, num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, v_head_dim=12,
        qk_nope_head_dim=8, n_group=4, topk_group=2, routed_scaling_factor=2.5, rope_parameters=YARN),
    "glm4_moe": lambda: transformers.Glm4MoeConfig(**COMMON, num_key_value_heads=2, attention_bias=True, head_dim=12,
                                                   use_qk_norm=True),
}


def _hf_model(name):
    config = HF_CONFIGS[name]()
    config._attn_implementation = "eager"
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
        for buffer_name, b in model.named_buffers():
            if buffer_name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn_like(b) * 0.1)
    return model


def _seeded_model(i: int, name: str):
    torch.manual_seed(300 + i)
    return _hf_model(name)


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory):
    """name -> {folder, loss (transformers' mean next-token loss over the windows), tokens (greedy, per prompt),
    model}; and "data": the token file."""
    return saved_references(tmp_path_factory.mktemp("hf_deepseek"), HF_CONFIGS, _seeded_model, vocab=VOCAB, seq=SEQ,
                            windows=WINDOWS, prompts=PROMPTS, new_tokens=NEW_TOKENS)


# -- import and export ----------------------------------------------------------------------------


def test_configs_map_to_tensorpar(hf_models):
    ds, _ = load_hf_folder(hf_models["deepseek_v3"]["folder"])
    assert (ds.is_mla, ds.q_lora_rank, ds.kv_lora_rank, ds.qk_rope_head_dim, ds.v_head_dim, ds.rope_interleave,
            ds.n_group, ds.topk_group, ds.routed_scaling_factor, ds.expert_bias, ds.first_k_dense_replace,
            ds.rope_scaling["rope_type"], ds.num_mtp_layers) == (True, 24, 16, 8, 12, True, 4, 2, 2.5, True, 1,
                                                                  "yarn", 0)  # transformers saves no MTP module
    assert [ds.is_moe_layer(i) for i in range(3)] == [False, True, True]
    glm, _ = load_hf_folder(hf_models["glm4_moe"]["folder"])
    assert (glm.is_mla, glm.kv_heads, glm.qkv_bias, glm.bias, glm.partial_rotary_factor, glm.head_dim, glm.rotary_dim,
            glm.qk_norm, glm.expert_bias) == (False, 2, True, False, 0.5, 12, 6, "head", True)


@pytest.mark.parametrize("name", list(HF_CONFIGS))
def test_export_round_trips_and_transformers_loads_it(hf_models, tmp_path, name):
    folder = hf_models[name]["folder"]
    cfg, state = load_hf_folder(folder)
    assert check_hf_folder(folder) == cfg  # the launcher's header-only check agrees
    save_hf_folder(tmp_path / "out", cfg, state)
    original, exported = load_file(f"{folder}/model.safetensors"), load_file(str(tmp_path / "out/model.safetensors"))
    assert set(exported) == set(original) and all(torch.equal(exported[k], original[k]) for k in original)
    cfg2, state2 = load_hf_folder(tmp_path / "out")
    assert cfg2 == cfg and all(torch.equal(state2[k], state[k]) for k in state)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    expected, got = hf_models[name]["model"].state_dict(), reloaded.state_dict()
    assert set(got) == set(expected) and all(torch.equal(got[k], expected[k]) for k in expected)


def test_multi_token_prediction_modules_export_in_deepseeks_layout(tmp_path):
    """A model with an MTP module writes it as layer num_layers (its block's tensors, enorm / hnorm / eh_proj,
    shared_head.norm and DeepSeek's copies of the embedding and head) and reads it back; transformers' model loads
    the folder (the module is not part of DeepseekV3ForCausalLM: it is left out)."""
    cfg = get_config("tiny-deepseek").replace(num_mtp_layers=1)
    model = Transformer(cfg, None, seed=1)
    state = {k: v.detach() for k, v in model.state_dict().items() if k in dict(model.named_parameters()) or
             k.endswith("expert_bias")}
    save_hf_folder(tmp_path / "mtp", cfg, state)
    written = load_file(str(tmp_path / "mtp/model.safetensors"))
    last = cfg.num_layers
    assert {f"model.layers.{last}.{n}" for n in ("enorm.weight", "hnorm.weight", "eh_proj.weight",
                                                 "shared_head.norm.weight", "embed_tokens.weight",
                                                 "shared_head.head.weight", "self_attn.kv_b_proj.weight",
                                                 "mlp.gate.e_score_correction_bias")} <= set(written)
    cfg2, state2 = load_hf_folder(tmp_path / "mtp")
    assert cfg2.num_mtp_layers == 1 and set(state2) == set(state) and check_hf_folder(tmp_path / "mtp") == cfg2
    assert all(torch.equal(state2[k], state[k]) for k in state)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "mtp")
    assert hf.config.num_hidden_layers == cfg.num_layers


def test_fields_tensorpar_cannot_honour_are_refused():
    ds, glm = HF_CONFIGS["deepseek_v3"]().to_dict(), HF_CONFIGS["glm4_moe"]().to_dict()
    for hf, needle in (({**ds, "attention_bias": True}, "attention_bias=True"),
                       ({**ds, "num_key_value_heads": 2}, "num_key_value_heads=2"),
                       ({**ds, "topk_method": "greedy"}, "topk_method='greedy'"),
                       ({**ds, "rope_parameters": {**YARN, "rope_type": "longrope"}}, "longrope"),
                       ({**glm, "n_shared_experts": 0}, "n_shared_experts=0"),
                       ({**glm, "hidden_act": "gelu"}, "hidden_act")):
        with pytest.raises(TensorparError, match=needle):
            config_from_hf(hf)
    with pytest.raises(TensorparError, match="DeepseekV3ForCausalLM.*expert_bias=False"):
        config_to_hf(get_config("tiny-deepseek").replace(expert_bias=False, bias_update_speed=0.0))
    latent_llama = get_config("tiny").replace(num_kv_heads=4, kv_lora_rank=16, q_lora_rank=16, qk_nope_head_dim=8,
                                              qk_rope_head_dim=8, v_head_dim=16)  # no LlamaForCausalLM tensor names
    with pytest.raises(TensorparError, match="LlamaForCausalLM.*kv_lora_rank=16"):
        config_to_hf(latent_llama)


def test_latent_attention_refuses_the_score_variants_it_would_ignore():
    """Latent attention's scores have their own scale and no window, soft cap or q/k norm: a config asking for one is
    refused, not trained without it."""
    for field, value in (("sliding_window", 4), ("attn_logit_softcap", 2.0), ("query_pre_attn_scalar", 3.0),
                         ("qk_norm", "head")):
        with pytest.raises(TensorparError, match=f"latent attention has no .*{field}"):
            get_config("tiny-deepseek").replace(**{field: value})


# -- eval, generate and the latent cache ----------------------------------------------------------


@pytest.mark.parametrize("name", list(HF_CONFIGS))
def test_eval_loss_matches_transformers_at_tp_1_2_4_ep_2_and_tp2_ep2(pools, hf_models, name):
    expected = hf_models[name]["loss"]
    for tp, ep in ((1, 1), (2, 1), (4, 1), (1, 2), (2, 2)):
        result = on_ranks(pools, evaluate_in_worker, checkpoint=hf_models[name]["folder"], data=hf_models["data"],
                           seq_len=SEQ, tp=tp, ep=ep, batch_size=4)
        for rank, r in enumerate(result):
            assert r["tokens"] == WINDOWS * SEQ
            assert abs(r["loss"] - expected) <= TOL * expected, (name, tp, ep, rank, r["loss"], expected)


@pytest.mark.parametrize("name,tp,ep", [("deepseek_v3", 1, 1), ("deepseek_v3", 2, 2), ("glm4_moe", 2, 1)])
def test_greedy_generate_matches_transformers(pools, hf_models, name, tp, ep):
    results = on_ranks(pools, generate_in_worker, prompts=PROMPTS, new_tokens=NEW_TOKENS,
                       checkpoint=hf_models[name]["folder"], tp=tp, ep=ep)
    assert all(r == hf_models[name]["tokens"] for r in results), (results, hf_models[name]["tokens"])


def test_the_latent_kv_cache_holds_kv_lora_rank_plus_rope_dims_per_token_and_layer(hf_models):
    cfg, state = load_hf_folder(hf_models["deepseek_v3"]["folder"])
    model = Transformer(cfg, None, init=False)
    load_full_state_dict(model, state)
    batch, length = 2, 10
    cache = KVCache.for_model(model, batch, length)
    per_token_layer = cache.memory_bytes() // (4 * batch * length * cfg.num_layers)
    assert per_token_layer == cfg.kv_lora_rank + cfg.qk_rope_head_dim == 24  # not 2 x heads x head dims (80)
    glm_cfg, _ = load_hf_folder(hf_models["glm4_moe"]["folder"])
    glm = KVCache.for_model(Transformer(glm_cfg, None, init=False), batch, length)
    assert glm.memory_bytes() // (4 * batch * length * glm_cfg.num_layers) == 2 * glm_cfg.kv_heads * glm_cfg.head_dim


def test_the_cached_path_of_latent_attention_equals_the_full_forward(hf_models):
    """Prefill then one token at a time through the latent cache: each step's logits are the full forward's."""
    cfg, state = load_hf_folder(hf_models["deepseek_v3"]["folder"])
    model = Transformer(dataclasses.replace(cfg), None, init=False)
    load_full_state_dict(model, state)
    model.eval()
    ids = torch.tensor([PROMPTS[1] + [9, 4, 77]])
    with torch.no_grad():
        full = model(ids)
        cache = KVCache.for_model(model, 1, ids.shape[1])
        steps = [model.forward_cached(ids[:, :5], cache)] + [model.forward_cached(ids[:, i:i + 1], cache)
                                                             for i in range(5, ids.shape[1])]
    for i, logits in enumerate(steps):
        torch.testing.assert_close(logits, full[:, 4 + i], rtol=1e-5, atol=1e-5)
