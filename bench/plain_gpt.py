"""The peer of bench/tp_step.py: a plain PyTorch GPT-2-style model (the dense reference every variant starts from)
and its PyTorch-native tensor parallelism (DTensor `parallelize_module`, split as torchtitan splits it)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class Attention(nn.Module):
    def __init__(self, hidden: int, n_heads: int):
        super().__init__()
        self.n_heads, self.head_dim = n_heads, hidden // n_heads  # n_heads becomes the local count under TP
        self.q_proj = nn.Linear(hidden, hidden)
        self.k_proj = nn.Linear(hidden, hidden)
        self.v_proj = nn.Linear(hidden, hidden)
        self.o_proj = nn.Linear(hidden, hidden)

    def forward(self, x):
        b, s, _ = x.shape
        # Under ColwiseParallel (use_local_output=True) q/k/v are this rank's local [B, S, H / tp].
        q = self.q_proj(x).view(b, s, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, s, self.n_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, s, self.n_heads, self.head_dim).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, self.n_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, hidden: int, ffn: int):
        super().__init__()
        self.fc1 = nn.Linear(hidden, ffn)
        self.fc2 = nn.Linear(ffn, hidden)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, hidden: int, n_heads: int, ffn: int, eps: float):
        super().__init__()
        self.attn_norm = nn.LayerNorm(hidden, eps=eps)
        self.attn = Attention(hidden, n_heads)
        self.mlp_norm = nn.LayerNorm(hidden, eps=eps)
        self.mlp = MLP(hidden, ffn)

    def forward(self, x):
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class PlainGPT(nn.Module):
    """GPT-2 style: learned positions, pre-LN blocks, gelu-tanh MLP, final LN, head tied to the embedding.
    `fp32_loss`: the cross-entropy over the logits cast to fp32, as torchtitan computes it (components/loss.py);
    else over the logits in the parameters' dtype, as a plain script does."""

    def __init__(self, cfg, fp32_loss: bool = False):
        super().__init__()
        self.fp32_loss = fp32_loss
        h = cfg.hidden_size
        self.embed = nn.Embedding(cfg.vocab_size, h)
        self.pos_embed = nn.Parameter(torch.zeros(cfg.max_seq_len, h))
        self.layers = nn.ModuleList(
            Block(h, cfg.num_heads, cfg.ffn_hidden_size, cfg.norm_eps) for _ in range(cfg.num_layers)
        )
        self.final_norm = nn.LayerNorm(h, eps=cfg.norm_eps)

    @torch.no_grad()
    def init_gpt2(self, std: float, num_layers: int) -> None:
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith(".bias"):
                p.zero_()
            elif name.endswith(("attn.o_proj.weight", "mlp.fc2.weight")):
                p.normal_(0.0, std / math.sqrt(2 * num_layers))
            else:
                p.normal_(0.0, std)

    def forward(self, ids, targets):
        h = self.embed(ids) + self.pos_embed[: ids.shape[1]]
        for layer in self.layers:
            h = layer(h)
        logits = F.linear(self.final_norm(h), self.embed.weight)
        if self.fp32_loss:
            logits = logits.float()
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def to_tensorpar_names(state: dict) -> dict:
    """The plain model's state dict under tensorpar's parameter names (only the MLP differs)."""
    renames = {".mlp.fc1.": ".mlp.up_proj.", ".mlp.fc2.": ".mlp.down_proj."}
    out = {}
    for name, t in state.items():
        for old, new in renames.items():
            name = name.replace(old, new)
        out[name] = t
    return out


def parallelize_dtensor(model: PlainGPT, mesh) -> None:
    """PyTorch-native TP of the blocks (torchtitan's plan); embedding, head and loss stay replicated."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    plan = {
        "attn.q_proj": ColwiseParallel(),
        "attn.k_proj": ColwiseParallel(),
        "attn.v_proj": ColwiseParallel(),
        "attn.o_proj": RowwiseParallel(),
        "mlp.fc1": ColwiseParallel(),
        "mlp.fc2": RowwiseParallel(),
    }
    tp = mesh.size()
    for block in model.layers:
        parallelize_module(block, mesh, plan)
        # Colwise outputs are local shards (use_local_output=True): the reshape must use the local head count.
        block.attn.n_heads = block.attn.n_heads // tp
