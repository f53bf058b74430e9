"""Muon for the hidden 2-D weights, AdamW for the rest (embeddings, LM head, norms, biases, routers), as Moonlight /
Kimi train with it.

Per Muon weight W with gradient G (torch.optim.Muon's arithmetic, which `newton_schulz` and `Muon.step` follow
operation for operation):

    B <- lerp(B, G, 1 - mu)                  momentum buffer (elementwise)
    U <- lerp(G, B, mu)                      Nesterov direction (elementwise)
    O <- NS5(U)                              Newton-Schulz orthogonalisation of the WHOLE matrix (5 steps,
                                             coefficients 3.4445, -4.7750, 2.0315, after dividing by its norm; in
                                             bf16, or fp32 when training in fp32)
    W <- W * (1 - lr * wd) - lr * 0.2 * sqrt(max(A, B)) * O     Moonlight's scale: the update's RMS matches AdamW's

The two elementwise steps run on whatever piece of W a rank steps (its TP shard, its ZeRO slice). The
orthogonalisation needs the whole A x B matrix: `Muon` hands every piece's U to an orthogonaliser, by default
`WholeMatrices` (each parameter is the whole matrix: one process, or data parallelism without sharding); under
tensor parallelism or ZeRO, tensorpar.data_parallel.muon_matrices gathers each matrix onto the one rank that
orthogonalises it and scatters the result back.
"""

from __future__ import annotations

import math

import torch

from tensorpar.errors import TensorparError
from tensorpar.optim.adamw import ADAMW_STATE, AdamW

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_STEPS = 5
NS_EPS = 1e-7
MUON_STATE = ("momentum_buffer",)
_ADAMW_NAMES = ("embed", "pos_embed", "head", "router")  # 2-D weights that stay with AdamW


def uses_muon(name: str, shape) -> bool:
    """Whether the parameter `name` of `shape` (the model's own, or its TP shard's) is stepped by Muon: the 2-D
    weights of the transformer blocks, except routers (embeddings and the head are outside the blocks)."""
    parts = name.split(".")
    return len(shape) == 2 and parts[0] == "layers" and not any(p in _ADAMW_NAMES for p in parts)


def newton_schulz(update: torch.Tensor, steps: int = NS_STEPS, coefficients=NS_COEFFICIENTS, eps: float = NS_EPS,
                  dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The approximate orthogonalisation U S' V^T (S' ~ 1) of a 2-D `update` = U S V^T: quintic Newton-Schulz on the
    wide orientation, after scaling to unit Frobenius norm (torch.optim.Muon's, Keller Jordan's), in `dtype`: bf16
    as theirs, or fp32 (fp32 training: a few bf16 roundings that differ with the layout's reduction order would
    move the update by ~1e-4, more than the layouts may differ)."""
    a, b, c = coefficients
    x = update.to(dtype)
    tall = update.size(0) > update.size(1)
    if tall:
        x = x.T
    x = x.div(x.norm().clamp(min=eps))
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


def rms_matching_scale(shape) -> float:
    """Moonlight's factor 0.2 * sqrt(max(A, B)) of an A x B weight's update: its RMS then matches AdamW's."""
    return 0.2 * math.sqrt(max(shape[0], shape[1]))


def check_muon(optimizer: str, momentum: float, is_moe: bool) -> None:
    """TensorparError for a Muon run tensorpar cannot train: a momentum outside [0, 1), a mixture of experts."""
    if optimizer != "muon":
        return
    if not 0.0 <= momentum < 1.0:
        raise TensorparError(f"--muon-momentum must lie in [0, 1), got {momentum}")
    if is_moe:
        raise TensorparError("--optimizer muon does not train mixture-of-experts models yet (each expert's matrices "
                             "would need orthogonalising across expert-TP and expert-DP): use --optimizer adamw")


class WholeMatrices:
    """The orthogonaliser of parameters that are whole matrices on this rank; Newton-Schulz in `dtype`."""

    def __init__(self, dtype: torch.dtype = torch.bfloat16):
        self.dtype = dtype

    def dense_shape(self, param: torch.Tensor) -> torch.Size:
        return param.shape

    def __call__(self, directions: dict[torch.Tensor, torch.Tensor]) -> dict[torch.Tensor, torch.Tensor]:
        return {p: newton_schulz(u, dtype=self.dtype) for p, u in directions.items()}


class Muon:
    """Muon over the groups marked ``"muon": True``, AdamW (tensorpar.optim.adamw.AdamW) over the others.

    Holds its state as torch's optimizers do: `param_groups` (every group, with its lr) and `state[param]`
    (AdamW's moments and step; Muon's "momentum_buffer" and a step count). `orthogonalize` maps each Muon
    parameter's direction to its orthogonalised update, and says each one's whole-matrix shape
    (`dense_shape`)."""

    def __init__(self, groups: list[dict], lr: float, betas=(0.9, 0.95), eps: float = 1e-8, momentum: float = 0.95,
                 orthogonalize=None):
        self.adamw = AdamW([g for g in groups if not g.get("muon")], lr=lr, betas=betas, eps=eps)
        self.muon_groups = [{"lr": lr, "momentum": momentum, "weight_decay": 0.0, **g, "params": list(g["params"])}
                            for g in groups if g.get("muon")]
        self.param_groups = self.adamw.param_groups + self.muon_groups
        self.state = self.adamw.state  # one dict: AdamW's parameters and Muon's
        self.orthogonalize = orthogonalize or WholeMatrices()

    def kinds_of(self, name: str, shape) -> tuple[str, ...]:
        """The state the parameter `name` of `shape` keeps (besides its step): Muon's momentum, or AdamW's moments
        (what checkpoints save of it)."""
        return MUON_STATE if uses_muon(name, shape) else ADAMW_STATE

    def new_step(self, p: torch.Tensor, value: float = 0.0) -> torch.Tensor:
        """Parameter `p`'s step count as its optimizer keeps it (`AdamW.new_step`)."""
        return self.adamw.new_step(p, value)

    def _momentum(self, p: torch.Tensor) -> dict:
        st = self.state.get(p)
        if not st:
            st = self.state[p] = {"step": torch.tensor(0.0), "momentum_buffer": torch.zeros_like(p)}
        return st

    @torch.no_grad()
    def step(self) -> None:
        """AdamW's step, then Muon's: momentum, the orthogonaliser (a collective when it gathers), the update."""
        self.adamw.step()
        directions, order = {}, []
        for g in self.muon_groups:
            for p in g["params"]:
                if p.grad is None:
                    continue
                st = self._momentum(p)
                st["step"] += 1
                st["momentum_buffer"].lerp_(p.grad, 1 - g["momentum"])
                directions[p] = p.grad.lerp(st["momentum_buffer"], g["momentum"])
                order.append((p, g))
        updates = self.orthogonalize(directions)
        for p, g in order:
            adjusted = g["lr"] * rms_matching_scale(self.orthogonalize.dense_shape(p))
            p.mul_(1 - g["lr"] * g["weight_decay"])
            p.add_(updates[p].view_as(p), alpha=-adjusted)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.adamw.zero_grad(set_to_none)
        for g in self.muon_groups:
            for p in g["params"]:
                p.grad = None if set_to_none else (p.grad.zero_() if p.grad is not None else None)
