"""Grouped expert GEMMs (`--expert-gemm grouped`, torch._grouped_mm or a padded bmm) compute what the loop over
experts computes: the grouped kernel against per-expert products (forward and both gradients, empty experts, widths
that break _grouped_mm's alignment), and a tiny-moe model's loss, logits and every gradient with grouped against
looped experts at EP 1, EP 2 and expert-TP 2 (relative error <= 1e-6; on CPU they are bit for bit the same products). bf16 on
the GPU's grouped kernel: tests/test_cuda.py."""

import pytest
import torch

from tensorpar.functional.grouped_gemm import grouped_mm, grouped_mm_runs, padded_bmm
from tensorpar.models import Transformer, get_config
from tensorpar.models.placement import Placement
import tensorpar.tensor_parallel.region_gemms as region_gemms

from checks import rel_err
from harness import mesh

TINY_MOE2 = get_config("tiny-moe").replace(num_layers=2)


@pytest.mark.parametrize("sizes,out,inp", [([5, 0, 7, 3], 32, 16), ([0, 0, 0], 32, 16), ([3, 4], 30, 18)],
                         ids=["empty-expert", "no-rows", "unaligned"])
def test_grouped_mm_equals_the_loop_over_experts(sizes, out, inp):
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(len(sizes), out, inp, generator=g)
    x, probe = torch.randn(sum(sizes), inp, generator=g), torch.randn(sum(sizes), out, generator=g)
    results = {}
    for name, fn in (("loop", None), ("grouped", grouped_mm), ("padded", padded_bmm)):
        w, rows = weight.clone().requires_grad_(), x.clone().requires_grad_()
        y = (torch.cat([r @ w[i].t() for i, r in enumerate(rows.split(sizes))]) if fn is None
             else fn(rows, w, sizes))
        (y * probe).sum().backward()
        results[name] = (y.detach(), rows.grad, w.grad if w.grad is not None else torch.zeros_like(w))
    for name in ("grouped", "padded"):
        for what, a, b in zip(("output", "input grad", "weight grad"), results[name], results["loop"]):
            assert torch.equal(a, b), f"{name} {what}"
    assert grouped_mm_runs(x, weight) == (inp % 4 == 0 and out % 4 == 0)  # 16-byte rows of fp32


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_mm_under_compile_equals_it_eager(dtype):
    """Under torch.compile fp32 rows reached `_grouped_mm`, whose fake-tensor rule takes only bf16 (every MoE run with
    --compile failed on a CPU), and the alignment check read `stride(-2)`, which dynamo fails on with dynamic
    shapes (bf16). Traced with dynamic shapes over two different row counts, as experts receive them; fp32 takes the
    padded bmm there, whose kernel may sum in another order."""
    compiled = torch.compile(grouped_mm, backend="eager", dynamic=True)
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(3, 32, 16, generator=g).to(dtype)
    for sizes in ([5, 0, 7], [2, 6, 1]):
        x = torch.randn(sum(sizes), 16, generator=g).to(dtype)
        error = rel_err(compiled(x, weight, sizes).float(), grouped_mm(x, weight, sizes).float())
        assert error <= (1e-6 if dtype == torch.float32 else 0), (dtype, sizes, error)


def _grouped_against_loop(m) -> dict:
    """Relative errors of the loss, logits and every gradient of a tiny-moe model with grouped experts against the
    same model with looped ones on mesh `m` (None: one process); the grouped kernel's calls are counted."""
    calls, grouped = [0], region_gemms.grouped_mm

    def counted(*args):
        calls[0] += 1
        return grouped(*args)

    region_gemms.grouped_mm = counted
    try:
        rank = m.rank if m is not None else 0
        ids = torch.randint(0, TINY_MOE2.vocab_size, (2, 17), generator=torch.Generator().manual_seed(rank))
        found = {}
        for gemm in ("loop", "grouped"):
            model = Transformer(TINY_MOE2, Placement.on(m, expert_gemm=gemm), seed=3)
            model.train()
            loss = model(ids[:, :-1], ids[:, 1:])
            loss.backward()
            found[gemm] = {"loss": loss.detach(), "logits": model(ids[:, :-1]).detach(),
                           **{f"grad {n}": p.grad for n, p in model.named_parameters()}}
    finally:
        region_gemms.grouped_mm = grouped
    errs = {k: rel_err(found["grouped"][k].float(), v.float()) for k, v in found["loop"].items()}
    return {"errors": errs, "grouped calls": calls[0]}


def _check(out: dict, what: str) -> None:
    bad = {k: f"{v:.1e}" for k, v in out["errors"].items() if v > 1e-6}
    assert not bad, f"{what}: {bad}"
    assert out["grouped calls"] >= 3 * 2 * 2, f"{what}: the grouped kernel ran {out['grouped calls']} times"


def test_grouped_experts_equal_the_loop_on_one_process():
    _check(_grouped_against_loop(None), "ep 1")


def _two_ranks():
    return {"ep 2": _grouped_against_loop(mesh(tp=1, dp=2, ep=2)),
            "expert-tp 2": _grouped_against_loop(mesh(tp=1, dp=2, ep=1, expert_tp=2))}


def test_grouped_experts_equal_the_loop_at_ep_2_and_expert_tp_2(pools):
    for rank, found in enumerate(pools(2).run(_two_ranks)):
        for layout, out in found.items():
            _check(out, f"rank {rank} {layout}")
