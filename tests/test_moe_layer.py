"""The MoE layer on one process against a naive per-token reference: outputs, gradients (with the router losses'
injected in the backward), capacity dropping; config fields and clear errors."""

import math

import pytest
import torch
import torch.nn.functional as F

from tensorpar.models.placement import Placement
from tensorpar.errors import LayoutError, TensorparError
from tensorpar.expert_parallel import MoELayer, experts_per_rank
from tensorpar.expert_parallel.router import capacity
from tensorpar.models import ModelConfig, Transformer, get_config
from tensorpar.models.init import init_weights

CFG = get_config("tiny-moe")


def _layer(cfg, seed=0):
    torch.manual_seed(seed)
    layer = MoELayer(cfg, _single("tp"), _single("ep"), _single("cp"))
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.1)
    return layer.train()


def _single(name):
    from tensorpar.distributed.comm import Group
    return Group.single(name)


def naive(layer, x, cfg):
    """(y, aux, z, kept [B, S, k]): every token through its experts one by one, the losses as the docs define them."""
    b, s, h = x.shape
    e, k = cfg.num_experts, cfg.experts_per_token
    logits = x @ layer.router.weight.t()
    if cfg.router_score == "softmax":
        probs = logits.softmax(-1)
        w, idx = probs.topk(k, -1)
        if cfg.norm_topk_prob:
            w = w / w.sum(-1, keepdim=True)
    else:
        scores = logits.sigmoid()
        w, idx = scores.topk(k, -1)
        w = w / w.sum(-1, keepdim=True)
        probs = scores / scores.sum(-1, keepdim=True)
    kept = torch.ones(b, s, k, dtype=torch.bool)
    if cfg.capacity_factor is not None:
        limit = capacity(cfg.capacity_factor, s, k, e)
        for bi in range(b):
            used = [0] * e
            for slot in range(k):
                for pos in range(s):
                    ex = int(idx[bi, pos, slot])
                    kept[bi, pos, slot] = used[ex] < limit
                    used[ex] += 1
    ex = layer.experts
    y = torch.zeros_like(x)
    for bi in range(b):
        for pos in range(s):
            for slot in range(k):
                if kept[bi, pos, slot]:
                    j, t = int(idx[bi, pos, slot]), x[bi, pos]
                    out = (F.silu(t @ ex.gate_proj[j].t()) * (t @ ex.up_proj[j].t())) @ ex.down_proj[j].t()
                    y[bi, pos] = y[bi, pos] + w[bi, pos, slot] * out
    if layer.shared_experts is not None:
        shared = layer.shared_experts(x)
        if layer.shared_expert_gate is not None:  # Qwen2-MoE: sigmoid(x . w) per token
            shared = torch.sigmoid(x @ layer.shared_expert_gate.t()) * shared
        y = y + shared
    f = F.one_hot(idx, e).sum(2).float().sum(1) / (s * k)  # [B, E]
    aux = (e * (f * probs.mean(1)).sum(-1)).mean()
    z = torch.logsumexp(logits, -1).square().mean()
    return y, aux, z, kept


@pytest.mark.parametrize("changes", [dict(), dict(router_score="sigmoid", num_shared_experts=0),
                                     dict(norm_topk_prob=False, capacity_factor=1.0),
                                     dict(norm_topk_prob=False, shared_expert_gate=True)],
                         ids=["softmax-shared", "sigmoid", "capacity", "gated-shared"])
def test_layer_matches_the_naive_reference_with_its_losses_in_the_gradient(changes):
    cfg = CFG.replace(router_aux_loss_coef=0.1, router_z_loss_coef=0.01, **changes)
    layer = _layer(cfg)
    x = torch.randn(3, 10, cfg.hidden_size, requires_grad=True)
    g = torch.randn(3, 10, cfg.hidden_size)
    y = layer(x, aux_scale=0.5)
    (y * g).sum().mul(0.5).backward()
    got = {n: p.grad.clone() for n, p in layer.named_parameters()}
    got_x = x.grad.clone()
    for p in layer.parameters():
        p.grad = None
    x.grad = None
    y_ref, aux, z, kept = naive(layer, x, cfg)
    ((y_ref * g).sum() + cfg.router_aux_loss_coef * aux + cfg.router_z_loss_coef * z).mul(0.5).backward()
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-6)
    for n, p in layer.named_parameters():
        torch.testing.assert_close(got[n], p.grad, rtol=1e-5, atol=1e-6, msg=n)
    torch.testing.assert_close(got_x, x.grad, rtol=1e-5, atol=1e-6)
    stats = layer.stats.vector
    e = cfg.num_experts
    assert stats[:e].sum() == 3 * 10 * cfg.experts_per_token
    assert int(stats[e + 1]) == int((~kept).sum())  # dropped choices
    assert math.isclose(float(stats[e + 2] / stats[e + 3]), float(aux.detach()), rel_tol=1e-5)
    assert math.isclose(float(stats[e + 4] / stats[e + 5]), float(z.detach()), rel_tol=1e-5)
    if cfg.capacity_factor is not None:
        assert (~kept).any(), "capacity 1.0 dropped nothing: the test does not exercise dropping"


def test_moe_config_fields_defaults_and_round_trip():
    dense = get_config("tiny")
    assert not dense.is_moe and dense.num_experts == 0
    assert ModelConfig(**CFG.to_dict()) == CFG
    assert [CFG.replace(moe_layer_freq=2).is_moe_layer(i) for i in range(4)] == [False, True, False, True]
    assert get_config("mixtral-8x7b").num_parameters() == pytest.approx(46.7e9, rel=1e-3)
    assert get_config("mixtral-8x7b").num_parameters(active=True) == pytest.approx(12.9e9, rel=1e-2)
    with pytest.raises(TensorparError, match="experts_per_token must be between 1 and num_experts"):
        CFG.replace(experts_per_token=9)
    with pytest.raises(TensorparError, match="router_score must be one of"):
        CFG.replace(router_score="relu")
    with pytest.raises(LayoutError, match=r"num_experts = 8 is not divisible by the expert-parallel size 3.*\[1, 2, 4, 8\]"):
        experts_per_rank(8, 3)


def test_moe_model_trains_a_step_and_reinitialises_alike():
    m = Transformer(CFG, None, seed=4)
    again = Transformer(CFG, None, init=False)
    init_weights(again, 4)
    for (n, p), (_, q) in zip(m.named_parameters(), again.named_parameters()):
        assert torch.equal(p, q), n
    ids = torch.randint(0, CFG.vocab_size, (2, 9))
    m(ids[:, :-1], ids[:, 1:]).backward()
    assert all(p.grad is not None for p in m.parameters())


def test_a_moe_model_runs_under_bf16_autocast():
    """Evaluation and generation in bf16 run under autocast: fp32 residual stream, bf16 expert matmuls."""
    from tensorpar.config.precision import Precision

    m = Transformer(CFG, None, seed=4).eval()
    ids = torch.randint(0, CFG.vocab_size, (2, 9))
    with torch.no_grad():
        ref = m(ids[:, :-1], ids[:, 1:]).item()
        with Precision("bf16", training=False).autocast(torch.device("cpu")):
            got = m(ids[:, :-1], ids[:, 1:]).item()
    assert abs(got - ref) <= 0.02 * ref


def test_sigmoid_routing_stays_fp32_under_bf16_autocast():
    """DeepSeek-V3 / GLM-4.5 routing (sigmoid scores, the balancing bias) in bf16 evaluation chooses the experts fp32
    does, as transformers' router (kept in fp32) does; bf16 logits chose others for some tokens."""
    from tensorpar.config.precision import Precision

    cfg = get_config("tiny-deepseek")
    router = _layer(cfg, seed=5).router
    with torch.no_grad():
        router.expert_bias.normal_(0, 0.05)
        x = torch.randn(512, cfg.hidden_size)
        ref = router(x)
        with Precision("bf16", training=False).autocast(torch.device("cpu")):
            got = router(x)
    assert torch.equal(got.logits, ref.logits) and torch.equal(got.experts, ref.experts)
    assert torch.equal(got.weights, ref.weights)


def test_full_recomputation_counts_the_routing_statistics_once():
    ids = torch.randint(0, CFG.vocab_size, (2, 9))
    counts = {}
    for recompute in ("none", "full"):
        m = Transformer(CFG.replace(num_layers=2), Placement.on(recompute=recompute), seed=1).train()
        m(ids[:, :-1], ids[:, 1:]).backward()  # "full" runs each layer's forward again in this backward
        counts[recompute] = [layer.stats.vector for layer in m.moe_layers().values()]
    assert all(torch.equal(a, b) for a, b in zip(counts["none"], counts["full"]))
