"""The planner for mixture-of-experts models: parameters, FLOPs, memory and all-to-all time under expert
parallelism, the search over ep, and `tensorpar plan --ep`. Pure Python: no process is started."""

from __future__ import annotations

import json

import pytest

from tensorpar.layout import ParallelLayout
from tensorpar.models.placement import PipelineStage, Placement
from tensorpar.config.choices import LOSS_CHUNK_TOKENS
from tensorpar.distributed.comm import CommStats, Group
from tensorpar.models import get_config
from tensorpar.models.flops import train_flops_per_token
from tensorpar.models.transformer import Transformer
from tensorpar.planning.cluster import make_cluster
from tensorpar.planning.collective_cost import collective_time
from tensorpar.planning.communication import model_collectives
from tensorpar.planning.candidates import Candidate, candidate_problem, enumerate_candidates
from tensorpar.inference.kv_cache import KVCache
from tensorpar.planning.latent import kv_cache_bytes
from tensorpar.planning.memory import layout_memory, stage_memory
from tensorpar.planning.params import local_parameters, parameter_summary
from tensorpar.planning.precision_recipes import get_precision
from tensorpar.planning.search import search
from tensorpar.planning.step_time import predict_step_time

MOE_PRESETS = ["tiny-moe", "mixtral-8x7b", "qwen-moe-a2.7b"]


def _group(name: str, size: int) -> Group:
    """Rank 0 of a `size`-rank group with no process group behind it: enough to build a model on the meta
    device (building communicates nothing)."""
    g = object.__new__(Group)
    g.name, g.ranks, g.pg, g.stats, g.global_rank, g.rank, g.size, g.timeout = (
        name, list(range(size)), None, CommStats(), 0, 0, size, None)
    return g


class _Mesh:
    def __init__(self, tp: int, ep: int):
        self.tp_group, self.ep_group, self.cp_group = _group("tp", tp), _group("ep", ep), _group("cp", 1)
        self.expert_tp_group = _group("expert_tp", 1)
        self.device = "meta"


def _real(cfg, tp=1, ep=1):
    model = Transformer(cfg, Placement.on(_Mesh(tp, ep), device="meta"), init=False)
    return [(name, p.numel(), p.dim()) for name, p in model.named_parameters()]


@pytest.mark.parametrize("preset", MOE_PRESETS)
def test_planned_parameters_are_the_models(preset):
    cfg = get_config(preset)
    params = local_parameters(cfg, 1)
    assert params == _real(cfg)
    assert sum(n for _, n, _ in params) == cfg.num_parameters()
    assert cfg.num_parameters(active=True) < cfg.num_parameters()


@pytest.mark.parametrize("preset,tp,ep", [("tiny-moe", 2, 4), ("tiny-moe", 1, 8), ("mixtral-8x7b", 2, 2),
                                          ("qwen-moe-a2.7b", 2, 4)])
def test_planned_parameters_per_rank_under_tp_and_ep(preset, tp, ep):
    cfg = get_config(preset)
    assert local_parameters(cfg, tp, ep=ep) == _real(cfg, tp, ep)
    summary = parameter_summary(cfg, tp, ep=ep)
    assert summary.expert_numel == sum(n for name, n, _ in _real(cfg, tp, ep) if ".mlp.experts." in name)


def test_published_sizes_and_active_flops():
    mixtral, qwen = get_config("mixtral-8x7b"), get_config("qwen-moe-a2.7b")
    assert round(mixtral.num_parameters() / 1e9, 1) == 46.7 and round(mixtral.num_parameters(active=True) / 1e9, 1) == 12.9
    assert round(qwen.num_parameters() / 1e9, 1) == 14.3 and round(qwen.num_parameters(active=True) / 1e9, 1) == 2.7
    # FLOPs per token follow the active parameters (6 x active matmul parameters + attention), not the total.
    per_token = train_flops_per_token(mixtral, 4096)
    assert 6 * 12.5e9 < per_token < 6 * 13.5e9 + 12 * 32 * 4096 * 4096


def test_memory_shrinks_with_ep_and_the_expert_optimizer_shards_over_expert_dp():
    cfg = get_config("mixtral-8x7b")
    mems = {ep: layout_memory(cfg, Candidate.of(tp=1, dp=8, ep=ep, zero=1), 4096, 64, "tensorpar-bf16") for ep in (1, 2, 4, 8)}
    for a, b in ((1, 2), (2, 4), (4, 8)):
        assert mems[b].parameters < mems[a].parameters and mems[b].total < mems[a].total
    # ZeRO-1: each rank holds E/ep experts' states sharded over expert-DP = 8/ep ranks: E/8 experts' either way.
    assert len({round(m.optimizer / 2**20) for m in mems.values()}) == 1
    unsharded = layout_memory(cfg, Candidate.of(tp=1, dp=8, ep=2, zero=0), 4096, 64, "tensorpar-bf16")
    assert unsharded.optimizer > 3 * mems[2].optimizer


def test_all_to_all_time_per_moe_layer():
    cfg = get_config("mixtral-8x7b")
    cluster = make_cluster("h100-80gb", 64)
    layout = Candidate.of(tp=1, dp=64, ep=8, micro_batch_size=1)
    colls = [c for c in model_collectives(cfg, layout, 1, 4096, act_bytes=2, matmul_bytes=2) if c.group == "ep"]
    rows = [c for c in colls if c.what.startswith("MoE")]
    assert {c.phase for c in rows} == {"forward", "backward"} and all(c.calls == 32 for c in rows)
    assert all(c.nbytes == 4096 * 2 * 4096 * 2 for c in rows)  # tokens x top-2 x hidden x bf16
    # Pairwise exchange: (n - 1) (alpha + B / (n beta)); inside a node NVLink, beyond it the inter-node link.
    link = cluster.intra
    assert collective_time("all_to_all", 8e6, 8, link) == pytest.approx(7 * (link.latency + 1e6 / link.bandwidth))
    inside = predict_step_time(cfg, layout, cluster, 4096, 64)
    across = predict_step_time(cfg, Candidate.of(tp=1, dp=64, ep=8, micro_batch_size=1), make_cluster("h100-80gb", 64,
                               gpus_per_node=4), 4096, 64)
    assert 0 < inside.ep_comm_s < across.ep_comm_s
    assert predict_step_time(cfg, Candidate.of(tp=1, dp=64, ep=1), cluster, 4096, 64).ep_comm_s == 0


def test_search_over_ep_and_structural_rules():
    cfg = get_config("mixtral-8x7b")
    cluster = make_cluster("h100-80gb", 64)
    eps = {lay.ep for lay in enumerate_candidates(cfg, cluster, 256, tp=(2,), pp=(4,), recompute=("none",), zero=(1,))}
    assert eps == {1, 2, 4, 8}  # divisors of 8 experts that divide tp x dp = 16
    plans = search(cfg, cluster, 4096, 256, recompute=("none", "full"), zero=(0, 1), max_micro_batch=2)
    assert plans[0].feasible and any(p.feasible and p.candidate.ep > 1 for p in plans[:10])
    dense = get_config("llama-8b")
    assert {lay.ep for lay in enumerate_candidates(dense, cluster, 256, tp=(8,), recompute=("none",), zero=(0,))} == {1}
    assert "needs a mixture-of-experts model" in candidate_problem(dense, Candidate.of(tp=8, dp=8, ep=2), cluster, 4096, 256)
    assert "does not divide tp x cp x dp = 4" in candidate_problem(cfg, Candidate.of(tp=2, dp=2, pp=16, ep=8), cluster,
                                                                      4096, 256)
    assert candidate_problem(cfg, Candidate.of(tp=1, dp=64, ep=8, zero=3), cluster, 4096, 256) == ""


def test_zero3_shards_experts_over_expert_dp_and_the_rest_over_dp():
    cfg = get_config("mixtral-8x7b")
    summary = parameter_summary(cfg, 1, ep=8)
    dense, expert = summary.numel - summary.expert_numel, summary.expert_numel
    mem = layout_memory(cfg, Candidate.of(tp=1, dp=64, ep=8, zero=3), 4096, 64, "tensorpar-bf16")
    bytes_per = get_precision("tensorpar-bf16").param_bytes
    assert mem.parameters == -(-bytes_per * dense // 64) + -(-bytes_per * expert // 8)  # expert-DP = 64 / 8


def _main(*args):
    from tensorpar.cli import main

    return main(["plan", *args])


def test_plan_ep_json_and_bad_ep(capsys):
    base = ["--model", "mixtral-8x7b", "--gpus", "64", "--gpu", "h100-80gb", "--seq-len", "4096",
            "--global-batch-size", "256", "--recompute", "none", "--zero", "1", "--max-micro-batch", "1"]
    assert _main(*base, "--ep", "4", "--json", "--top", "3") == 0
    rows = json.loads(capsys.readouterr().out)
    assert rows and all(r["ep"] == 4 for r in rows) and rows[0]["feasible"]
    assert {"tp", "cp", "pp", "dp", "zero", "sequence_parallel", "micro_batch_size", "memory", "step_time_s",
            "tokens_per_s", "mfu"} <= set(rows[0]) and rows[0]["breakdown_s"]["ep_comm"] > 0
    assert _main(*base, "--top", "2") == 0
    out = capsys.readouterr().out
    assert "12.88B active" in out and " ep " in out and "a2a" in out
    assert _main(*base, "--ep", "3") == 2
    err = capsys.readouterr().err
    assert "--ep 3 does not divide both the 8 experts" in err and "valid: [1, 2, 4, 8]" in err
    assert _main("--model", "llama-8b", "--gpus", "16", "--gpu", "h100-80gb", "--seq-len", "4096",
                 "--global-batch-size", "256", "--ep", "2") == 2
    assert "needs a mixture-of-experts model" in capsys.readouterr().err
    assert _main("--model", "llama-8b", "--gpus", "16", "--gpu", "h100-80gb", "--seq-len", "4096",
                 "--global-batch-size", "256", "--json", "--top", "1", "--zero", "1", "--recompute", "none") == 0
    assert all(r["ep"] == 1 for r in json.loads(capsys.readouterr().out))


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_moe_activation_memory_near_the_saved_tensors(dtype):
    """tiny-moe at tp 1 (routing as the seed makes it, not balanced): the MoE activation model is within 10%
    (it counts balanced routing and leaves out a few small index tensors; measured: 8% under)."""
    import torch
    from test_planning_memory import measure_saved_bytes

    cfg = get_config("tiny-moe")
    torch.manual_seed(0)
    ids, targets = torch.randint(0, cfg.vocab_size, (2, 32)), torch.randint(0, cfg.vocab_size, (2, 32))
    model = Transformer(cfg, Placement.on(loss_chunk_tokens=LOSS_CHUNK_TOKENS), seed=1)  # head and loss as in training
    if dtype == "bf16":
        for p in model.parameters():
            p.data = p.data.bfloat16()
    model.train()
    measured = measure_saved_bytes(model, ids, targets, False, "hooks")
    predicted = layout_memory(cfg, Candidate.of(micro_batch_size=2), 32, 2, f"tensorpar-{dtype}").activations
    assert abs(predicted - measured) <= 0.10 * measured, (predicted, measured)


@pytest.mark.parametrize("preset,tp,ep", [("tiny-deepseek", 1, 1), ("tiny-deepseek", 2, 4), ("deepseek-v3", 8, 8),
                                          ("kimi-k2", 1, 1)])
def test_planned_parameters_of_latent_attention_and_mtp_are_the_models(preset, tp, ep):
    """Latent attention's whole down-projections and head-split up-projections, the MTP module (with the last stage's
    embedding copy under PP), dense first layers: the planner's list is the model's, name for name."""
    cfg = get_config(preset)
    assert local_parameters(cfg, tp, ep=ep) == _real(cfg, tp, ep)
    if tp == ep == 1:
        assert sum(n for _, n, _ in local_parameters(cfg, 1)) == cfg.num_parameters()
    split = None if cfg.num_layers % 2 == 0 else (cfg.num_layers // 2 + 1, cfg.num_layers // 2)
    last = local_parameters(cfg, tp, pp=2, stage=1, ep=ep, pipeline_layers=split)
    stage = PipelineStage.of(ParallelLayout(tp=tp, pp=2, pipeline_layers=split), cfg.num_layers, 1)
    model = Transformer(cfg, Placement.on(_Mesh(tp, ep), stage=stage, device="meta"), init=False)
    assert last == [(name, p.numel(), p.dim()) for name, p in model.named_parameters()]
    assert last[0][0] == "embed.weight" or not cfg.num_mtp_layers  # the MTP modules' copy of the embedding


def test_the_planner_knows_the_latent_kv_cache_and_the_mtp_modules_cost():
    ds = get_config("deepseek-v3")
    assert kv_cache_bytes(ds, 8) == kv_cache_bytes(ds, 1) == 61 * (512 + 64) * 2  # whole on every rank, bf16
    assert kv_cache_bytes(get_config("llama-8b"), 8) == 32 * 2 * 1 * 128 * 2  # one of the 8 KV heads
    tiny = get_config("tiny-deepseek")
    cache = KVCache.for_model(Transformer(tiny, Placement.on(None, device="meta"), init=False), 2, 16)
    assert cache.memory_bytes() == kv_cache_bytes(tiny, 1, dtype_bytes=4) * 2 * 16
    # The MTP module: FLOPs per token (its block and the head once more) and the last stage's memory.
    no_mtp = ds.replace(num_mtp_layers=0)
    assert train_flops_per_token(ds, 4096) > 1.01 * train_flops_per_token(no_mtp, 4096)
    layout = Candidate.of(pp=16, dp=128, ep=64, zero=1, recompute="full", pipeline_layers=(3,) + (4,) * 14 + (2,))
    with_mtp, without = (stage_memory(cfg, layout, 4096, 1024, "tensorpar-bf16", stage=15) for cfg in (ds, no_mtp))
    assert with_mtp.parameters > without.parameters and with_mtp.activations > without.activations
    first = stage_memory(ds, layout, 4096, 1024, "tensorpar-bf16", stage=0)
    assert first.parameters == stage_memory(no_mtp, layout, 4096, 1024, "tensorpar-bf16", stage=0).parameters
