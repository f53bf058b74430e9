"""The planner and the trainer judge a layout by the same rules (`ParallelLayout.problems`): every candidate the
planner considers is feasible in its eyes (memory aside) exactly when `tensorpar train --dry-run` accepts it, and
each refusal gives the same reason."""

import json

import pytest

from tensorpar.config.choices import PLANNED_SCHEDULES
from tensorpar.errors import TensorparError
from tensorpar.models import get_config
from tensorpar.planning.cluster import make_cluster
from tensorpar.planning.search import search
from tensorpar.training import TrainOptions, validate
from tensorpar.training.dry_run import dry_run

from conftest import TINY8

MEMORY = "exceeds memory"
CASES = {  # name: (model, GPUs, GPUs per node, sequence length, global batch, precision, search space)
    "dense-8-bf16": (TINY8, 8, 8, 64, 16, "tensorpar-bf16", {"virtual_stages": (1, 2, 3)}),
    "dense-8-fp8": (TINY8, 8, 8, 64, 16, "tensorpar-fp8", {"virtual_stages": (1, 2)}),
    "moe-8-fp8": (get_config("tiny-moe"), 8, 8, 48, 8, "tensorpar-fp8-rowwise", {"virtual_stages": (1, 2)}),
    "llama-70b-64": (get_config("llama-70b"), 64, 8, 4096, 64, "tensorpar-bf16",
                     {"virtual_stages": (1, 5), "max_micro_batch": 1}),
}


def _train_options(candidate, path: str, seq_len: int, global_batch: int, precision: str) -> TrainOptions:
    lay = candidate.layout
    dtype = "fp8" if "fp8" in precision else precision.split("-")[1]
    return TrainOptions(
        model=path, tp=lay.tp, cp=lay.cp, pp=lay.pp, dp=lay.dp, dp_replicate=lay.dp_replicate, ep=lay.ep,
        zero=lay.zero, schedule=lay.schedule, virtual_stages=lay.virtual_stages,
        pipeline_layers=",".join(map(str, lay.pipeline_layers)) if lay.pipeline_layers else None,
        sequence_parallel=lay.sequence_parallel, micro_batch_size=candidate.micro_batch_size,
        recompute=candidate.recompute, dtype=dtype, fp8_recipe="rowwise" if "rowwise" in precision else "tensorwise",
        seq_len=seq_len, global_batch_size=global_batch, steps=1, dry_run=True, world_size=lay.world,
        device="cpu", progress=False)


def _refusal(options) -> str:
    """What `tensorpar train --dry-run` says of these options before building anything: '' when it accepts them."""
    try:
        validate(options, options.world_size)
    except TensorparError as e:
        return str(e)
    return ""


@pytest.mark.parametrize("case", list(CASES))
def test_the_planner_offers_exactly_the_layouts_training_accepts(case, tmp_path):
    cfg, gpus, per_node, seq_len, batch, precision, space = CASES[case]
    path = tmp_path / "model.json"
    path.write_text(json.dumps(cfg.to_dict()))
    plans = search(cfg, make_cluster("h100-80gb", gpus, gpus_per_node=per_node), seq_len, batch, precision,
                   schedules=PLANNED_SCHEDULES, recompute=("none",), **space)
    reasons, accepted = set(), 0
    for plan in plans:
        planned = "" if plan.feasible or plan.reason.startswith(MEMORY) else plan.reason
        refused = _refusal(_train_options(plan.candidate, str(path), seq_len, batch, precision))
        assert refused == planned or refused.startswith(planned + "; ") and planned, (
            f"{plan.candidate.label()} {plan.candidate.schedule}: the planner says {planned!r}, train {refused!r}")
        reasons.add(planned.split(" ")[0] if planned else "")
        accepted += not planned
    # The cases exercise the rules: several kinds of refusal and many accepted layouts, every schedule among them
    # (with fp8 GEMMs the zero-bubble ones are refused, their split backward being what fp8 cannot run under).
    assert accepted >= 20 and len(reasons) >= 3, (accepted, reasons)
    schedules = {p.candidate.schedule for p in plans if p.feasible or p.reason.startswith(MEMORY)}
    zero_bubble = {"zb-h1", "zbv"}
    assert schedules == set(PLANNED_SCHEDULES) - (zero_bubble if "fp8" in precision else set()), schedules


def test_the_dry_run_builds_what_the_planner_accepts(tmp_path):
    """One accepted layout per schedule goes through the whole dry run (the meta model on one rank of 64)."""
    cfg, gpus, per_node, seq_len, batch, precision, space = CASES["llama-70b-64"]
    path = tmp_path / "model.json"
    path.write_text(json.dumps(cfg.to_dict()))
    plans = search(cfg, make_cluster("h100-80gb", gpus), seq_len, batch, precision, schedules=PLANNED_SCHEDULES,
                   recompute=("none",), zero=(1,), tp=(8,), **space)
    for schedule in PLANNED_SCHEDULES:
        plan = next(p for p in plans if p.feasible and p.candidate.schedule == schedule)
        options = _train_options(plan.candidate, str(path), seq_len, batch, precision)
        result = dry_run(validate(options, options.world_size), rank=gpus - 1)
        assert result["parameter_bytes"] > 0, schedule
