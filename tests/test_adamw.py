"""AdamW parameter groups: weight decay on matrices and embeddings only."""

import copy
import subprocess
import sys

import pytest
import torch
from torch import nn

from tensorpar.errors import TensorparError
from tensorpar.optim import build_optimizer, set_lr
from tensorpar.optim.adamw import AdamW


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.fc = nn.Linear(4, 6)
        self.norm = nn.LayerNorm(6)
        self.head = nn.Linear(6, 3, bias=False)
        self.frozen = nn.Linear(3, 3)
        self.frozen.requires_grad_(False)


def test_build_optimizer_decays_matrices_and_embeddings_only():
    model = Tiny()
    opt = build_optimizer(model, lr=1e-3, weight_decay=0.1, betas=(0.8, 0.9), eps=1e-6)
    assert isinstance(opt, AdamW)
    names = {id(p): n for n, p in model.named_parameters()}
    decay, no_decay = ([names[id(p)] for p in g["params"]] for g in opt.param_groups)
    assert decay == ["emb.weight", "fc.weight", "head.weight"]
    assert no_decay == ["fc.bias", "norm.weight", "norm.bias"]
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
    g = opt.param_groups[0]
    assert (g["lr"], g["betas"], g["eps"], g["foreach"], g["fused"]) == (1e-3, (0.8, 0.9), 1e-6, True, False)

    # three steps (one with a learning rate set in between) equal torch.optim.AdamW's with the same groups, bit for
    # bit, and so do its state's names and values
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(
        [
            {"params": [ref.emb.weight, ref.fc.weight, ref.head.weight], "weight_decay": 0.1},
            {"params": [ref.fc.bias, ref.norm.weight, ref.norm.bias], "weight_decay": 0.0},
        ],
        lr=1e-3, betas=(0.8, 0.9), eps=1e-6, foreach=True,
    )
    torch.manual_seed(0)
    for step in range(3):
        for p, q in zip(model.parameters(), ref.parameters()):
            if p.requires_grad:
                p.grad = torch.randn_like(p)
                q.grad = p.grad.clone()
        if step == 2:
            set_lr(opt, 5e-4)
            set_lr(ref_opt, 5e-4)
        opt.step()
        ref_opt.step()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p, q), name
        if p.requires_grad:
            mine, theirs = opt.state[p], ref_opt.state[q]
            assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine), name
    assert not any(p in opt.state for p in model.frozen.parameters())
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())


def test_training_never_imports_torch_dynamo():
    """torch.optim's optimizers import torch._dynamo when built (1.3 s of every rank's start-up here); tensorpar's
    AdamW does not, and neither does a training step."""
    code = ("import sys; from tensorpar.optim import build_optimizer; import torch; m = torch.nn.Linear(3, 2); "
            "o = build_optimizer(m, lr=1e-3, weight_decay=0.1); m(torch.ones(1, 3)).sum().backward(); o.step(); "
            "print('torch._dynamo' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_build_optimizer_refuses_a_model_without_trainable_parameters():
    with pytest.raises(TensorparError, match="no trainable parameters"):
        build_optimizer(nn.Linear(2, 2).requires_grad_(False), lr=1e-3, weight_decay=0.1)
