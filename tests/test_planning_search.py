"""The layout search: feasible first with reasons for the rest, and against published Megatron-LM runs
(GPT-3 175B on 1024 A100s, the 1T model on 3072 A100s, Narayanan et al. 2021): predicted per-GPU throughput
within 20%, and their layout among the planner's top choices.
"""

from __future__ import annotations


import pytest

from tensorpar.models import ModelConfig, get_config
from tensorpar.planning import cluster, compute
from tensorpar.planning import search as search_mod
from tensorpar.planning.candidates import Candidate

from planning_cases import CONFIGS, GPT2_SHAPE, WORLD  # noqa: F401


def test_search_ranks_feasible_first_and_explains_the_rest():
    cl = cluster.make_cluster("a100-40gb", 8, memory_gib=16)
    plans = search_mod.search(get_config("gpt2-774m"), cl, 1024, 64)  # 20 heads, 36 layers
    feasible = [p for p in plans if p.feasible]
    assert feasible and not plans[0].reason
    rates = [p.time.tokens_per_s for p in feasible]
    assert rates == sorted(rates, reverse=True)
    assert plans.index(feasible[-1]) == len(feasible) - 1  # feasible ones first
    reasons = {p.reason for p in plans if not p.feasible}
    assert "num_heads = 20 is not divisible by the tensor-parallel size 8" in reasons
    assert any(r.startswith("exceeds memory by") for r in reasons)
    # 36 layers on 8 stages: planned as the balanced uneven split (first and last stage one layer fewer)
    assert any(p.candidate.pp == 8 and p.candidate.pipeline_layers == (4, 5, 5, 5, 5, 4, 4, 4) or
               p.candidate.pp == 8 and sorted(p.candidate.pipeline_layers or ()) == [4, 4, 4, 4, 5, 5, 5, 5] for p in plans)
    d = feasible[0].to_dict()
    for key in ("tp", "pp", "dp", "zero", "sequence_parallel", "micro_batch_size", "recompute", "feasible", "reason",
                "memory", "step_time_s", "tokens_per_s", "mfu"):
        assert key in d
    assert d["memory"]["total"] == pytest.approx(sum(v for k, v in d["memory"].items() if k != "total"))


def _gpt(hidden, layers, heads):
    # Narayanan et al. 2021, Table 1 shapes: GPT, vocabulary 51200, sequence 2048, tied embeddings, dropout 0.1
    return ModelConfig(family="gpt2", vocab_size=51200, hidden_size=hidden, num_layers=layers, num_heads=heads,
                       ffn_hidden_size=4 * hidden, max_seq_len=2048, dropout=0.1)


PUBLISHED = [
    ("gpt3-175b", _gpt(12288, 96, 96), 1024, 1536, 138e12, Candidate.of(tp=8, pp=16, dp=8, micro_batch_size=1, recompute="full", virtual_stages=2)),
    ("megatron-1t", _gpt(25600, 128, 160), 3072, 3072, 163e12, Candidate.of(tp=8, pp=64, dp=6, micro_batch_size=1, recompute="full", virtual_stages=2)),
]


ERA_SPACE = dict(sequence_parallel=(False,), zero=(0,), recompute=("none", "full"), virtual_stages=(1, 2),
                 max_micro_batch=8, uneven=False)


FULL_SPACE = dict(virtual_stages=(1, 2), max_micro_batch=8)


def published_prediction(cfg, gpus, batch, layout):
    # A100-80GB DGX nodes; their data-parallel all-reduce ran after the pipeline flush: no overlap.
    cl = cluster.make_cluster("a100-80gb", gpus, overlap=0.0)
    plan = search_mod.evaluate(cfg, layout, cl, 2048, batch, "mixed-bf16", flash_attention=False)
    # Their teraFLOP/s use eq. 3 of the paper (full recomputation counted); so does our step time here.
    return plan, compute.megatron_flops_per_step(cfg, batch, 2048) / (gpus * plan.time.step_time_s), cl


@pytest.mark.parametrize("name,cfg,gpus,batch,published,layout", PUBLISHED, ids=[p[0] for p in PUBLISHED])
def test_published_throughput_within_20_percent(name, cfg, gpus, batch, published, layout):
    for v in (1, 2):  # interleaved (what they used) and plain 1F1B (sensitivity)
        plan, predicted, _ = published_prediction(cfg, gpus, batch, layout.replace(virtual_stages=v))
        assert plan.feasible, plan.reason
        assert abs(predicted / published - 1) < 0.20, f"{name} v={v}: {predicted / 1e12:.0f} vs {published / 1e12:.0f}"


def mesh_rank(plans, layout) -> tuple[int, int]:
    """(0-based rank, count) of the layout's (tp, pp) among mesh shapes, each at its best configuration."""
    meshes = sorted(search_mod.best_by_mesh(plans).values(), key=lambda p: -p.time.tokens_per_s)
    return [(p.candidate.tp, p.candidate.pp) for p in meshes].index((layout.tp, layout.pp)), len(meshes)


GPT3_BELOW_TOP_5 = pytest.mark.xfail(strict=True, reason=(
    "planner v2 ranks GPT-3 175B's exact 2021 layout 7th (top 5 under v1's flat compute model): behind two "
    "layouts without recomputation that fit within 11 GiB of the 80 (as in v1) and four TP 4 / PP 8 variants with "
    "full recomputation 0.1-6% faster, v2 timing TP 8's thinner GEMMs below TP 4's"))
EXACT = [pytest.param(*p, id=p[0], marks=GPT3_BELOW_TOP_5 if p[0] == "gpt3-175b" else ()) for p in PUBLISHED]


def era_search(cfg, gpus, batch, layout):
    _, _, cl = published_prediction(cfg, gpus, batch, layout)
    return cl, search_mod.search(cfg, cl, 2048, batch, "mixed-bf16", flash_attention=False, **ERA_SPACE)


@pytest.mark.parametrize("name,cfg,gpus,batch,published,layout", EXACT)
def test_published_exact_layout_is_among_the_top_5_of_its_era(name, cfg, gpus, batch, published, layout):
    """Among what Megatron-LM could run in 2021 (no SP, no selective recomputation, no distributed optimizer,
    no uneven stages) their exact configuration is in the planner's top 5."""
    _, era = era_search(cfg, gpus, batch, layout)
    rank, _ = search_mod.find(era, **layout.as_dict())
    assert rank < 5, f"{name}: their layout ranks {rank + 1} among {sum(p.feasible for p in era)} feasible"


@pytest.mark.parametrize("name,cfg,gpus,batch,published,layout", PUBLISHED, ids=[p[0] for p in PUBLISHED])
def test_published_mesh_shape_is_among_the_5_best(name, cfg, gpus, batch, published, layout):
    """Their mesh shape (tp, pp) - the Playbook heatmap's cell, each shape at its best micro-batch /
    recomputation / ZeRO / SP - is among the 5 best shapes, both in the 2021 space and with every feature the
    planner knows."""
    cl, era = era_search(cfg, gpus, batch, layout)
    full = search_mod.search(cfg, cl, 2048, batch, "mixed-bf16", flash_attention=False, **FULL_SPACE)
    for space, plans in (("2021", era), ("full", full)):
        shape, count = mesh_rank(plans, layout)
        assert shape < 5, f"{name} ({space}): (tp, pp) = ({layout.tp}, {layout.pp}) ranks {shape + 1} of {count}"
