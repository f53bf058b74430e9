"""Model configurations as plain data, and the named presets.

One dataclass covers both families: GPT-2 (LayerNorm, learned positions, gelu_new MLP, biases,
tied embeddings) and Llama (RMSNorm, RoPE, SwiGLU, grouped-query attention, no biases).
The course slides' ReLU MLP is ``activation="relu"``.
"""

from __future__ import annotations

import dataclasses
import json

from tensorpar.errors import TensorparError

ACTIVATIONS = ("gelu_new", "gelu", "relu", "silu")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    family: str  # "gpt2" or "llama": decides how Hugging Face checkpoints map onto the model
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    ffn_hidden_size: int
    max_seq_len: int
    num_kv_heads: int | None = None  # None: as many as query heads (multi-head attention)
    norm: str = "layernorm"  # "layernorm" | "rmsnorm"
    norm_eps: float = 1e-5
    activation: str = "gelu_new"
    gated_mlp: bool = False  # SwiGLU-style: act(gate(x)) * up(x)
    position: str = "learned"  # "learned" | "rope"
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # Llama 3.1 style {"rope_type": "llama3", "factor": ..., ...}
    tie_embeddings: bool = True
    bias: bool = True  # biases in the attention and MLP linears
    init_std: float = 0.02
    dropout: float = 0.0  # embedding, residual and attention-probability dropout

    def __post_init__(self):
        problems = []
        if self.family not in ("gpt2", "llama"):
            problems.append(f"family must be 'gpt2' or 'llama', got {self.family!r}")
        if self.norm not in ("layernorm", "rmsnorm"):
            problems.append(f"norm must be 'layernorm' or 'rmsnorm', got {self.norm!r}")
        if self.position not in ("learned", "rope"):
            problems.append(f"position must be 'learned' or 'rope', got {self.position!r}")
        if self.activation not in ACTIVATIONS:
            problems.append(f"activation must be one of {ACTIVATIONS}, got {self.activation!r}")
        if self.hidden_size % self.num_heads:
            problems.append(f"hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads}")
        if self.num_heads % self.kv_heads:
            problems.append(f"num_heads {self.num_heads} is not divisible by num_kv_heads {self.kv_heads}")
        if self.position == "rope" and self.head_dim % 2:
            problems.append(f"RoPE needs an even head dimension, got {self.head_dim}")
        if not 0.0 <= self.dropout < 1.0:
            problems.append(f"dropout must be in [0, 1), got {self.dropout}")
        if problems:
            raise TensorparError("invalid model config: " + "; ".join(problems))

    @property
    def kv_heads(self) -> int:
        return self.num_kv_heads or self.num_heads

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def num_parameters(self) -> int:
        """Parameters of the dense model (tied embeddings counted once)."""
        h, f, v, L = self.hidden_size, self.ffn_hidden_size, self.vocab_size, self.num_layers
        kv = self.kv_heads * self.head_dim
        attn = h * h + 2 * h * kv + h * h + (h + 2 * kv + h if self.bias else 0)
        mlp = (3 if self.gated_mlp else 2) * h * f + ((2 if self.gated_mlp else 1) * f + h if self.bias else 0)
        norm = h * (2 if self.norm == "layernorm" else 1)
        per_layer = attn + mlp + 2 * norm
        embed = v * h + (self.max_seq_len * h if self.position == "learned" else 0)
        head = 0 if self.tie_embeddings else v * h
        return L * per_layer + embed + head + norm


def _gpt2(hidden, layers, heads, **kw) -> ModelConfig:
    return ModelConfig(
        family="gpt2", vocab_size=50257, hidden_size=hidden, num_layers=layers, num_heads=heads,
        ffn_hidden_size=4 * hidden, max_seq_len=1024, **kw,
    )


def _llama(hidden, layers, heads, kv, ffn, vocab=128256, theta=500000.0, tie=False, max_seq=131072, **kw) -> ModelConfig:
    return ModelConfig(
        family="llama", vocab_size=vocab, hidden_size=hidden, num_layers=layers, num_heads=heads, num_kv_heads=kv,
        ffn_hidden_size=ffn, max_seq_len=max_seq, norm="rmsnorm", activation="silu", gated_mlp=True,
        position="rope", rope_theta=theta, tie_embeddings=tie, bias=False, **kw,
    )


_LLAMA3_SCALING = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 8192}

PRESETS: dict[str, ModelConfig] = {
    # Trains in minutes on 2 CPU cores with the byte-level tokenizer (vocabulary 257).
    "tiny": _llama(128, 4, 4, 2, 352, vocab=257, theta=10000.0, max_seq=1024),
    "tiny-gpt2": ModelConfig(family="gpt2", vocab_size=257, hidden_size=128, num_layers=4, num_heads=4,
                             ffn_hidden_size=512, max_seq_len=1024),
    # GPT-2 (Radford et al. 2019), as published on the Hugging Face hub.
    "gpt2-124m": _gpt2(768, 12, 12),
    "gpt2-350m": _gpt2(1024, 24, 16),
    "gpt2-774m": _gpt2(1280, 36, 20),
    "gpt2-1.5b": _gpt2(1600, 48, 25),
    # Llama 3.2 1B (tied embeddings, as published) and Llama 3.1 8B / 70B / 405B.
    "llama-1b": _llama(2048, 16, 32, 8, 8192, tie=True,
                       rope_scaling={**_LLAMA3_SCALING, "factor": 32.0}),
    "llama-8b": _llama(4096, 32, 32, 8, 14336, rope_scaling={**_LLAMA3_SCALING, "factor": 8.0}),
    "llama-70b": _llama(8192, 80, 64, 8, 28672, rope_scaling={**_LLAMA3_SCALING, "factor": 8.0}),
    "llama-405b": _llama(16384, 126, 128, 8, 53248, rope_scaling={**_LLAMA3_SCALING, "factor": 8.0}),
}


def get_config(name_or_path: str) -> ModelConfig:
    """A preset by name, or a ModelConfig saved as JSON (`ModelConfig.to_dict()`)."""
    if name_or_path in PRESETS:
        return PRESETS[name_or_path]
    if name_or_path.endswith(".json"):
        try:
            with open(name_or_path) as f:
                return ModelConfig(**json.load(f))
        except FileNotFoundError:
            raise TensorparError(f"model config file '{name_or_path}' does not exist") from None
        except TypeError as e:
            raise TensorparError(f"model config file '{name_or_path}' is not a tensorpar config: {e}") from None
    raise TensorparError(f"unknown model preset '{name_or_path}'; known presets: {', '.join(PRESETS)}")
