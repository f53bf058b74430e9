"""AdamW with the usual two parameter groups: weight decay on matrices, none on biases and norms."""

from __future__ import annotations

import torch
from torch import nn
from torch.optim.adamw import adamw as _adamw

from tensorpar.errors import TensorparError
from tensorpar.optim.adamw_bf16 import adamw_bf16_states


ADAMW_STATE = ("exp_avg", "exp_avg_sq")  # what a parameter's AdamW state holds besides its step (and checkpoints keep)


def takes_weight_decay(param: torch.Tensor | torch.Size) -> bool:
    """Matrices and embeddings (ndim >= 2) decay; biases and norm weights do not. Takes a parameter or its shape
    (ZeRO-3 frees a parameter's storage between uses)."""
    return len(getattr(param, "shape", param)) >= 2


class AdamW:
    """AdamW over parameter groups, stepped by torch's own AdamW arithmetic (`torch.optim.adamw.adamw`, the function
    `torch.optim.AdamW.step` calls: the same results, bit for bit), and holding its state as torch.optim.AdamW does:
    `param_groups` (each with its params, lr, betas, eps, weight_decay) and `state[param] = {"step", "exp_avg",
    "exp_avg_sq"}`.

    Not a `torch.optim.Optimizer`: building one imports torch._dynamo (its methods are wrapped to stay out of
    compiled graphs), which costs every process that trains 1.3 s of start-up on this project's CPU machine, paid
    again by each rank of every run. tensorpar's optimizers (DP/ZeRO buckets, ZeRO-3 units) use only what this
    class keeps.

    The fused kernel runs when every parameter is on CUDA (one kernel for every tensor; the same arithmetic), or
    when every one is in pinned host memory: the masters `--optimizer-offload` moved off a GPU, stepped by torch's
    fused CPU kernel (one vectorised, multithreaded pass per tensor: the role of DeepSpeed's CPU Adam). Otherwise
    the foreach form (on CPU torch runs it as a per-tensor loop, which is what the CPU parity tests were written
    against)."""

    def __init__(self, groups: list[dict], lr: float, betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8,
                 weight_decay: float = 0.0, state_dtype: torch.dtype = torch.float32):
        self.param_groups = [{"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay, **g,
                              "params": list(g["params"])} for g in groups]
        params = [p for g in self.param_groups for p in g["params"]]
        # bf16 moments (--optimizer-state-dtype bf16) step by tensorpar.optim.adamw_bf16 (step counts on the CPU);
        # fp32 ones by torch's AdamW
        self.state_dtype = state_dtype
        self.fused = (bool(params) and state_dtype == torch.float32
                      and (all(p.is_cuda for p in params) or all(p.is_pinned() for p in params)))
        for g in self.param_groups:
            g.update(foreach=not self.fused, fused=self.fused)
        self.state: dict[torch.Tensor, dict] = {}

    def kinds_of(self, name: str, shape) -> tuple[str, ...]:
        """The state the parameter `name` of `shape` keeps (besides its step): what checkpoints save of it."""
        return ADAMW_STATE

    def new_step(self, p: torch.Tensor, value: float = 0.0) -> torch.Tensor:
        """Parameter `p`'s step count where torch.optim.AdamW keeps it (and its kernels expect it): on `p`'s device
        for the fused kernel, a CPU scalar otherwise. Checkpoint loaders build the step they restore with it."""
        if self.fused:
            return torch.tensor(float(value), dtype=torch.float32, device=p.device)
        return torch.tensor(float(value), dtype=_scalar_dtype())

    def _state(self, p: torch.Tensor) -> dict:
        st = self.state.get(p)
        if not st:  # as torch.optim.Adam initialises it
            st = self.state[p] = {"step": self.new_step(p),
                                  **{key: torch.zeros_like(p, memory_format=torch.preserve_format,
                                                           dtype=self.moment_dtype(p)) for key in ADAMW_STATE}}
        for key in ADAMW_STATE:  # moments loaded from a checkpoint are fp32
            if st[key].dtype != self.moment_dtype(p):
                st[key] = st[key].to(self.moment_dtype(p))
        return st

    def moment_dtype(self, p: torch.Tensor) -> torch.dtype:
        """The dtype of `p`'s moments: the parameter's own (torch's AdamW), or bf16 (fp32 parameters only)."""
        return p.dtype if self.state_dtype == torch.float32 else self.state_dtype

    @torch.no_grad()
    def step(self) -> None:
        """One AdamW step of every parameter that has a gradient."""
        for g in self.param_groups:
            params = [p for p in g["params"] if p.grad is not None]
            if not params:
                continue
            states = [self._state(p) for p in params]
            beta1, beta2 = g["betas"]
            if self.state_dtype != torch.float32:
                adamw_bf16_states(params, [p.grad for p in params], [s["exp_avg"] for s in states],
                                  [s["exp_avg_sq"] for s in states], [s["step"] for s in states], beta1=beta1,
                                  beta2=beta2, lr=g["lr"], weight_decay=g["weight_decay"], eps=g["eps"])
                continue
            _adamw(params, [p.grad for p in params], [s["exp_avg"] for s in states],
                   [s["exp_avg_sq"] for s in states], [], [s["step"] for s in states], foreach=g["foreach"],
                   capturable=False, differentiable=False, fused=g["fused"], grad_scale=None, found_inf=None,
                   has_complex=any(torch.is_complex(p) for p in params), amsgrad=False, beta1=beta1, beta2=beta2,
                   lr=g["lr"], weight_decay=g["weight_decay"], eps=g["eps"], maximize=False)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for g in self.param_groups:
            for p in g["params"]:
                if set_to_none:
                    p.grad = None
                elif p.grad is not None:
                    p.grad.zero_()


def _scalar_dtype() -> torch.dtype:
    """The dtype torch.optim keeps a CPU step count in."""
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32


def build_optimizer(
    model: nn.Module,
    lr: float,
    weight_decay: float,
    betas: tuple[float, float] = (0.9, 0.95),
    eps: float = 1e-8,
) -> AdamW:
    """AdamW over `model`'s trainable parameters, in two groups (in this order):

    0. ``weight_decay=weight_decay``: parameters with ndim >= 2 (linear weights, embeddings);
    1. ``weight_decay=0.0``: parameters with ndim < 2 (biases, norm weights and biases).

    Within a group parameters keep `model.named_parameters()` order, so every rank (and every
    TP size) builds the same groups; frozen parameters (``requires_grad=False``) are left out.
    No communication: AdamW is elementwise, so each rank steps its own shards.
    """
    decay, no_decay = [], []
    for _, p in model.named_parameters():
        if p.requires_grad:
            (decay if takes_weight_decay(p) else no_decay).append(p)
    if not decay and not no_decay:
        raise TensorparError(f"build_optimizer: {type(model).__name__} has no trainable parameters")
    groups = [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return adamw(groups, lr=lr, betas=betas, eps=eps)


def adamw(groups: list[dict], lr: float, betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8,
          state_dtype: torch.dtype = torch.float32) -> AdamW:
    """AdamW over parameter groups (each a dict with "params" and its "weight_decay"), its moments in
    `state_dtype`."""
    return AdamW(groups, lr=lr, betas=betas, eps=eps, state_dtype=state_dtype)
