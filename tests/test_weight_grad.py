"""The split backward (pipeline_parallel/weight_grad.py): with a WeightGradQueue every layer kind leaves all of its weight
gradients for W, and W gives the gradients of the plain backward; the queue's bookkeeping."""

import pytest
import torch
from torch import nn

from tensorpar.models.placement import Placement
from tensorpar.distributed.comm import Group
from tensorpar.errors import TensorparError
from tensorpar.expert_parallel.experts import GroupedExperts
from tensorpar.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    TPRegion,
    VocabParallelEmbedding,
    VocabParallelLMHead,
    tp_region,
)
from tensorpar.layers.norms import Norm
from tensorpar.models import Transformer, get_config
from tensorpar.pipeline_parallel.weight_grad import WeightGradQueue

from conftest import TINY8
from harness import mesh


def _grads(module):
    return {name: None if p.grad is None else p.grad.clone() for name, p in module.named_parameters()}


def _regions(module):
    return [m.region for m in module.modules() if isinstance(getattr(m, "region", None), TPRegion)]


def _compare_split(build, inputs, seed=0, tol=1e-6):
    """Backward through `build(None)` plainly and through `build(queue)` with a queue: with the queue no gradient
    exists until W runs, then every parameter's equals the plain one; the input gradients are equal too."""
    torch.manual_seed(seed)
    queue = WeightGradQueue()
    plain, split = build(None), build(queue)
    split.load_state_dict(plain.state_dict())
    outs, given = {}, inputs()
    for module, queue in ((plain, None), (split, queue)):
        regions = _regions(module)
        assert regions and all(r.weight_grads is queue for r in regions)
        if queue is not None:  # nothing left in backward to hide a TP collective behind
            assert not any(r.overlap for r in regions)
        args = [a.detach().clone().requires_grad_(a.is_floating_point()) for a in given]
        fired = []
        hooks = [p.register_post_accumulate_grad_hook(lambda p: fired.append(p)) for p in module.parameters()]
        out = module(*args)
        out = out if out.dim() == 0 else (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum()
        out.backward()
        if queue is not None:
            assert all(p.grad is None for p in module.parameters()) and not fired, "a weight gradient in B"
            queue.close("mb0")
            assert queue.pending == ["mb0"]
            queue.run("mb0")
            assert len(queue) == 0
        assert len(fired) == len(list(module.parameters()))  # each parameter's hook once, as data parallelism expects
        for h in hooks:
            h.remove()
        outs[queue is None] = [a.grad for a in args if a.is_floating_point()]
    for a, b in zip(outs[True], outs[False]):
        torch.testing.assert_close(b, a, rtol=tol, atol=tol)
    want, got = _grads(plain), _grads(split)
    assert want.keys() == got.keys()
    for name in want:
        assert want[name] is not None and got[name] is not None, name
        torch.testing.assert_close(got[name], want[name], rtol=tol, atol=tol, msg=name)


def _region(queue, name="tp"):
    """One rank's region, with the split backward when `queue` is given."""
    return tp_region(Group.single(name), weight_grads=queue)


x3 = lambda *shape: lambda: [torch.randn(*shape)]  # noqa: E731
LAYERS = {
    "column": (lambda q: ColumnParallelLinear(16, 24, _region(q), bias=True), x3(2, 5, 16)),
    "row": (lambda q: RowParallelLinear(24, 16, _region(q), bias=True), x3(2, 5, 24)),
    "embedding": (lambda q: VocabParallelEmbedding(40, 8, _region(q)), lambda: [torch.randint(0, 40, (3, 7))]),
    "lm_head": (lambda q: VocabParallelLMHead(16, 37, _region(q)), x3(2, 5, 16)),
    "layernorm": (lambda q: _randomised(Norm(16, "layernorm", 1e-5, _region(q))), x3(2, 5, 16)),
    "rmsnorm": (lambda q: _randomised(Norm(16, "rmsnorm", 1e-6, _region(q))), x3(2, 5, 16)),
}


def _randomised(module):
    with torch.no_grad():
        for p in module.parameters():
            p.normal_()
    return module


@pytest.mark.parametrize("kind", list(LAYERS))
def test_each_layer_kind_defers_its_weight_gradients(kind):
    build, inputs = LAYERS[kind]
    _compare_split(build, inputs)


class _Experts(nn.Module):
    def __init__(self, queue):
        super().__init__()
        cfg = get_config("tiny-moe")
        self.experts = _randomised(GroupedExperts(cfg, Group.single("ep"), region=_region(queue)))
        self.sizes = [3, 0, 5, 2][: self.experts.num_local] + [1] * max(0, self.experts.num_local - 4)

    def forward(self, x):
        return self.experts(x[: sum(self.sizes)], self.sizes)


def test_moe_experts_defer_their_stacked_weight_gradients():
    h = get_config("tiny-moe").hidden_size
    _compare_split(_Experts, x3(16, h))


@pytest.mark.parametrize("model", ["tiny", "tiny-gpt2", "tiny-moe"])
def test_whole_model_defers_every_weight_gradient(model):
    """Every parameter of a model (Llama, GPT-2 with tied embedding and learned positions, MoE with router and
    shared experts) gets its gradient only from W, and the same gradient as the plain backward."""
    cfg = get_config(model).replace(num_layers=2, dropout=0.0)
    ids = torch.randint(0, cfg.vocab_size, (2, 17))
    _compare_split(lambda q: Transformer(cfg, Placement.on(weight_grads=q), seed=3), lambda: [ids[:, :-1], ids[:, 1:]], tol=1e-5)


def check_tensor_parallel_split(tp, sequence_parallel, model):
    """On a TP group: the reductions of replicated weights (norms and row bias under SP, KV heads fewer than
    ranks) happen in W and give the plain gradients."""
    m = mesh(tp=tp)
    cfg = (TINY8 if model == "tiny8" else get_config(model)).replace(num_layers=2, dropout=0.0)
    torch.manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (2, 17))
    build = lambda q: Transformer(cfg, Placement.on(m, sequence_parallel=sequence_parallel, weight_grads=q), seed=3)  # noqa: E731
    _compare_split(build, lambda: [ids[:, :-1], ids[:, 1:]], tol=1e-5)
    return m.stats.calls()


@pytest.mark.parametrize("tp,sequence_parallel,model", [(2, True, "tiny-gpt2"), (4, False, "tiny8")])
def test_tensor_parallel_weight_reductions_run_in_w(pools, tp, sequence_parallel, model):
    calls = pools(tp).run(check_tensor_parallel_split, tp, sequence_parallel, model)
    assert len(set(calls)) == 1  # every rank ran the same collectives


def test_queue_bookkeeping_and_errors():
    queue = WeightGradQueue()
    lin = ColumnParallelLinear(4, 6, _region(queue))
    for key in ("a", "b"):
        lin(torch.randn(3, 4)).sum().backward()
        queue.close(key)
    assert queue.pending == ["a", "b"] and lin.weight.grad is None
    fired = []
    lin.weight.register_post_accumulate_grad_hook(lambda p: fired.append(p.grad.clone()))
    queue.run("b")
    assert len(fired) == 1  # one accumulation per parameter per backward pass, as after a plain backward
    with pytest.raises(TensorparError, match="no weight-gradient work queued for 'b'"):
        queue.run("b")
    lin(torch.randn(3, 4)).sum().backward()
    with pytest.raises(TensorparError, match="already queued"):
        queue.close("a")
    queue.run_all()  # "a", then the pass not yet closed
    assert len(queue) == 0 and len(fired) == 3
    plain = ColumnParallelLinear(4, 6, _region(None))
    plain(torch.randn(3, 4)).sum().backward()
    assert plain.weight.grad is not None and len(queue) == 0  # a region without a queue: the plain backward


def test_w_accumulates_each_parameter_as_its_last_piece_is_computed_in_the_backwards_order():
    """A plain backward's order (the last layer first), one parameter's gradient being summed at a time: ZeRO-2's
    buckets then fill as the planner counts them (a zb-h1 rank held 3.87 MiB of gradient buffers where 1F1B's and
    the plan's hold 2.82, and every weight gradient of the pass was alive before the first was accumulated)."""
    queue = WeightGradQueue()
    model = nn.Sequential(*(ColumnParallelLinear(4, 4, _region(queue)) for _ in range(3)))
    alive, fired = [], []  # hooks on the weights: how many had been accumulated when each piece was computed
    for i, lin in enumerate(model):
        lin.weight.register_post_accumulate_grad_hook(lambda p, i=i: fired.append(i))
    compute = WeightGradQueue._accumulate

    def watched(work):
        for w in work:
            inner = w.compute
            w.compute = lambda inner=inner: alive.append(len(fired)) or inner()
        compute(work)

    queue._accumulate = watched
    model(torch.randn(2, 4)).sum().backward()
    queue.run_all()
    assert fired == [2, 1, 0]
    # each layer's weight, then its bias, computed: a weight is accumulated before the next piece is computed (all
    # were computed first: [0] * 6)
    assert alive == [0, 1, 1, 2, 2, 3]
