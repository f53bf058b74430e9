"""Model configurations as plain data (the named presets: `tensorpar.models.presets`).

One dataclass covers both families: GPT-2 (LayerNorm, learned positions, gelu_new MLP, biases,
tied embeddings) and Llama (RMSNorm, RoPE, SwiGLU, grouped-query attention, no biases).
The course slides' ReLU MLP is ``activation="relu"``.

The Llama-style decoders users bring vary it with a few fields, each one fact about the architecture that the layers
compute, whatever the family (docs/models.md lists which each family sets): a head size of its own (`head_size`),
norms of the queries and keys (`qk_norm`), norms before and / or after each sublayer (`norm_placement`), RMSNorm
scaled by (1 + w) (`norm_offset`), a scaled embedding, Gemma's `query_pre_attn_scalar` and soft caps, sliding-window
attention on some or all layers (`sliding_window`, `layer_types`) with a RoPE base of their own (`rope_local_theta`),
partial RoPE and the RoPE scaling types of transformers. `family` names the Hugging Face architecture a checkpoint
maps to (tensorpar.checkpoints.hf_families); the layers never read it.

Mixture-of-experts models (Mixtral, Qwen-MoE) are the same dataclass with ``num_experts > 0``: every
``moe_layer_freq``-th layer's MLP (but those in ``mlp_only_layers``) becomes a router over ``num_experts`` expert
MLPs of width ``moe_ffn_hidden_size``, of which each token uses ``experts_per_token``, plus ``num_shared_experts``
experts every token uses (tensorpar.expert_parallel). The default, ``num_experts=0``, is a dense model.

The DeepSeek-V3 class (DeepSeek-V3, Kimi K2, GLM-4.5; docs/deepseek.md) adds, grouped below: multi-head latent
attention (``kv_lora_rank`` set: tensorpar.layers.latent_attention), the auxiliary-loss-free router bias and its
update, group-limited top-k, the routed experts' scaling, dense first layers and multi-token prediction
(tensorpar.models.mtp).
"""

from __future__ import annotations

import dataclasses

from tensorpar.errors import TensorparError
from tensorpar.functional.rope import scaling_problems

ACTIVATIONS = ("gelu_new", "gelu", "relu", "silu")
ROUTER_SCORES = ("softmax", "sigmoid")
# The Hugging Face architectures a config maps to ("llama" also covers Mixtral and Qwen2-MoE, by their experts).
FAMILIES = ("gpt2", "llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "gemma2", "gemma3_text", "phi3", "olmo2",
            "deepseek_v3", "glm4_moe")
QK_NORMS = ("none", "head", "projection")
NORM_PLACEMENTS = ("pre", "sandwich", "post")
LAYER_TYPES = ("full_attention", "sliding_attention")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    family: str  # the Hugging Face architecture checkpoints map to (FAMILIES); the layers never read it
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
    pad_token_id: int | None = None  # the embedding row lookups never train (transformers' padding_idx), or None
    dropout: float = 0.0  # embedding, residual and attention-probability dropout
    # Variants of the Llama-style decoder (Qwen2/3, Mistral, Gemma 2/3, Phi-3, OLMo 2): docs/models.md.
    head_size: int | None = None  # the width of one head (Hugging Face's head_dim); None: hidden_size / num_heads
    mlp_bias: bool | None = None  # biases on the MLP linears (None: as `bias`)
    qk_norm: str = "none"  # RMSNorm of q and k before RoPE: "head" (each head: Qwen3, Gemma 3), "projection" (OLMo 2)
    norm_placement: str = "pre"  # "pre": x + f(norm(x)); "sandwich": x + norm(f(norm(x))) (Gemma); "post": x + norm(f(x))
    norm_offset: float = 0.0  # RMSNorm scales by (norm_offset + weight): Gemma's 1, its weights stored around 0
    embedding_multiplier: float = 1.0  # the embedding's output times this (Gemma: sqrt(hidden_size))
    query_pre_attn_scalar: float | None = None  # attention scores scaled by its ** -0.5 (None: head size; Gemma)
    attn_logit_softcap: float | None = None  # attention scores -> cap * tanh(scores / cap) (Gemma 2)
    final_logit_softcap: float | None = None  # output logits -> cap * tanh(logits / cap) (Gemma 2)
    sliding_window: int | None = None  # a query sees its own and the sliding_window - 1 positions before it
    layer_types: tuple[str, ...] | None = None  # per layer, LAYER_TYPES (None: every layer slides if a window is set)
    rope_local_theta: float | None = None  # RoPE base of the sliding layers, unscaled (Gemma 3; None: the global one)
    partial_rotary_factor: float = 1.0  # RoPE on this fraction of each head's dimensions (Phi-3.5, GLM-4.5)
    # Mixture of experts (0 experts: a dense model; the rest is then unused).
    num_experts: int = 0  # routed experts per MoE layer
    experts_per_token: int = 2  # top-k
    num_shared_experts: int = 0  # experts every token goes through (one MLP of that many times the expert width)
    shared_expert_gate: bool = False  # Qwen2-MoE: the shared experts' output times sigmoid(x . w), w [1, H]
    moe_ffn_hidden_size: int | None = None  # width of one expert (None: ffn_hidden_size)
    moe_layer_freq: int = 1  # layer i is an MoE layer when (i + 1) % moe_layer_freq == 0 (1: every layer)
    mlp_only_layers: tuple[int, ...] = ()  # layers that keep a dense MLP whatever moe_layer_freq says (Qwen-MoE)
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
    first_k_dense_replace: int = 0  # the first k layers keep a dense MLP
    n_group: int = 1  # group-limited routing: experts in n_group groups, tokens choose among the best topk_group
    topk_group: int = 1
    routed_scaling_factor: float = 1.0  # the routed experts' weights are scaled by it
    expert_bias: bool = False  # auxiliary-loss-free balancing: a per-expert bias added to the scores to choose
    bias_update_speed: float = 0.0  # after each step: bias += speed * sign(mean load - expert's load)
    num_mtp_layers: int = 0  # multi-token prediction modules (token t+2, t+3, ...), on the last stage
    mtp_loss_weight: float = 0.1  # their mean loss joins the training objective times this


    def __post_init__(self):
        # JSON gives lists; a config is plain, comparable data either way.
        for name in ("layer_types", "mlp_only_layers"):
            if isinstance(getattr(self, name), list):
                object.__setattr__(self, name, tuple(getattr(self, name)))
        problems = []
        if self.family not in FAMILIES:
            problems.append(f"family must be one of {FAMILIES}, got {self.family!r}")
        if self.norm not in ("layernorm", "rmsnorm"):
            problems.append(f"norm must be 'layernorm' or 'rmsnorm', got {self.norm!r}")
        if self.position not in ("learned", "rope"):
            problems.append(f"position must be 'learned' or 'rope', got {self.position!r}")
        if self.activation not in ACTIVATIONS:
            problems.append(f"activation must be one of {ACTIVATIONS}, got {self.activation!r}")
        if self.head_size is None and self.hidden_size % self.num_heads:
            problems.append(f"hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads} "
                            f"(give head_size for heads of another width)")
        if self.num_heads % self.kv_heads:
            problems.append(f"num_heads {self.num_heads} is not divisible by num_kv_heads {self.kv_heads}")
        if self.position == "rope" and self.rotary_dim % 2:
            problems.append(f"RoPE needs an even number of rotated dimensions, got {self.rotary_dim}")
        if not 0.0 <= self.dropout < 1.0:
            problems.append(f"dropout must be in [0, 1), got {self.dropout}")
        if self.pad_token_id is not None and not (isinstance(self.pad_token_id, int)
                                                  and 0 <= self.pad_token_id < self.vocab_size):
            problems.append(f"pad_token_id must be a token id below vocab_size {self.vocab_size} or None, got "
                            f"{self.pad_token_id!r}")
        problems += self._variant_problems()
        if self.num_experts:
            problems += self._moe_problems()
        problems += self._deepseek_problems()
        if problems:
            raise TensorparError("invalid model config: " + "; ".join(problems))

    def _variant_problems(self) -> list[str]:
        """What is wrong with the fields of the decoder variants (head size, norms, soft caps, windows, RoPE)."""
        problems = []
        if self.head_size is not None and not (isinstance(self.head_size, int) and self.head_size > 0):
            problems.append(f"head_size must be a positive integer or None, got {self.head_size!r}")
        choices = (("qk_norm", QK_NORMS), ("norm_placement", NORM_PLACEMENTS))
        problems += [f"{name} must be one of {valid}, got {getattr(self, name)!r}" for name, valid in choices
                     if getattr(self, name) not in valid]
        if self.qk_norm != "none" and self.norm != "rmsnorm":
            problems.append("qk_norm is an RMSNorm: it needs norm='rmsnorm'")
        positive = ("query_pre_attn_scalar", "attn_logit_softcap", "final_logit_softcap", "rope_local_theta")
        problems += [f"{name} must be positive or None, got {getattr(self, name)!r}" for name in positive
                     if getattr(self, name) is not None and not getattr(self, name) > 0]
        if not self.embedding_multiplier > 0:
            problems.append(f"embedding_multiplier must be positive, got {self.embedding_multiplier}")
        if self.sliding_window is not None and not (isinstance(self.sliding_window, int) and self.sliding_window > 0):
            problems.append(f"sliding_window must be a positive integer or None, got {self.sliding_window!r}")
        if self.layer_types is not None:
            if len(self.layer_types) != self.num_layers or not set(self.layer_types) <= set(LAYER_TYPES):
                problems.append(f"layer_types must give one of {LAYER_TYPES} for each of the {self.num_layers} "
                                f"layers, got {list(self.layer_types)}")
            elif "sliding_attention" in self.layer_types and self.sliding_window is None:
                problems.append("layer_types has sliding_attention layers but sliding_window is None")
        if not 0.0 < self.partial_rotary_factor <= 1.0:
            problems.append(f"partial_rotary_factor must be in (0, 1], got {self.partial_rotary_factor}")
        if self.position == "rope":
            problems += scaling_problems(self.rope_scaling, self.rotary_dim)
        elif self.rope_local_theta is not None or self.rope_scaling:
            problems.append("rope_scaling and rope_local_theta need position='rope'")
        bad_layers = [i for i in self.mlp_only_layers if not (isinstance(i, int) and 0 <= i < self.num_layers)]
        if bad_layers:
            problems.append(f"mlp_only_layers must be layer indices below {self.num_layers}, got {bad_layers}")
        return problems

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
        if self.is_mla:
            scores = ("sliding_window", "attn_logit_softcap", "query_pre_attn_scalar")
            unused = {name: getattr(self, name) for name in scores if getattr(self, name) is not None}
            if self.qk_norm != "none":
                unused["qk_norm"] = self.qk_norm
            if unused:
                problems.append(f"multi-head latent attention has no sliding window, soft cap, score scalar or q/k "
                                f"norm (its scores are scaled by qk_head_dim^-1/2 and YaRN's mscale), got {unused}")
        if self.is_mla and self.partial_rotary_factor != 1.0:
            problems.append(f"partial_rotary_factor must be 1 with latent attention (its rotary part is "
                            f"qk_rope_head_dim), got {self.partial_rotary_factor}")
        if not 0 <= self.first_k_dense_replace <= self.num_layers:
            problems.append(f"first_k_dense_replace must be in [0, num_layers], got {self.first_k_dense_replace}")
        if self.is_moe:
            problems += self._routing_problems()
        if self.num_mtp_layers < 0 or self.mtp_loss_weight < 0:
            problems.append("num_mtp_layers and mtp_loss_weight must be >= 0")
        if self.num_mtp_layers and (self.position != "rope" or self.layer_types is not None):
            problems.append("multi-token prediction needs position='rope' (its modules add no learned positions) and "
                            "no layer_types (its blocks attend over every position)")
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
                and layer_index not in self.mlp_only_layers and layer_index >= self.first_k_dense_replace)

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
        return self.head_size if self.head_size is not None else self.hidden_size // self.num_heads

    @property
    def rotary_dim(self) -> int:
        """How many dimensions of each head RoPE rotates: latent attention's qk_rope_head_dim, else (transformers)
        int(head_dim * partial_rotary_factor)."""
        return self.qk_rope_head_dim if self.is_mla else int(self.head_dim * self.partial_rotary_factor)

    @property
    def mlp_has_bias(self) -> bool:
        """Whether the MLP's linears (a dense MLP's, the shared experts') have biases."""
        return self.bias if self.mlp_bias is None else self.mlp_bias

    def layer_type(self, layer_index: int) -> str:
        """"sliding_attention" or "full_attention": how layer `layer_index` attends."""
        if self.layer_types is not None:
            return self.layer_types[layer_index]
        return "full_attention" if self.sliding_window is None else "sliding_attention"

    def attention_window(self, layer_index: int) -> int | None:
        """The sliding window of layer `layer_index` (None: it sees every earlier position)."""
        return self.sliding_window if self.layer_type(layer_index) == "sliding_attention" else None

    @property
    def attention_scale(self) -> float | None:
        """The factor of the attention scores (None: 1 / sqrt(head size))."""
        return None if self.query_pre_attn_scalar is None else self.query_pre_attn_scalar ** -0.5

    @property
    def norms_per_layer(self) -> int:
        """Hidden-size norms in a block: 2 before (pre), 2 after (post), 4 around (sandwich)."""
        return 4 if self.norm_placement == "sandwich" else 2

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def _mlp_parameters(self, f: int) -> int:
        h = self.hidden_size
        bias = (2 if self.gated_mlp else 1) * f + h if self.mlp_has_bias else 0
        return (3 if self.gated_mlp else 2) * h * f + bias

    def moe_layer_parameters(self, active: bool = False) -> int:
        """Parameters of one MoE layer's MLP part: router, routed experts (only the top-k when `active`), shared
        experts. Routed experts have no biases."""
        e, f, h = self.num_experts, self.expert_ffn_size, self.hidden_size
        routed = (self.experts_per_token if active else e) * (3 if self.gated_mlp else 2) * h * f
        shared = self._mlp_parameters(self.num_shared_experts * f) if self.num_shared_experts else 0
        return e * h + routed + shared + (h if self.shared_expert_gate else 0)

    def attention_parameters(self) -> int:
        """One attention layer's parameters: the q, k, v and output projections, their biases, the q / k norms (latent
        attention: its down- and up-projections, latent norms and output projection)."""
        if self.is_mla:
            return self._latent_attention_parameters()
        h, q, kv = self.hidden_size, self.num_heads * self.head_dim, self.kv_heads * self.head_dim
        bias = (q + 2 * kv if self.attention_qkv_bias else 0) + (h if self.bias else 0)
        qk_norm = {"none": 0, "head": 2 * self.head_dim, "projection": q + kv}[self.qk_norm]
        return 2 * h * q + 2 * h * kv + bias + qk_norm

    def _latent_attention_parameters(self) -> int:
        h, heads, qk = self.hidden_size, self.num_heads, self.qk_nope_head_dim + self.qk_rope_head_dim
        down_bias, r, c = self.attention_qkv_bias, self.q_lora_rank, self.kv_lora_rank
        q = h * heads * qk if r is None else h * r + (r if down_bias else 0) + r + r * heads * qk
        kv = h * (c + self.qk_rope_head_dim) + ((c + self.qk_rope_head_dim) if down_bias else 0) + c
        kv += c * heads * (self.qk_nope_head_dim + self.v_head_dim)
        return q + kv + heads * self.v_head_dim * h + (h if self.bias else 0)

    def num_parameters(self, active: bool = False) -> int:
        """Parameters of the dense model (tied embeddings counted once; multi-token prediction modules included);
        MoE models: all experts, or with ``active=True`` those one token uses (the top-k routed experts)."""
        h, f, v, L = self.hidden_size, self.ffn_hidden_size, self.vocab_size, self.num_blocks
        mlp = self._mlp_parameters(f)
        norm = h * (2 if self.norm == "layernorm" else 1)
        per_layer = self.attention_parameters() + mlp + self.norms_per_layer * norm
        embed = v * h + (self.max_seq_len * h if self.position == "learned" else 0)
        head = 0 if self.tie_embeddings else v * h
        moe_layers = sum(self.is_moe_layer(i) for i in range(L))
        moe = moe_layers * (self.moe_layer_parameters(active) - mlp)
        mtp = self.num_mtp_layers * (3 * norm + 2 * h * h)  # each module's two input norms, projection, output norm
        return L * per_layer + moe + embed + head + norm + mtp
