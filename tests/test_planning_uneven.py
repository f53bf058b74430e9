"""The planner with uneven pipeline stages (Layout.pipeline_layers, as `tensorpar train --pipeline-layers`)."""

from tensorpar.models.placement import PipelineStage, Placement
from tensorpar.models.transformer import Transformer
from tensorpar.planning.cluster import make_cluster
from tensorpar.planning.candidates import Candidate, candidate_problem, stage_layer_indices, stage_layers
from tensorpar.planning.memory import layout_memory, stage_memory
from tensorpar.planning.params import local_parameters
from tensorpar.planning.step_time import predict_step_time

from conftest import TINY8


def test_planned_stage_parameters_are_the_real_stage_parameters():
    layout = Candidate.of(pp=2, pipeline_layers=(2, 6))
    assert stage_layers(TINY8, layout, 0) == (True, False, 2)
    assert stage_layers(TINY8, layout, 1) == (False, True, 6)
    assert stage_layer_indices(TINY8, layout, 1) == list(range(2, 8))
    for stage in (0, 1):
        real = Transformer(TINY8, Placement.on(stage=PipelineStage(tuple(stage_layer_indices(TINY8, layout, stage)),
                                                                   stage == 0, stage == 1)), init=False)
        planned = local_parameters(TINY8, 1, 2, stage, pipeline_layers=layout.pipeline_layers)
        assert [(name, n) for name, n, _ in planned] == [(k, p.numel()) for k, p in real.named_parameters()]
    light, heavy = (stage_memory(TINY8, layout, 16, 8, "tensorpar-fp32", stage=s) for s in (0, 1))
    assert light.total < heavy.total


def test_the_planner_refuses_a_bad_split():
    cluster = make_cluster("h100-80gb", 2)
    assert candidate_problem(TINY8, Candidate.of(pp=2, pipeline_layers=(2, 6)), cluster, 16, 8) == ""
    assert "sums to 7 layers" in candidate_problem(TINY8, Candidate.of(pp=2, pipeline_layers=(3, 4)), cluster, 16, 8)
    assert "--virtual-stages 1" in candidate_problem(TINY8, Candidate.of(pp=2, virtual_stages=2, pipeline_layers=(2, 6)),
                                                      cluster, 16, 8)


def test_the_most_loaded_stage_may_be_a_middle_one():
    layout = Candidate.of(pp=4, pipeline_layers=(1, 1, 5, 1))
    per_stage = [stage_memory(TINY8, layout, 16, 8, "tensorpar-fp32", stage=s).total for s in range(4)]
    assert max(per_stage) == per_stage[2] == layout_memory(TINY8, layout, 16, 8, "tensorpar-fp32").total
    even = predict_step_time(TINY8, Candidate.of(pp=4), make_cluster("h100-80gb", 4), 16, 8, "tensorpar-fp32")
    uneven = predict_step_time(TINY8, layout, make_cluster("h100-80gb", 4), 16, 8, "tensorpar-fp32")
    assert uneven.compute_s > even.compute_s  # the 5-layer stage is the slowest


def test_tensorpar_plan_takes_pipeline_layers():
    import pytest

    from tensorpar.commands.plan import plan_layouts
    from tensorpar.config.options import PlanOptions
    from tensorpar.errors import LayoutError

    base = dict(model="llama-8b", gpus=16, gpu="h100-80gb", seq_len=4096, global_batch_size=64,
                recompute=["none"], zero=[1])
    _, _, plans = plan_layouts(PlanOptions(**base, pipeline_layers="6,10,10,6"))
    assert plans and all(p.candidate.pp == 4 and p.candidate.pipeline_layers == (6, 10, 10, 6) for p in plans)
    assert any(p.feasible for p in plans)
    with pytest.raises(LayoutError, match="sums to 31 layers but the model has 32"):
        plan_layouts(PlanOptions(**base, pipeline_layers="6,10,10,5"))
