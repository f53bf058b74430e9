"""Hugging Face Mixtral and Qwen2-MoE folders against transformers itself: import, export, and `tensorpar eval` /
`tensorpar generate` at TP 1/2 and EP 1/2/3.

Two tiny random models are written by transformers' `save_pretrained` (every parameter perturbed, routers
included, so that routing is decided and zero biases cannot hide a wrong mapping): Mixtral with 6 experts,
top-2 and grouped-query attention; Qwen2-MoE with 6 experts, top-2 without renormalisation, q/k/v biases, a
shared expert twice the expert width behind its sigmoid gate, and decoder_sparse_step 2 (layer 0 dense).
Everything runs on the shared process pools, the commands included (as their ranks run them).
"""

import dataclasses
import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file, save_file  # noqa: E402

from tensorpar.models.placement import Placement
from tensorpar.checkpoints.hf import check_hf_folder, load_hf_folder, save_hf_folder  # noqa: E402
from tensorpar.checkpoints.hf_config import check_representable, config_from_hf, config_to_hf  # noqa: E402
from tensorpar.cli import main  # noqa: E402
from tensorpar.commands.common import inference_layout  # noqa: E402
from tensorpar.config.options import EvalOptions, GenerateOptions  # noqa: E402
from tensorpar.distributed.launch import world_size  # noqa: E402
from tensorpar.errors import LayoutError, TensorparError  # noqa: E402
from tensorpar.models import Transformer, get_config, load_full_state_dict  # noqa: E402

from harness import mesh, run_cli  # noqa: E402
from hf_references import generate_in_worker, on_ranks, saved_references  # noqa: E402
from test_eval import evaluate_in_worker  # noqa: E402

TOL = 1e-5
VOCAB, SEQ, WINDOWS = 200, 16, 6
PROMPTS = [[5, 17, 42, 8], [99, 3, 150, 61, 7, 120, 33]]
NEW_TOKENS = 6
COMMON = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=64, bos_token_id=None, eos_token_id=None, pad_token_id=None)
HF_CONFIGS = {
    "mixtral": lambda: transformers.MixtralConfig(**COMMON, intermediate_size=48, num_local_experts=6,
                                                  num_experts_per_tok=2, router_aux_loss_coef=0.02),
    "qwen2_moe": lambda: transformers.Qwen2MoeConfig(**COMMON, intermediate_size=64, moe_intermediate_size=24,
                                                     shared_expert_intermediate_size=48, num_experts=6,
                                                     num_experts_per_tok=2, decoder_sparse_step=2),
}


def _hf_model(name):
    config = HF_CONFIGS[name]()
    config._attn_implementation = "eager"
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return model


def _seeded_model(i: int, name: str):
    torch.manual_seed(200 + i)
    return _hf_model(name)


@pytest.fixture(scope="module")
def hf_moe(tmp_path_factory):
    """name -> {folder, loss (transformers' mean next-token loss over the windows), tokens (greedy, per prompt)};
    and "data": the token file."""
    return saved_references(tmp_path_factory.mktemp("hf_moe"), HF_CONFIGS, _seeded_model, vocab=VOCAB, seq=SEQ,
                            windows=WINDOWS, prompts=PROMPTS, new_tokens=NEW_TOKENS)


# -- import and export ----------------------------------------------------------------------------


def test_configs_map_to_tensorpar(hf_moe):
    mixtral, _ = load_hf_folder(hf_moe["mixtral"]["folder"])
    # output_router_logits false (its default): transformers trains without the load-balancing loss, and so do we
    assert (mixtral.num_experts, mixtral.experts_per_token, mixtral.kv_heads, mixtral.norm_topk_prob,
            mixtral.num_shared_experts, mixtral.attention_qkv_bias, mixtral.router_aux_loss_coef) == \
        (6, 2, 2, True, 0, False, 0.0)
    for name in HF_CONFIGS:
        hf = HF_CONFIGS[name]()
        hf.output_router_logits = True
        assert config_from_hf(hf.to_dict()).router_aux_loss_coef == hf.router_aux_loss_coef > 0
        assert config_to_hf(config_from_hf(hf.to_dict()))["output_router_logits"] is True
    qwen, _ = load_hf_folder(hf_moe["qwen2_moe"]["folder"])
    assert (qwen.num_experts, qwen.norm_topk_prob, qwen.num_shared_experts, qwen.shared_expert_gate, qwen.qkv_bias,
            qwen.bias, qwen.moe_layer_freq, qwen.expert_ffn_size, qwen.ffn_hidden_size) == \
        (6, False, 2, True, True, False, 2, 24, 64)
    assert [qwen.is_moe_layer(i) for i in range(2)] == [False, True]


@pytest.mark.parametrize("name", list(HF_CONFIGS))
def test_export_round_trips_and_transformers_loads_it(hf_moe, tmp_path, name):
    folder = hf_moe[name]["folder"]
    cfg, state = load_hf_folder(folder)
    assert check_hf_folder(folder) == cfg  # the launcher's header-only check agrees
    save_hf_folder(tmp_path / "out", cfg, state)
    original, exported = load_file(f"{folder}/model.safetensors"), load_file(str(tmp_path / "out/model.safetensors"))
    assert set(exported) == set(original)  # the Hub's per-expert names, as save_pretrained writes them
    assert all(torch.equal(exported[k], original[k]) for k in original)
    cfg2, state2 = load_hf_folder(tmp_path / "out")
    assert cfg2 == cfg and all(torch.equal(state2[k], state[k]) for k in state)

    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    expected = hf_moe[name]["model"].state_dict()
    got = reloaded.state_dict()
    assert set(got) == set(expected) and all(torch.equal(got[k], expected[k]) for k in expected)


@pytest.mark.parametrize("name", list(HF_CONFIGS))
def test_one_backward_gives_transformers_gradients(hf_moe, name):
    """Without output_router_logits transformers adds no load-balancing loss in training: neither does tensorpar, so
    every gradient is transformers' (the router's included)."""
    from tensorpar.checkpoints.hf import hf_to_tensorpar

    hf = hf_moe[name]["model"]
    cfg, state = load_hf_folder(hf_moe[name]["folder"])
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(3))
    targets = torch.cat([ids[:, 1:], torch.full((2, 1), -100)], dim=1)
    hf.zero_grad()
    hf.train()
    hf(ids, labels=ids).loss.backward()
    hf.eval()
    model = Transformer(cfg, init=False)
    load_full_state_dict(model, state, "test")
    model(ids, targets).backward()
    expected = hf_to_tensorpar({k: p.grad for k, p in hf.named_parameters()}, cfg)  # transformers' fused experts
    for key, p in model.named_parameters():
        ref = expected[key]
        assert (p.grad - ref).norm() <= TOL * ref.norm(), (key, (p.grad - ref).norm() / ref.norm())



@pytest.mark.parametrize("name", list(HF_CONFIGS))
def test_transformers_in_memory_fused_layout_loads_too(hf_moe, tmp_path, name):
    """transformers 5 holds experts fused (gate_up_proj [E, 2F, H], down_proj [E, H, F]); a folder saved that way
    loads to the same tensors as the Hub layout."""
    folder = hf_moe[name]["folder"]
    fused = {k: v.contiguous() for k, v in hf_moe[name]["model"].state_dict().items()}
    assert any(k.endswith("experts.gate_up_proj") for k in fused)
    (tmp_path / "fused").mkdir()
    save_file(fused, str(tmp_path / "fused/model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "fused/config.json").write_text(open(f"{folder}/config.json").read())
    _, state = load_hf_folder(folder)
    _, state2 = load_hf_folder(tmp_path / "fused")
    assert set(state2) == set(state) and all(torch.equal(state2[k], state[k]) for k in state)


def _refused(hf: dict, needle: str):
    with pytest.raises(TensorparError, match=needle):
        config_from_hf(hf)


def test_fields_tensorpar_cannot_represent_are_refused():
    mixtral, qwen = HF_CONFIGS["mixtral"]().to_dict(), HF_CONFIGS["qwen2_moe"]().to_dict()
    _refused({**mixtral, "sliding_window": 32}, "sliding_window=32")
    assert config_from_hf({**mixtral, "sliding_window": 64}).num_experts == 6  # covers every position: no effect
    _refused({**mixtral, "router_jitter_noise": 0.1}, "router_jitter_noise")
    _refused({**qwen, "use_sliding_window": True, "sliding_window": 8, "layer_types": None}, "sliding_window=8")
    dense = config_from_hf({**qwen, "mlp_only_layers": [1]})  # layer 1 keeps a dense MLP
    assert dense.mlp_only_layers == (1,) and [dense.is_moe_layer(i) for i in range(2)] == [False, False]
    assert config_from_hf({**qwen, "mlp_only_layers": [0]}).mlp_only_layers == ()  # layer 0 is dense anyway
    _refused({**qwen, "shared_expert_intermediate_size": 30}, "shared_expert_intermediate_size=30")


def test_export_refuses_what_mixtral_and_qwen2_moe_cannot_hold():
    with pytest.raises(TensorparError, match="Qwen2MoeForCausalLM.*shared_expert_gate=False"):
        check_representable(get_config("tiny-moe"))  # shared experts without a gate
    mixtral = get_config("mixtral-8x7b")
    check_representable(mixtral)
    assert config_to_hf(mixtral)["architectures"] == ["MixtralForCausalLM"]
    with pytest.raises(TensorparError, match="MixtralForCausalLM.*capacity_factor=1.25.*norm_topk_prob=False"):
        check_representable(mixtral.replace(capacity_factor=1.25, norm_topk_prob=False))
    # DeepSeek-V3's dense first layers and routed scaling: transformers would compute another model from the folder
    qwen = get_config("qwen-moe-a2.7b")
    for cfg in (mixtral, qwen, get_config("qwen3-30b-a3b")):
        with pytest.raises(TensorparError, match="first_k_dense_replace=1 \\(needs 0\\)"):
            check_representable(cfg.replace(first_k_dense_replace=1))
        with pytest.raises(TensorparError, match="routed_scaling_factor=2.5 \\(needs 1.0\\)"):
            check_representable(cfg.replace(routed_scaling_factor=2.5))


# -- layouts ------------------------------------------------------------------------------------


def test_bad_expert_layouts_are_refused_before_any_process(hf_moe):
    cfg, _ = load_hf_folder(hf_moe["mixtral"]["folder"])
    options = EvalOptions(checkpoint="x", seq_len=SEQ)
    assert inference_layout(dataclasses.replace(options, tp=2, ep=3), cfg)[0].dp == 3  # 6 ranks: tp 2 x dp 3
    assert inference_layout(dataclasses.replace(options, tp=2, ep=2), cfg)[0].dp == 1
    assert inference_layout(dataclasses.replace(options, expert_tp=2), cfg)[0].dp == 2  # each expert over 2 ranks
    assert inference_layout(dataclasses.replace(options, tp=2, ep=3, expert_tp=2), cfg)[0].dp == 3
    with pytest.raises(LayoutError, match=r"expert_ffn_size = 48 is not divisible by the expert-TP size 5; .*\[1, 2,"):
        inference_layout(dataclasses.replace(options, expert_tp=5), cfg)[0]
    with pytest.raises(LayoutError, match="--expert-tp must be a positive integer, got 0"):
        inference_layout(dataclasses.replace(options, expert_tp=0), cfg)[0]
    with pytest.raises(LayoutError, match=r"not divisible by the expert-parallel size 4.*\[1, 2, 3, 6\]"):
        inference_layout(dataclasses.replace(options, ep=4), cfg)[0]
    with pytest.raises(LayoutError, match=r"ep=3 does not fold onto the 2 ranks.*valid: \[1, 2\]"):
        inference_layout(dataclasses.replace(options, tp=2, dp=1, ep=3), cfg)[0]
    with pytest.raises(LayoutError, match="needs a mixture-of-experts model"):
        inference_layout(dataclasses.replace(options, ep=2), get_config("tiny"))[0]


def test_commands_refuse_a_bad_ep_in_the_launching_process(hf_moe, capsys):
    """The checks run in the launching process (here, in-process: no rank is ever started)."""
    folder = hf_moe["mixtral"]["folder"]
    assert main(["eval", "--checkpoint", folder, "--data", hf_moe["data"], "--seq-len", str(SEQ), "--ep", "4"]) == 2
    assert "EP sizes that divide it: [1, 2, 3, 6]" in capsys.readouterr().err
    assert main(["generate", "--checkpoint", folder, "--prompt-ids", "1,2", "--max-new-tokens", "2", "--tp", "2",
                 "--dp", "1", "--ep", "3"]) == 2
    assert "ep=3 does not fold onto the 2 ranks" in capsys.readouterr().err


# -- eval and generate ----------------------------------------------------------------------------


@pytest.mark.parametrize("name,layouts", [  # (tp, ep, expert_tp)
    ("mixtral", [(1, 1, 1), (1, 2, 1), (1, 3, 1), (2, 1, 1), (2, 2, 1), (2, 1, 2), (1, 1, 2)]),
    ("qwen2_moe", [(1, 3, 1), (2, 2, 1), (2, 1, 2)]),
])
def test_eval_loss_matches_transformers_at_any_tp_ep_and_expert_tp(pools, hf_moe, name, layouts):
    expected = hf_moe[name]["loss"]
    for tp, ep, expert_tp in layouts:
        result = on_ranks(pools, evaluate_in_worker, checkpoint=hf_moe[name]["folder"], data=hf_moe["data"],
                          seq_len=SEQ, tp=tp, ep=ep, expert_tp=expert_tp, batch_size=4)
        for rank, r in enumerate(result):
            assert r["tokens"] == WINDOWS * SEQ
            assert abs(r["loss"] - expected) <= TOL * expected, (name, tp, ep, expert_tp, rank, r["loss"], expected)


def _command_at_ep_2(pools, hf_moe, name, argv):
    """`tensorpar ARGV --ep 2` (tp 1): what its launching process decides (two ranks: dp 2, as folded) and what those
    ranks print, run by a pool's two ranks. The shell start of eval and generate: tests/test_eval.py and
    tests/test_generation.py."""
    cfg, _ = load_hf_folder(hf_moe[name]["folder"])
    options = (EvalOptions if argv[0] == "eval" else GenerateOptions)(checkpoint=hf_moe[name]["folder"], ep=2)
    assert world_size(inference_layout(options, cfg)[0]) == 2
    outputs = pools(2).run(run_cli, [*argv, "--checkpoint", hf_moe[name]["folder"], "--ep", "2"])
    assert all(code == 0 for code, _, _ in outputs), outputs
    return outputs[0][1]


def test_eval_command_at_ep_2(pools, hf_moe):
    """tp 1, ep 2 takes two ranks (dp 2, each evaluating half the batches)."""
    out = _command_at_ep_2(pools, hf_moe, "qwen2_moe", ["eval", "--data", hf_moe["data"], "--seq-len", SEQ,
                                                         "--batch-size", "2"])
    result = json.loads(out.strip().splitlines()[-1])
    assert abs(result["loss"] - hf_moe["qwen2_moe"]["loss"]) <= TOL * hf_moe["qwen2_moe"]["loss"]


@pytest.mark.parametrize("name,tp,ep,expert_tp", [("mixtral", 1, 1, 1), ("mixtral", 1, 3, 1), ("mixtral", 2, 2, 1),
                                                  ("mixtral", 2, 1, 2), ("qwen2_moe", 1, 2, 1), ("qwen2_moe", 2, 1, 1),
                                                  ("qwen2_moe", 1, 1, 2)])
def test_greedy_generate_matches_transformers(pools, hf_moe, name, tp, ep, expert_tp):
    results = on_ranks(pools, generate_in_worker, prompts=PROMPTS, new_tokens=NEW_TOKENS,
                       checkpoint=hf_moe[name]["folder"], tp=tp, ep=ep, expert_tp=expert_tp)
    assert all(r == hf_moe[name]["tokens"] for r in results), (results, hf_moe[name]["tokens"])


def test_generate_command_at_ep_2(pools, hf_moe):
    out = _command_at_ep_2(pools, hf_moe, "mixtral", ["generate", "--greedy", "--json", "--max-new-tokens",
                                                       NEW_TOKENS, *[a for p in PROMPTS for a in
                                                                     ("--prompt-ids", ",".join(map(str, p)))]])
    lines = [json.loads(line) for line in out.strip().splitlines()]
    assert [line["ids"] for line in lines] == hf_moe["mixtral"]["tokens"]


def gradients_in_worker(folder, tp, sequence_parallel, ids):
    """(loss, gradients of the replicated MoE parameters) of one training forward/backward at this TP size."""
    cfg, state = load_hf_folder(folder)
    model = Transformer(cfg, Placement.on(mesh(tp=tp), sequence_parallel=sequence_parallel), init=False)
    load_full_state_dict(model, state, "test")
    loss = model(ids[:, :-1], ids[:, 1:])
    loss.backward()
    return loss.item(), {n: p.grad for n, p in model.named_parameters() if n.endswith(("shared_expert_gate",
                                                                                       "router.weight"))}


def test_shared_expert_gate_gradient_at_tp2_with_sequence_parallelism(pools, hf_moe):
    """The gate sees a sequence shard per TP rank under SP: its gradient is summed over TP (copy_to_tp)."""
    ids = torch.randint(0, VOCAB, (2, SEQ + 1), generator=torch.Generator().manual_seed(3))
    folder = hf_moe["qwen2_moe"]["folder"]
    loss, grads = gradients_in_worker(folder, 1, False, ids)
    assert any(n.endswith("shared_expert_gate") for n in grads)
    for rank_loss, rank_grads in pools(2).run(gradients_in_worker, folder, 2, True, ids):
        assert abs(rank_loss - loss) <= TOL * loss
        for name, grad in grads.items():
            torch.testing.assert_close(rank_grads[name], grad, rtol=1e-5, atol=1e-7, msg=name)


def test_qwen2_moe_without_qkv_biases_loads_and_exports(tmp_path):
    """Qwen2MoeConfig(qkv_bias=False) has no q/k/v biases: a folder saved so loads (it was refused as having 'no
    Hugging Face Qwen2MoeForCausalLM equivalent'), computes transformers' logits and exports with qkv_bias false."""
    hf_config = transformers.Qwen2MoeConfig(**COMMON, intermediate_size=64, moe_intermediate_size=24,
                                            shared_expert_intermediate_size=48, num_experts=4, num_experts_per_tok=2,
                                            qkv_bias=False)
    hf_config._attn_implementation = "eager"
    torch.manual_seed(7)
    model = transformers.AutoModelForCausalLM.from_config(hf_config).float().eval()
    model.save_pretrained(tmp_path / "in")
    cfg, state = load_hf_folder(tmp_path / "in")
    assert (cfg.attention_qkv_bias, cfg.num_shared_experts, cfg.shared_expert_gate) == (False, 2, True)
    ids = torch.randint(0, VOCAB, (2, SEQ))
    ours = Transformer(cfg, mesh(tp=1))
    load_full_state_dict(ours, state)
    with torch.no_grad():
        assert torch.allclose(ours.eval()(ids)[..., :VOCAB], model(ids).logits, atol=TOL)
    save_hf_folder(tmp_path / "out", cfg, state)
    assert json.loads((tmp_path / "out/config.json").read_text())["qkv_bias"] is False
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert all(torch.equal(reloaded.state_dict()[k], v) for k, v in model.state_dict().items())
