"""Model configurations as plain data, and the named presets.

One dataclass covers both families: GPT-2 (LayerNorm, learned positions, gelu_new MLP, biases,
tied embeddings) and Llama (RMSNorm, RoPE, SwiGLU, grouped-query attention, no biases).
The course slides' ReLU MLP is ``activation="relu"``.

Mixture-of-experts models (Mixtral, Qwen-MoE) are the same dataclass with ``num_experts > 0``: every
``moe_layer_freq``-th layer's MLP becomes a router over ``num_experts`` expert MLPs of width
``moe_ffn_hidden_size``, of which each token uses ``experts_per_token``, plus ``num_shared_experts``
experts every token uses (tensorpar.expert_parallel). The default, ``num_experts=0``, is a dense model.

The DeepSeek-V3 class (DeepSeek-V3, Kimi K2, GLM-4.5; docs/deepseek.md) adds, grouped below: multi-head latent
attention (``kv_lora_rank`` set: tensorpar.layers.latent_attention), partial rotary embeddings, the auxiliary-loss-free
router bias and its update, group-limited top-k, the routed experts' scaling, dense first layers and multi-token
prediction (tensorpar.models.mtp).
"""

from __future__ import annotations

import dataclasses
import json

from tensorpar.errors import TensorparError

ACTIVATIONS = ("gelu_new", "gelu", "relu", "silu")
ROUTER_SCORES = ("softmax", "sigmoid")
FAMILIES = ("gpt2", "llama", "deepseek_v3", "glm4_moe")  # how Hugging Face checkpoints map onto the model


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    family: str  # one of FAMILIES: decides how Hugging Face checkpoints map onto the model
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
    qkv_bias: bool | None = None  # biases on the query/key/value projections only (None: as `bias`; Qwen2: True)
    init_std: float = 0.02
    dropout: float = 0.0  # embedding, residual and attention-probability dropout
    # Mixture of experts (0 experts: a dense model; the rest is then unused).
    num_experts: int = 0  # routed experts per MoE layer
    experts_per_token: int = 2  # top-k
    num_shared_experts: int = 0  # experts every token goes through (one MLP of that many times the expert width)
    shared_expert_gate: bool = False  # Qwen2-MoE: the shared experts' output times sigmoid(x . w), w [1, H]
    moe_ffn_hidden_size: int | None = None  # width of one expert (None: ffn_hidden_size)
    moe_layer_freq: int = 1  # layer i is an MoE layer when (i + 1) % moe_layer_freq == 0 (1: every layer)
    router_score: str = "softmax"  # "softmax" (Mixtral, Qwen-MoE) or "sigmoid" (DeepSeek-V3: top-k weights normalised)
    norm_topk_prob: bool = True  # softmax: renormalise the top-k probabilities to sum to 1 (Mixtral yes, Qwen-MoE no)
    router_aux_loss_coef: float = 0.0  # Switch/GShard load-balancing loss, per sequence
    router_z_loss_coef: float = 0.0  # ST-MoE router z-loss: mean squared logsumexp of the router logits
    capacity_factor: float | None = None  # None: dropless; else each expert takes at most
    #   ceil(capacity_factor * seq_len * experts_per_token / num_experts) tokens of a sequence, the rest are dropped
    # DeepSeek-V3 class (issue 40). Multi-head latent attention when kv_lora_rank is set: queries through a
    # q_lora_rank latent (None: one plain projection), keys and values from one kv_lora_rank latent, each head's key
    # qk_nope_head_dim wide plus a rotary part of qk_rope_head_dim shared by the heads, values v_head_dim wide.
    q_lora_rank: int | None = None
    kv_lora_rank: int | None = None
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = False  # the rotary dimensions as interleaved pairs (DeepSeek's weights), not halves
    partial_rotary_factor: float = 1.0  # RoPE on this fraction of each head's dimensions (GLM-4.5: 0.5)
    first_k_dense_replace: int = 0  # the first k layers keep a dense MLP
    n_group: int = 1  # group-limited routing: experts in n_group groups, tokens choose among the best topk_group
    topk_group: int = 1
    routed_scaling_factor: float = 1.0  # the routed experts' weights are scaled by it
    expert_bias: bool = False  # auxiliary-loss-free balancing: a per-expert bias added to the scores to choose
    bias_update_speed: float = 0.0  # after each step: bias += speed * sign(mean load - expert's load)
    num_mtp_layers: int = 0  # multi-token prediction modules (token t+2, t+3, ...), on the last stage
    mtp_loss_weight: float = 0.1  # their mean loss joins the training objective times this

    def __post_init__(self):
        problems = []
        if self.family not in FAMILIES:
            problems.append(f"family must be one of {FAMILIES}, got {self.family!r}")
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
        if self.position == "rope" and self.rotary_dim % 2:
            problems.append(f"RoPE needs an even number of rotary dimensions, got {self.rotary_dim}")
        if not 0.0 <= self.dropout < 1.0:
            problems.append(f"dropout must be in [0, 1), got {self.dropout}")
        if self.num_experts:
            problems += self._moe_problems()
        problems += self._deepseek_problems()
        if problems:
            raise TensorparError("invalid model config: " + "; ".join(problems))

    def _moe_problems(self) -> list[str]:
        problems = []
        if self.num_experts < 0:
            problems.append(f"num_experts must be >= 0, got {self.num_experts}")
        if not 1 <= self.experts_per_token <= max(self.num_experts, 1):
            problems.append(f"experts_per_token must be between 1 and num_experts ({self.num_experts}), "
                            f"got {self.experts_per_token}")
        if self.num_shared_experts < 0 or self.moe_layer_freq < 1 or self.expert_ffn_size < 1:
            problems.append(f"num_shared_experts >= 0, moe_layer_freq >= 1 and moe_ffn_hidden_size >= 1 needed, got "
                            f"{self.num_shared_experts}, {self.moe_layer_freq}, {self.expert_ffn_size}")
        if self.router_score not in ROUTER_SCORES:
            problems.append(f"router_score must be one of {ROUTER_SCORES}, got {self.router_score!r}")
        if self.router_aux_loss_coef < 0 or self.router_z_loss_coef < 0:
            problems.append("router_aux_loss_coef and router_z_loss_coef must be >= 0")
        if self.shared_expert_gate and not self.num_shared_experts:
            problems.append("shared_expert_gate needs shared experts (num_shared_experts > 0)")
        if self.capacity_factor is not None and not self.capacity_factor > 0:
            problems.append(f"capacity_factor must be positive (or None: dropless), got {self.capacity_factor}")
        return problems

    def _deepseek_problems(self) -> list[str]:
        """The DeepSeek-V3-class fields' rules (multi-head latent attention, routing, multi-token prediction)."""
        problems = []
        if self.is_mla:
            dims = dict(kv_lora_rank=self.kv_lora_rank, qk_nope_head_dim=self.qk_nope_head_dim,
                        qk_rope_head_dim=self.qk_rope_head_dim, v_head_dim=self.v_head_dim)
            if self.q_lora_rank is not None:
                dims["q_lora_rank"] = self.q_lora_rank
            bad = {k: v for k, v in dims.items() if not v > 0}
            if bad:
                problems.append(f"multi-head latent attention needs positive {', '.join(bad)}, got {bad}")
            if self.position != "rope" or self.kv_heads != self.num_heads:
                problems.append("multi-head latent attention needs position='rope' and num_kv_heads = num_heads")
        elif self.q_lora_rank is not None:
            problems.append("q_lora_rank needs multi-head latent attention (kv_lora_rank)")
        if not 0.0 < self.partial_rotary_factor <= 1.0 or (self.is_mla and self.partial_rotary_factor != 1.0):
            problems.append(f"partial_rotary_factor must be in (0, 1] (1 with latent attention, whose rotary part is "
                            f"qk_rope_head_dim), got {self.partial_rotary_factor}")
        if not 0 <= self.first_k_dense_replace <= self.num_layers:
            problems.append(f"first_k_dense_replace must be in [0, num_layers], got {self.first_k_dense_replace}")
        if self.is_moe:
            problems += self._routing_problems()
        if self.num_mtp_layers < 0 or self.mtp_loss_weight < 0:
            problems.append("num_mtp_layers and mtp_loss_weight must be >= 0")
        if self.num_mtp_layers and self.position != "rope":
            problems.append("multi-token prediction needs position='rope' (its modules add no learned positions)")
        return problems

    def _routing_problems(self) -> list[str]:
        """The DeepSeek-V3-class routing fields' rules (group-limited top-k, the balancing bias, the scaling)."""
        problems = []
        if self.n_group < 1 or not 1 <= self.topk_group <= self.n_group or (self.num_experts % self.n_group):
            problems.append(f"group-limited routing needs n_group dividing num_experts {self.num_experts} and "
                            f"1 <= topk_group <= n_group, got n_group={self.n_group}, topk_group={self.topk_group}")
        elif self.n_group > 1 and self.experts_per_token > self.topk_group * (self.num_experts // self.n_group):
            problems.append(f"experts_per_token {self.experts_per_token} exceeds the experts of topk_group "
                            f"{self.topk_group} groups of {self.num_experts // self.n_group}")
        if self.n_group > 1 and self.num_experts // self.n_group < 2:
            problems.append("group-limited routing scores a group by its best two experts: n_group must leave "
                            "at least 2 experts per group")
        if (self.expert_bias or self.n_group > 1) and self.router_score != "sigmoid":
            problems.append("expert_bias and group-limited routing need router_score='sigmoid'")
        if not self.routed_scaling_factor > 0 or self.bias_update_speed < 0:
            problems.append("routed_scaling_factor must be > 0 and bias_update_speed >= 0")
        if self.bias_update_speed and not self.expert_bias:
            problems.append("bias_update_speed needs expert_bias=True")
        return problems

    @property
    def is_mla(self) -> bool:
        """Whether the attention is multi-head latent attention (tensorpar.layers.latent_attention)."""
        return self.kv_lora_rank is not None

    @property
    def rotary_dim(self) -> int:
        """The rotary dimensions of a query or key head: latent attention's qk_rope_head_dim, else the first
        partial_rotary_factor of the head."""
        return self.qk_rope_head_dim if self.is_mla else int(self.head_dim * self.partial_rotary_factor)

    @property
    def num_blocks(self) -> int:
        """Transformer blocks: the layers, then the multi-token prediction modules' blocks (global indices
        num_layers..num_layers + num_mtp_layers - 1)."""
        return self.num_layers + self.num_mtp_layers

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def is_moe_layer(self, layer_index: int) -> bool:
        """Whether layer `layer_index` (0-based) has a mixture of experts instead of a dense MLP."""
        return (self.num_experts > 0 and (layer_index + 1) % self.moe_layer_freq == 0
                and layer_index >= self.first_k_dense_replace)

    @property
    def expert_ffn_size(self) -> int:
        """The hidden width of one expert."""
        return self.moe_ffn_hidden_size or self.ffn_hidden_size

    @property
    def attention_qkv_bias(self) -> bool:
        """Whether the query, key and value projections have biases (the output projection's follow `bias`)."""
        return self.bias if self.qkv_bias is None else self.qkv_bias

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

    def _mlp_parameters(self, f: int) -> int:
        h = self.hidden_size
        return (3 if self.gated_mlp else 2) * h * f + ((2 if self.gated_mlp else 1) * f + h if self.bias else 0)

    def moe_layer_parameters(self, active: bool = False) -> int:
        """Parameters of one MoE layer's MLP part: router, routed experts (only the top-k when `active`), shared
        experts. Routed experts have no biases."""
        e, f, h = self.num_experts, self.expert_ffn_size, self.hidden_size
        routed = (self.experts_per_token if active else e) * (3 if self.gated_mlp else 2) * h * f
        shared = self._mlp_parameters(self.num_shared_experts * f) if self.num_shared_experts else 0
        return e * h + routed + shared + (h if self.shared_expert_gate else 0)

    def attention_parameters(self) -> int:
        """Parameters of one layer's attention (its norm excluded)."""
        h = self.hidden_size
        if self.is_mla:
            heads, qk = self.num_heads, self.qk_nope_head_dim + self.qk_rope_head_dim
            down_bias = self.attention_qkv_bias
            r, c = self.q_lora_rank, self.kv_lora_rank
            q = h * heads * qk if r is None else h * r + (r if down_bias else 0) + r + r * heads * qk
            kv = h * (c + self.qk_rope_head_dim) + ((c + self.qk_rope_head_dim) if down_bias else 0) + c
            kv += c * heads * (self.qk_nope_head_dim + self.v_head_dim)
            return q + kv + heads * self.v_head_dim * h + (h if self.bias else 0)
        kv = self.kv_heads * self.head_dim
        return h * h + 2 * h * kv + h * h + (h + 2 * kv if self.attention_qkv_bias else 0) + (h if self.bias else 0)

    def num_parameters(self, active: bool = False) -> int:
        """Parameters of the dense model (tied embeddings counted once; multi-token prediction modules included);
        MoE models: all experts, or with ``active=True`` those one token uses (the top-k routed experts)."""
        h, f, v = self.hidden_size, self.ffn_hidden_size, self.vocab_size
        mlp = self._mlp_parameters(f)
        norm = h * (2 if self.norm == "layernorm" else 1)
        per_layer = self.attention_parameters() + mlp + 2 * norm
        embed = v * h + (self.max_seq_len * h if self.position == "learned" else 0)
        head = 0 if self.tie_embeddings else v * h
        blocks = self.num_blocks
        moe_layers = sum(self.is_moe_layer(i) for i in range(blocks))
        moe = moe_layers * (self.moe_layer_parameters(active) - mlp)
        mtp = self.num_mtp_layers * (3 * norm + 2 * h * h)  # each module's two input norms, projection, output norm
        return blocks * per_layer + moe + embed + head + norm + mtp

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


def _deepseek(hidden, layers, heads, ffn, vocab, experts, moe_ffn, *, q_lora=1536, kv_lora=512, nope=128, rope=64,
              v=128, theta=10000.0, max_seq=163840, **kw) -> ModelConfig:
    """A DeepSeek-V3-class MoE: latent attention, sigmoid routing with the balancing bias, top-8, one shared expert."""
    defaults = dict(experts_per_token=8, num_shared_experts=1, router_score="sigmoid", expert_bias=True,
                    bias_update_speed=0.001, rope_interleave=True)
    return ModelConfig(
        family="deepseek_v3", vocab_size=vocab, hidden_size=hidden, num_layers=layers, num_heads=heads,
        num_kv_heads=heads, ffn_hidden_size=ffn, max_seq_len=max_seq, norm="rmsnorm", norm_eps=1e-6,
        activation="silu", gated_mlp=True, position="rope", rope_theta=theta, tie_embeddings=False, bias=False,
        num_experts=experts, moe_ffn_hidden_size=moe_ffn, q_lora_rank=q_lora, kv_lora_rank=kv_lora,
        qk_nope_head_dim=nope, qk_rope_head_dim=rope, v_head_dim=v, **{**defaults, **kw})


def _yarn(factor, beta_fast=32.0, beta_slow=1.0) -> dict:
    return {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": 4096, "beta_fast": beta_fast,
            "beta_slow": beta_slow, "mscale": 1.0, "mscale_all_dim": 1.0}


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
    # Mixtures of experts. tiny-moe trains in seconds on CPU: 8 experts (top-2) and one shared expert per layer.
    "tiny-moe": _llama(64, 4, 4, 2, 128, vocab=257, theta=10000.0, max_seq=1024, num_experts=8, experts_per_token=2,
                       num_shared_experts=1, moe_ffn_hidden_size=64, router_aux_loss_coef=0.01,
                       router_z_loss_coef=0.001),
    # Mixtral 8x7B (Jiang et al. 2024) and Qwen1.5-MoE-A2.7B (60 experts, top-4, a 4-expert-wide shared expert behind
    # a sigmoid gate, q/k/v biases), as published on the Hugging Face hub.
    "mixtral-8x7b": _llama(4096, 32, 32, 8, 14336, vocab=32000, theta=1e6, max_seq=32768, num_experts=8,
                           experts_per_token=2, router_aux_loss_coef=0.02),
    "qwen-moe-a2.7b": _llama(2048, 24, 16, 16, 5632, vocab=151936, theta=1e6, max_seq=8192, num_experts=60,
                             experts_per_token=4, num_shared_experts=4, moe_ffn_hidden_size=1408,
                             shared_expert_gate=True, qkv_bias=True, norm_topk_prob=False,
                             router_aux_loss_coef=0.001),
    # DeepSeek-V3 class (docs/deepseek.md). tiny-deepseek trains in seconds on CPU: latent attention, 8 experts in 4
    # groups (a token sees 2), the balancing bias, a dense first layer and one multi-token prediction module.
    "tiny-deepseek": _deepseek(64, 4, 4, 128, 257, 8, 32, q_lora=32, kv_lora=16, nope=16, rope=8, v=16,
                               max_seq=1024, experts_per_token=2, n_group=4, topk_group=2, routed_scaling_factor=2.5,
                               first_k_dense_replace=1, num_mtp_layers=1, router_aux_loss_coef=0.001),
    # DeepSeek-V3 (671B + a 14B MTP module; DeepSeek-AI 2024) and Kimi K2 (1T; 384 experts, 64 heads, one group, no
    # MTP), as published on the Hugging Face hub.
    "deepseek-v3": _deepseek(7168, 61, 128, 18432, 129280, 256, 2048, n_group=8, topk_group=4,
                             routed_scaling_factor=2.5, first_k_dense_replace=3, num_mtp_layers=1,
                             router_aux_loss_coef=0.0001, rope_scaling=_yarn(40.0)),
    "kimi-k2": _deepseek(7168, 61, 64, 18432, 163840, 384, 2048, theta=50000.0, max_seq=131072,
                         routed_scaling_factor=2.827, first_k_dense_replace=1, rope_scaling=_yarn(32.0, 1.0, 1.0)),
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
