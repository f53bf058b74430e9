"""The planner's LoRA fine-tuning (`tensorpar.planning.lora_adapters`): a dry-run rank of a 70B model holds the planned
adapter, gradient, optimizer and frozen-base bytes; the planned activations are what a LoRA model saves; the planner
sees how much less LoRA needs than full training; planner and trainer refuse the same models and layouts."""

import json

import pytest
import torch

from tensorpar.commands.dry_run_report import planned_bytes
from tensorpar.config.choices import LOSS_CHUNK_TOKENS
from tensorpar.errors import TensorparError
from tensorpar.models import Transformer, get_config
from tensorpar.models.placement import Placement
from tensorpar.planning import memory
from tensorpar.planning.candidates import Candidate
from tensorpar.planning.cluster import make_cluster
from tensorpar.planning.search import search
from tensorpar.tensor_parallel.fp8_scaling import Fp8Recipe
from tensorpar.tensor_parallel.lora import LoraSpec
from tensorpar.training import TrainOptions, validate
from tensorpar.training.dry_run import dry_run

from conftest import TINY8
from planning_cases import CONFIGS
from test_layout_agreement import _refusal, _train_options
from test_planning_memory import measure_saved_bytes

LORA = LoraSpec(16, 16.0)


@pytest.fixture(scope="module")
def llama_70b_width(tmp_path_factory) -> str:
    """Llama 70B's shape with 8 of its 80 layers (every byte compared is per layer or outside the layers): the
    config file, built on the meta device in a tenth of the time."""
    path = tmp_path_factory.mktemp("llama-70b-width") / "model.json"
    path.write_text(json.dumps(get_config("llama-70b").replace(num_layers=8).to_dict()))
    return str(path)


# tp8-dp2-zero2, on all 80 layers: the q/k/v and gate/up adapters' gradients arrive B's first, then A's, across a
# bucket boundary, so three of ZeRO-2's full buffers are alive at once (the planner follows the arrival order)
@pytest.mark.parametrize("layout", [dict(tp=2, dp=2, zero=1), dict(tp=2, pp=2, dp=2, zero=1), dict(dp=2, zero=1),
                                    dict(dp=2, zero=3), dict(tp=8, dp=2, zero=2, model="llama-70b")],
                         ids=["tp2-dp2-zero1", "tp2-pp2-dp2-zero1", "dp2-zero1", "dp2-zero3", "tp8-dp2-zero2"])
def test_a_lora_rank_of_a_70b_model_holds_the_planned_bytes(layout, llama_70b_width):
    layout = {"model": llama_70b_width, **layout}
    world = layout.get("tp", 1) * layout.get("pp", 1) * layout.get("dp", 1)
    run = validate(TrainOptions(lora_rank=16, dtype="bf16", seq_len=2048, global_batch_size=8, micro_batch_size=1,
                                progress=False, **layout), world)
    result = dry_run(run, world - 1)
    planned = planned_bytes(run, result)
    for key in ("parameter_bytes", "gradient_bytes", "frozen_bytes"):
        assert result[key] == planned[key], (key, result[key], planned[key])
    # AdamW's step counters: one 4-byte tensor per parameter tensor in the planner, per master slice in the run
    assert abs(result["optimizer_bytes"] - planned["optimizer_bytes"]) <= 1e-5 * planned["optimizer_bytes"]
    # the base, frozen; the adapters train (98x fewer bytes at TP 8, whose replicated factors do not shrink with TP)
    assert result["frozen_bytes"] > 50 * result["parameter_bytes"]


@pytest.mark.parametrize("recompute", ["none", "selective"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp8", "fp8-rowwise"])
@pytest.mark.parametrize("lora", [LoraSpec(4, 8.0), LoraSpec(8, 8.0, ("q", "v"))], ids=["all", "qv"])
def test_lora_activation_memory_matches_saved_tensors(recompute, dtype, lora):
    """fp8 (bf16 parameters, fp8 GEMMs): the frozen base's fp8 GEMMs keep no input, which only weight gradients
    need."""
    cfg = CONFIGS["tiny"]
    mb = memory.stage_memory(cfg, Candidate.of(micro_batch_size=2, recompute=recompute), 32, 2, f"tensorpar-{dtype}",
                             lora=lora)
    torch.manual_seed(0)
    ids, targets = torch.randint(0, cfg.vocab_size, (2, 32)), torch.randint(0, cfg.vocab_size, (2, 32))
    fp8 = Fp8Recipe(dtype.partition("-")[2] or "tensorwise") if dtype.startswith("fp8") else None
    model = Transformer(cfg, Placement.on(None, recompute=recompute, lora=lora, loss_chunk_tokens=LOSS_CHUNK_TOKENS,
                                          fp8=fp8), seed=1)
    if dtype != "fp32":
        for p in model.parameters():
            p.data = p.data.bfloat16()
    got = measure_saved_bytes(model, ids, targets, False, "hooks" if recompute == "none" else "live")
    predicted = mb.activations + mb.weight_copies
    assert abs(predicted - got) <= 0.10 * got and abs(predicted - got) <= 1024, (predicted, got)


def test_lora_needs_far_less_memory_than_full_training():
    """Llama 70B on one node of 8 H100s: full training fits no layout, LoRA several, with under a quarter of the
    memory of full training's best layout at the same layout."""
    cfg, cluster = get_config("llama-70b"), make_cluster("h100-80gb", 8)
    space = dict(tp=(8,), zero=(1,), recompute=("full",), max_micro_batch=1)
    full = search(cfg, cluster, 4096, 64, **space)
    lora = search(cfg, cluster, 4096, 64, lora=LORA, **space)
    assert not any(p.feasible for p in full) and any(p.feasible for p in lora)
    by_layout = {p.candidate: p for p in full}
    for p in lora:
        if p.memory is not None and by_layout[p.candidate].memory is not None:
            m, f = p.memory, by_layout[p.candidate].memory
            assert m.gradients + m.optimizer < 0.02 * (f.gradients + f.optimizer)
            assert m.total < 0.6 * f.total
    assert lora[0].to_dict()["lora"] == LORA.as_dict() and "frozen" in lora[0].to_dict()["memory"]


@pytest.mark.parametrize("model,targets", [("tiny-deepseek", "q,k,v,o"), ("tiny-moe", "q,k,v,o,gate,up,down")])
def test_the_planner_refuses_the_models_training_refuses_with_lora(model, targets):
    spec = LoraSpec.parse(4, None, targets, 0.0)
    with pytest.raises(TensorparError) as planned:
        search(get_config(model), make_cluster("h100-80gb", 8), 64, 8, lora=spec)
    refused = _refusal(TrainOptions(model=model, lora_rank=4, lora_targets=targets, dry_run=True, world_size=1,
                                    seq_len=64, global_batch_size=8, progress=False))
    assert refused and str(planned.value) == refused


def test_the_planner_offers_exactly_the_lora_layouts_training_accepts(tmp_path):
    path = tmp_path / "model.json"
    path.write_text(json.dumps(TINY8.to_dict()))
    plans = search(TINY8, make_cluster("h100-80gb", 8), 64, 16, "tensorpar-bf16", recompute=("none",),
                   virtual_stages=(1, 2), lora=LoraSpec(4, 8.0))
    accepted = 0
    for plan in plans:
        planned = "" if plan.feasible or plan.reason.startswith("exceeds memory") else plan.reason
        options = _train_options(plan.candidate, str(path), 64, 16, "tensorpar-bf16")
        refused = _refusal(TrainOptions(**{**options.__dict__, "lora_rank": 4, "lora_alpha": 8.0}))
        assert refused == planned or refused.startswith(planned + "; ") and planned, (plan.candidate.label(),
                                                                                      planned, refused)
        accepted += not planned
    assert accepted >= 20
