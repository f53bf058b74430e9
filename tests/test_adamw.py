"""AdamW parameter groups: weight decay on matrices and embeddings only."""

import copy

import pytest
import torch
from torch import nn

from tensorpar.errors import TensorparError
from tensorpar.optim import build_optimizer


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
    assert isinstance(opt, torch.optim.AdamW)
    names = {id(p): n for n, p in model.named_parameters()}
    decay, no_decay = ([names[id(p)] for p in g["params"]] for g in opt.param_groups)
    assert decay == ["emb.weight", "fc.weight", "head.weight"]
    assert no_decay == ["fc.bias", "norm.weight", "norm.bias"]
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
    g = opt.param_groups[0]
    assert (g["lr"], g["betas"], g["eps"], g["foreach"], g["fused"]) == (1e-3, (0.8, 0.9), 1e-6, True, False)

    # a step equals plain AdamW with the same groups
    ref = copy.deepcopy(model)
    torch.manual_seed(0)
    for p, q in zip(model.parameters(), ref.parameters()):
        if p.requires_grad:
            p.grad = torch.randn_like(p)
            q.grad = p.grad.clone()
    ref_opt = torch.optim.AdamW(
        [
            {"params": [ref.emb.weight, ref.fc.weight, ref.head.weight], "weight_decay": 0.1},
            {"params": [ref.fc.bias, ref.norm.weight, ref.norm.bias], "weight_decay": 0.0},
        ],
        lr=1e-3, betas=(0.8, 0.9), eps=1e-6, foreach=False,
    )
    opt.step()
    ref_opt.step()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.allclose(p, q, rtol=1e-6, atol=1e-7), name


def test_build_optimizer_refuses_a_model_without_trainable_parameters():
    with pytest.raises(TensorparError, match="no trainable parameters"):
        build_optimizer(nn.Linear(2, 2).requires_grad_(False), lr=1e-3, weight_decay=0.1)
