"""The planner's communication model: alpha-beta times, and predicted bytes per (op, group) EQUAL what
`CommStats` counts for the model's forward/backward (TP 2 and 4, SP on/off, full recomputation, bf16 autocast),
a whole training step with DP and ZeRO 0/1/2/3, LoRA fine-tuning (with fp8 GEMMs, CP and the zero-bubble schedules
too), and pipelined steps; the parameters each rank holds equal the planner's list.
"""

from __future__ import annotations

import pytest
import torch

from tensorpar.models.placement import PipelineStage, Placement
from tensorpar.config import hardware
from tensorpar.models import get_config
from tensorpar.planning import collective_cost, communication, memory, precision_recipes
from tensorpar.planning import params as planned_params
from tensorpar.planning.candidates import Candidate

from harness import mesh as harness_mesh
from planning_cases import CONFIGS, GPT2_SHAPE, WORLD  # noqa: F401


def test_alpha_beta_formulas():
    link = hardware.Link(100e9, 5e-6)
    B, n = 64e6, 8
    ring = lambda op: collective_cost.collective_time(op, B, n, link, "ring")  # noqa: E731
    tree = lambda op: collective_cost.collective_time(op, B, n, link, "tree")  # noqa: E731
    assert ring("all_reduce") == pytest.approx(2 * 7 * (5e-6 + B / (8 * 100e9)))
    assert ring("all_gather") == ring("reduce_scatter") == pytest.approx(7 * (5e-6 + B / (8 * 100e9)))
    assert ring("all_reduce") == pytest.approx(ring("all_gather") + ring("reduce_scatter"))
    assert tree("all_reduce") == pytest.approx(2 * 3 * (5e-6 + B / 100e9))
    assert tree("broadcast") == tree("reduce") == pytest.approx(3 * (5e-6 + B / 100e9))
    assert collective_cost.collective_time("send", B, n, link) == pytest.approx(5e-6 + B / 100e9)
    assert collective_cost.collective_time("all_reduce", B, 1, link) == 0.0
    # small messages: the tree's log2(n) latency wins; large ones: the ring's bandwidth
    assert collective_cost.collective_time("all_reduce", 8, 64, link) == collective_cost.collective_time("all_reduce", 8, 64, link, "tree")
    assert collective_cost.collective_time("all_reduce", B, 64, link) == collective_cost.collective_time("all_reduce", B, 64, link, "ring")


def check_model_comm_and_params(tp, config, sp, recompute, bf16, lora=None):
    """One micro-batch forward/backward: counted bytes per (op, group), and the local parameters; `lora`: a
    LoraSpec, the adapters trained and the base frozen."""
    from tensorpar.models import Transformer

    cfg = CONFIGS[config]
    m = harness_mesh(tp=tp, dp=WORLD // tp)
    torch.manual_seed(0)
    B, S = 2, 16
    ids = torch.randint(0, cfg.vocab_size, (B, S))
    targets = torch.randint(0, cfg.vocab_size, (B, S))
    model = Transformer(cfg, Placement.on(m, sequence_parallel=sp, recompute=recompute, lora=lora), seed=1)
    model.train()
    m.stats.reset()
    ctx = torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else torch.autocast("cpu", enabled=False)
    with ctx:
        loss = model(ids, targets)
    loss.backward()
    counted = {k: c.bytes for k, c in m.stats.snapshot().items()}
    predicted = communication.comm_bytes_per_step(cfg, Candidate.of(tp=tp, sequence_parallel=sp, recompute=recompute), B, S, 4,
                                         matmul_dtype_bytes=2 if bf16 else 4, lora=lora)
    params = [(n, p.numel(), p.ndim) for n, p in model.named_parameters()]
    grads = sum(p.grad.numel() * p.grad.element_size() for p in model.parameters() if p.grad is not None)
    return counted, predicted, params, grads


COMM_CASES = [
    (2, "tiny", False, "none", False),
    (2, "tiny", True, "none", False),
    (2, "tiny-gpt2", False, "none", False),
    (2, "tiny-gpt2", True, "full", True),
    (2, "gpt2-124m-2l", True, "none", True),
    (4, "tiny", False, "none", False),  # 2 KV heads at TP 4: replicated, gradients summed
    (4, "tiny", True, "full", False),
    (4, "tiny", False, "none", True),
    (4, "tiny-gpt2", True, "none", False),
    (4, "tiny-gpt2", False, "full", True),
    (4, "gpt2-124m-2l", False, "none", False),  # vocabulary 50257 padded to 50260
    # latent attention: the latents enter the region, the down-projections' gradients are summed under SP
    (2, "tiny-mla", False, "none", False),
    (2, "tiny-mla", True, "full", True),
    (4, "tiny-mla-mtp", True, "none", False),  # and a multi-token prediction module on the last stage
    (2, "tiny-mla-mtp", False, "none", True),
]


@pytest.mark.parametrize("tp,config,sp,recompute,bf16", COMM_CASES)
def test_predicted_comm_bytes_equal_counted_and_parameters_match(pools, tp, config, sp, recompute, bf16):
    cfg = CONFIGS[config]
    expected_params = planned_params.local_parameters(cfg, tp)
    for rank, (counted, predicted, params, grads) in enumerate(pools(WORLD).run(
            check_model_comm_and_params, tp, config, sp, recompute, bf16)):
        assert counted == predicted, f"rank {rank}: counted {counted} != predicted {predicted}"
        assert params == expected_params, f"rank {rank}: parameters differ from the prediction"
        assert grads == precision_recipes.PRECISIONS["tensorpar-fp32"].grad_bytes * planned_params.parameter_count(cfg, tp)


def check_training_step_comm(zero, micro_batches, fp8="", lora=None, sequence_parallel=True, recompute="none"):
    """A trainer step (tensorpar.training.trainer.train's loop body) at tp=2 x dp=2, with or without
    `sequence_parallel`; `fp8`: a recipe for the GEMMs (of fp32 parameters here, whose gradients are reduced in fp32
    over TP and DP alike); `lora`: a LoraSpec, the Llama-style model's adapters trained and its base frozen."""
    from tensorpar.tensor_parallel.fp8_scaling import Fp8Recipe
    from tensorpar.models import Transformer
    from tensorpar.data_parallel import data_parallel_optimizer
    from tensorpar.data_parallel import FullyShardedOptimizer

    cfg = CONFIGS["tiny" if lora else "tiny-gpt2"]
    m = harness_mesh(tp=2, dp=2)
    torch.manual_seed(m.dp_rank)
    B, S = 2, 16
    model = Transformer(cfg, Placement.on(m, sequence_parallel=sequence_parallel, fp8=Fp8Recipe(fp8) if fp8 else None,
                                          lora=lora, recompute=recompute), seed=1)
    model.train()
    if zero == 3:
        opt = FullyShardedOptimizer(model, m, lr=1e-3, weight_decay=0.1)
    else:
        opt = data_parallel_optimizer(model, m, lr=1e-3, weight_decay=0.1, zero=zero, bucket_bytes=64 * 1024)
    m.stats.reset()
    opt.begin_step(micro_batches)
    step_loss = torch.zeros(())
    for _ in range(micro_batches):
        ids = torch.randint(0, cfg.vocab_size, (B, S))
        loss = model(ids, ids.roll(-1, 1))
        (loss / micro_batches).backward()
        step_loss += loss.detach() / micro_batches
    opt.finish_backward()
    opt.clip_and_step(1.0)
    m.dp_group.all_reduce(step_loss)
    counted = {k: c.bytes for k, c in m.stats.snapshot().items()}
    layout = Candidate.of(tp=2, dp=2, sequence_parallel=sequence_parallel, micro_batch_size=B, zero=zero,
                          recompute=recompute)
    colls = communication.step_collectives(cfg, layout, S, micro_batches, bucket_bytes=64 * 1024, fp8_recipe=fp8,
                                           lora=lora)
    return counted, collective_cost.sum_bytes(colls)


# fp8: the GEMMs' amax all-reduces over TP, and under ZeRO-3 the weights gathered in fp8 (tensorwise)
@pytest.mark.parametrize("zero,fp8", [(0, ""), (1, ""), (2, ""), (3, ""), (3, "tensorwise"), (1, "rowwise")])
def test_predicted_training_step_comm_equals_counted(pools, zero, fp8):
    for rank, (counted, predicted) in enumerate(pools(WORLD).run(check_training_step_comm, zero, 2, fp8)):
        assert counted == predicted, f"rank {rank}: counted {counted} != predicted {predicted}"


LORA_TARGETS = {"all": None, "qv": ("q", "v")}  # None: LoraSpec's default targets, every linear


def lora_spec(targets: str):
    """LoraSpec(4, 8.0) on the linears LORA_TARGETS names."""
    from tensorpar.tensor_parallel.lora import LoraSpec

    return LoraSpec(4, 8.0) if LORA_TARGETS[targets] is None else LoraSpec(4, 8.0, LORA_TARGETS[targets])


@pytest.mark.parametrize("targets", LORA_TARGETS)
@pytest.mark.parametrize("sp", [True, False], ids=["sp", "no-sp"])
@pytest.mark.parametrize("zero", [1, 3])
def test_lora_training_step_comm_equals_counted(pools, zero, sp, targets):
    """LoRA's whole step, every group: over TP the adapters' own collectives and the frozen base's less its
    parameters' gradients and its first layer's input gradients; over DP the adapters' gradients alone (far less
    than full training's), and under ZeRO-3 the frozen base gathered and never reduced."""
    for rank, (counted, predicted) in enumerate(pools(WORLD).run(check_training_step_comm, zero, 2, "",
                                                                 lora_spec(targets), sp)):
        assert counted == predicted, f"rank {rank}: counted {counted} != predicted {predicted}"
        on_dp = {k: v for k, v in counted.items() if k[1] == "dp"}
        full = collective_cost.sum_bytes(communication.step_collectives(
            CONFIGS["tiny"], Candidate.of(tp=2, dp=2, sequence_parallel=sp, micro_batch_size=2, zero=zero), 16, 2,
            bucket_bytes=64 * 1024))
        reduced = {k: v for k, v in on_dp.items() if k[0] in ("all_reduce", "reduce_scatter") and v > 4}
        assert sum(reduced.values()) < 0.2 * sum(v for k, v in full.items() if k in reduced), (reduced, full)


# fp8 GEMMs with the base frozen: the first layer's q/k/v compute no gradient, so their backward amax all-reduce
# does not run, and ZeRO-3 gathers the frozen base in its own dtype (only trained weights are gathered in fp8)
# (under full recomputation the blocks' forward runs twice, its amax all-reduces too)
@pytest.mark.parametrize("zero,fp8,recompute", [(1, "tensorwise", "none"), (3, "tensorwise", "none"),
                                                (1, "rowwise", "none"), (1, "tensorwise", "full"), (3, "rowwise", "full")])
def test_lora_fp8_training_step_comm_equals_counted(pools, zero, fp8, recompute):
    for rank, (counted, predicted) in enumerate(pools(WORLD).run(check_training_step_comm, zero, 2, fp8,
                                                                 lora_spec("all"), True, recompute)):
        assert counted == predicted, f"rank {rank}: counted {counted} != predicted {predicted}"


# one micro-batch: replicated KV heads (TP 4) under full recomputation, bf16 autocast, and first layers whose
# attention has no adapter (its exit gathers no output gradient) or whose MLP has none
LORA_MODEL_CASES = [(4, True, "full", False, ("q", "k", "v", "o", "gate", "up", "down")),
                    (2, False, "full", True, ("o", "down")), (2, True, "none", False, ("gate", "up", "down"))]


@pytest.mark.parametrize("tp,sp,recompute,bf16,targets", LORA_MODEL_CASES,
                         ids=["tp4-replicated-kv-full", "bf16-full-o-down", "sp-mlp-only"])
def test_lora_model_comm_equals_counted(pools, tp, sp, recompute, bf16, targets):
    from tensorpar.tensor_parallel.lora import LoraSpec

    for rank, (counted, predicted, *_) in enumerate(pools(WORLD).run(
            check_model_comm_and_params, tp, "tiny", sp, recompute, bf16, LoraSpec(4, 8.0, targets))):
        assert counted == predicted, f"rank {rank}: counted {counted} != predicted {predicted}"


def check_pipeline_step_comm(tp, pp, dp, schedule, v, zero, sp, lora=None):
    """A pipelined trainer step (PipelineRunner + the bucketed DP optimizer), as tensorpar.training.trainer runs it;
    the zero-bubble schedules with their weight-gradient queue. `lora`: a LoraSpec on the Llama-style model."""
    from tensorpar.models import Transformer
    from tensorpar.data_parallel import data_parallel_optimizer
    from tensorpar.layout import ParallelLayout
    from tensorpar.layout.stages import splits_backward
    from tensorpar.pipeline_parallel.runner import PipelineRunner
    from tensorpar.pipeline_parallel.weight_grad import WeightGradQueue

    # 4 layers; GPT-2: tied embeddings on the first and last stage, learned positions (LoRA needs a Llama-style one)
    cfg = get_config("tiny" if lora else "tiny-gpt2")
    m = harness_mesh(tp=tp, pp=pp, dp=dp)
    run_layout = ParallelLayout(tp=tp, pp=pp, dp=dp, schedule=schedule, virtual_stages=v, sequence_parallel=sp)
    stage = PipelineStage.of(run_layout, cfg.num_layers, m.pp_rank)
    queue = WeightGradQueue() if splits_backward(schedule) else None
    model = Transformer(cfg, Placement.on(m, sequence_parallel=sp, stage=stage, lora=lora, weight_grads=queue), seed=1)
    model.train()
    B, S, micro_batches = 2, 16, 4
    opt = data_parallel_optimizer(model, m, lr=1e-3, weight_decay=0.1, zero=zero, bucket_bytes=64 * 1024)
    runner = PipelineRunner(model, m, run_layout, micro_batches, (B, S // tp if sp else S, cfg.hidden_size),
                            weight_grads=queue)
    torch.manual_seed(m.dp_rank)
    batches = [torch.randint(0, cfg.vocab_size, (B, S + 1)) for _ in range(micro_batches)]
    m.stats.reset()
    opt.begin_step(micro_batches)
    step_loss = torch.zeros(()) + runner.train_step(batches, lambda i: i)
    opt.finish_backward()
    opt.clip_and_step(1.0)
    m.dp_group.all_reduce(step_loss)
    counted = {k: c.bytes for k, c in m.stats.snapshot().items()}
    layout = Candidate.of(tp=tp, pp=pp, dp=dp, sequence_parallel=sp, micro_batch_size=B, zero=zero, virtual_stages=v,
                          schedule=schedule)
    colls = communication.step_collectives(cfg, layout, S, micro_batches, stage=m.pp_rank, bucket_bytes=64 * 1024,
                                           lora=lora)
    params = [(n, p.numel(), p.ndim) for n, p in model.named_parameters()]
    expected = planned_params.layout_parameters(cfg, run_layout, m.pp_rank, lora)
    return counted, collective_cost.sum_bytes(colls), params, expected, runner.peak_in_flight, m.pp_rank


PIPELINE_CASES = [(2, 2, 1, "1f1b", 1, 0, True), (1, 2, 2, "interleaved", 2, 1, False), (1, 4, 1, "afab", 1, 0, False)]


@pytest.mark.parametrize("tp,pp,dp,schedule,v,zero,sp", PIPELINE_CASES)
def test_predicted_pipeline_step_comm_equals_counted(pools, tp, pp, dp, schedule, v, zero, sp):
    layout = Candidate.of(tp=tp, pp=pp, dp=dp, virtual_stages=v)
    for rank, (counted, predicted, params, expected, peak, stage) in enumerate(pools(WORLD).run(
            check_pipeline_step_comm, tp, pp, dp, schedule, v, zero, sp)):
        assert counted == predicted, f"rank {rank}: counted {counted} != predicted {predicted}"
        assert params == expected, f"rank {rank}: parameters differ from the prediction"
        if schedule != "afab":  # the memory model's chunk-forwards in flight (1F1B / interleaved)
            assert peak == memory.in_flight(layout, 4, stage), f"rank {rank}: {peak} in flight"


# LoRA through the zero-bubble schedules (the base's weight gradients, which they defer, do not exist)
@pytest.mark.parametrize("tp,pp,dp,schedule,v,zero,sp", [(2, 2, 1, "zb-h1", 1, 0, True),
                                                         (1, 2, 2, "zbv", 2, 1, False)])
def test_lora_pipeline_step_comm_equals_counted(pools, tp, pp, dp, schedule, v, zero, sp):
    for rank, (counted, predicted, params, expected, _, _) in enumerate(pools(WORLD).run(
            check_pipeline_step_comm, tp, pp, dp, schedule, v, zero, sp, lora_spec("all"))):
        assert counted == predicted, f"rank {rank}: counted {counted} != predicted {predicted}"
        assert params == expected, f"rank {rank}: parameters differ from the prediction"


def check_context_parallel_comm(tp, cp, config, sp, recompute, bf16, lora=None):
    """One micro-batch forward/backward at tp x cp: counted bytes per (op, group) against the prediction; `lora`: a
    LoraSpec, the adapters trained and the base frozen."""
    from tensorpar.models import Transformer

    cfg = CONFIGS[config]
    m = harness_mesh(tp=tp, cp=cp, dp=WORLD // (tp * cp))
    torch.manual_seed(0)
    B, S = 2, 16
    ids = torch.randint(0, cfg.vocab_size, (B, S))
    model = Transformer(cfg, Placement.on(m, sequence_parallel=sp, recompute=recompute, lora=lora), seed=1)
    model.train()
    m.stats.reset()
    ctx = torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else torch.autocast("cpu", enabled=False)
    with ctx:
        loss = model(ids, ids.roll(-1, 1))
    loss.backward()
    counted = {k: c.bytes for k, c in m.stats.snapshot().items()}
    layout = Candidate.of(tp=tp, cp=cp, sequence_parallel=sp, recompute=recompute)
    predicted = communication.comm_bytes_per_step(cfg, layout, B, S, 4, matmul_dtype_bytes=2 if bf16 else 4,
                                                  lora=lora)
    return counted, predicted


@pytest.mark.parametrize("tp,cp,config,sp,recompute,bf16", [
    (1, 2, "tiny", False, "none", False),
    (1, 4, "tiny", False, "selective", False),
    (2, 2, "tiny", True, "none", True),
    (2, 2, "tiny-gpt2", False, "full", False),
])
def test_predicted_context_parallel_comm_equals_counted(pools, tp, cp, config, sp, recompute, bf16):
    for rank, (counted, predicted) in enumerate(pools(WORLD).run(check_context_parallel_comm, tp, cp, config, sp,
                                                                 recompute, bf16)):
        assert counted == predicted, f"rank {rank}: counted {counted} != predicted {predicted}"


@pytest.mark.parametrize("tp,cp,sp,recompute", [(1, 2, False, "none"), (2, 2, True, "selective")])
def test_lora_context_parallel_comm_equals_counted(pools, tp, cp, sp, recompute):
    """LoRA at CP: the ring's K/V blocks and gradients as in full training, the adapters' TP collectives on each
    rank's sequence shard."""
    for rank, (counted, predicted) in enumerate(pools(WORLD).run(check_context_parallel_comm, tp, cp, "tiny", sp,
                                                                 recompute, False, lora_spec("qv"))):
        assert counted == predicted, f"rank {rank}: counted {counted} != predicted {predicted}"


def test_tp_overlap_pieces_change_calls_not_bytes():
    """tensorpar's TP overlap sends the chunked collectives in pieces: the same bytes (what the counted runs above
    check), one latency per piece."""
    from tensorpar.planning.cluster import make_cluster
    from tensorpar.planning.collective_cost import Collective, collectives_time, sum_bytes
    from tensorpar.planning.communication import model_collectives

    cfg = CONFIGS["tiny"]
    for sp in (False, True):
        layout = Candidate.of(tp=2, sequence_parallel=sp)
        one = model_collectives(cfg, layout, 2, 16)
        two = model_collectives(cfg, layout, 2, 16, tp_pieces=2)
        assert sum_bytes(one) == sum_bytes(two) and any(c.pieces == 2 for c in two)
    cluster = make_cluster("h100", 8, intra_bandwidth=1e9, intra_latency=1e-3, link_efficiency=1.0)
    layout = Candidate.of(tp=2)
    whole = collectives_time([Collective("all_reduce", "tp", 1 << 20)], cluster, layout)
    halves = collectives_time([Collective("all_reduce", "tp", 1 << 20, pieces=2)], cluster, layout)
    assert halves == pytest.approx(whole + 2 * 1e-3)  # ring all-reduce over 2 ranks: 2 latencies per call
