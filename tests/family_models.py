"""Small random models of the Llama-style families users bring, built with transformers' own config classes and
saved by its `save_pretrained` once per test session (`families` fixture): the references of
tests/test_hf_families.py (import, export, eval and generate at any TP size) and tests/test_family_training.py
(training at every layout).

Each model has 2 layers of width 32, 4 query heads and 2 KV heads (one for Qwen3: KV heads fewer than TP 2 and 4),
vocabulary 257 (the byte tokenizer's; padded at TP 2 and 4), every parameter perturbed so that zero biases and unit
norms cannot hide a wrong mapping, and what makes its family: Qwen2's q/k/v biases, a sliding window on its upper
layer and dynamic NTK RoPE (max_position_embeddings 12, shorter than the sequences); Qwen3's qk-norm, 16-wide heads,
o_proj bias and yarn; Qwen3-MoE's 4 experts (top-2, renormalised) with layer 0 dense (mlp_only_layers); Mistral's
window on every layer and linear RoPE; Gemma 2's sandwich norms, (1 + w) RMSNorm, GeGLU, scaled embedding,
query_pre_attn_scalar and soft caps small enough to bite, alternating local / global layers; Gemma 3's qk-norm, local
RoPE base and linearly scaled global RoPE, final soft cap; Phi-3's fused projections, window, partial rotary and
longrope (original length 8, so sequences of 16 take the long factors); OLMo 2's norms after the sublayers and
qk-norm over the whole projection, with llama3 RoPE.
"""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from hf_references import saved_references  # noqa: E402

VOCAB, SEQ, WINDOWS, WINDOW = 257, 16, 6, 5
PROMPTS = [[5, 17, 42, 8, 99, 3, 150, 61, 7], [120, 33, 4]]  # longer than the window; the second left-padded
NEW_TOKENS = 10
COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64, bos_token_id=None, eos_token_id=None,
              pad_token_id=None)


def _rope(kind: str, **params) -> dict:
    return {"rope_type": kind, "rope_theta": 10000.0, **params}


CONFIGS = {
    "qwen2": lambda: transformers.Qwen2Config(**{**COMMON, "max_position_embeddings": 12}, use_sliding_window=True,
                                              sliding_window=WINDOW, max_window_layers=1,
                                              rope_parameters=_rope("dynamic", factor=2.0)),
    "qwen3": lambda: transformers.Qwen3Config(**{**COMMON, "num_key_value_heads": 1}, head_dim=16,
                                              attention_bias=True,
                                              rope_parameters=_rope("yarn", factor=4.0,
                                                                    original_max_position_embeddings=16)),
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(**COMMON, head_dim=16, moe_intermediate_size=24, num_experts=4,
                                                     num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[0]),
    "mistral": lambda: transformers.MistralConfig(**COMMON, sliding_window=WINDOW,
                                                  rope_parameters=_rope("linear", factor=2.0)),
    "gemma2": lambda: transformers.Gemma2Config(**COMMON, head_dim=16, query_pre_attn_scalar=24, sliding_window=WINDOW,
                                                attn_logit_softcapping=2.0, final_logit_softcapping=3.0),
    "gemma3_text": lambda: transformers.Gemma3TextConfig(
        **COMMON, head_dim=16, query_pre_attn_scalar=16, sliding_window=WINDOW, final_logit_softcapping=5.0,
        layer_types=["sliding_attention", "full_attention"],
        rope_parameters={"full_attention": _rope("linear", factor=2.0, rope_theta=1e6),
                         "sliding_attention": _rope("default", rope_theta=100.0)}),
    "phi3": lambda: transformers.Phi3Config(**{**COMMON, "max_position_embeddings": 32}, sliding_window=6,
                                            original_max_position_embeddings=8, partial_rotary_factor=0.5,
                                            rope_parameters=_rope("longrope", short_factor=[1.0, 1.5],
                                                                  long_factor=[2.0, 3.0], partial_rotary_factor=0.5)),
    "olmo2": lambda: transformers.Olmo2Config(**COMMON, rope_parameters=_rope(
        "llama3", factor=4.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=16)),
}
NAMES = list(CONFIGS)


def hf_model(name: str, seed: int):
    """A random transformers model of family `name`, every parameter perturbed, eager attention, fp32."""
    config = CONFIGS[name]()
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return model


@pytest.fixture(scope="session")
def families(tmp_path_factory):
    """name -> {folder, loss (transformers' over the token file's windows), tokens (greedy per prompt), model};
    "data": the token file, "windows": its windows."""
    return saved_references(tmp_path_factory.mktemp("families"), NAMES, lambda i, name: hf_model(name, 300 + i),
                            vocab=VOCAB, seq=SEQ, windows=WINDOWS, prompts=PROMPTS, new_tokens=NEW_TOKENS)


def _loaded(folder: str, m):
    """A family's folder loaded as `tensorpar eval` / `generate` build it, on the (cached) mesh `m`."""
    from tensorpar.checkpoints.sources import load_model_source
    from tensorpar.models.build import build_transformer

    cfg, state = load_model_source(folder)
    return build_transformer(cfg, m, weights=state, source=folder).eval()


def eval_in_worker(folders: dict, windows: torch.Tensor, tp: int) -> dict:
    """name -> the eval loss of each family's folder at this TP size, on one cached mesh of the pool (what `tensorpar
    eval` computes: its model builder and evaluation, without a mesh per call)."""
    from harness import mesh
    from tensorpar.config.precision import Precision
    from tensorpar.training.evaluate import evaluate

    m = mesh(tp=tp)
    return {name: evaluate(_loaded(folder, m), windows, 3, m.device, Precision(), dp_group=m.dp_group)
            for name, folder in folders.items()}


def generate_in_worker(folders: dict, tp: int) -> dict:
    """name -> the greedy continuations of PROMPTS (a batch) of each family's folder at this TP size."""
    from harness import mesh
    from tensorpar.inference import generate

    m = mesh(tp=tp)
    return {name: generate(_loaded(folder, m), PROMPTS, NEW_TOKENS) for name, folder in folders.items()}
