"""The planner against tensorpar itself (gloo, this machine) and against published Megatron-LM runs.

- communication: predicted bytes per (op, group) EQUAL what `CommStats` counts, for the model's
  forward/backward (TP 2 and 4, SP on/off, full recomputation, bf16 autocast) and for a whole
  training step with data parallelism and ZeRO 0/1/2 (tensorpar's DistributedOptimizer);
- memory: parameter, gradient and AdamW-state bytes per rank equal the real tensors; activation
  bytes within 10% of the bytes saved for backward (measured: they agree to a few bytes);
- published runs: GPT-3 175B on 1024 A100s and the 1T model on 3072 A100s (Narayanan et al. 2021):
  predicted per-GPU throughput within 20%, and their layout among the planner's top choices.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import subprocess
import sys

import pytest
import torch

from harness import mesh as harness_mesh
from tensorpar.errors import TensorparError
from tensorpar.models.config import ModelConfig, get_config
from tensorpar.commands import plan as plan_command
from tensorpar.planning import comm, compute, hardware, memory, params as planned_params, precision, search as search_mod, step_time
from tensorpar.planning.layout import Layout

WORLD = 4  # one pool of 4 gloo processes for every check: TP 2 runs as 2 TP groups x DP 2, TP 4 as one
GPT2_SHAPE = get_config("gpt2-124m").replace(num_layers=2)  # GPT-2 124M's widths and vocabulary, 2 layers
CONFIGS = {
    "tiny": get_config("tiny").replace(num_layers=2),  # Llama-style, 4 heads / 2 KV heads (replicated at TP 4)
    "tiny-gpt2": get_config("tiny-gpt2").replace(num_layers=2),  # LayerNorm, biases, learned positions, tied
    "gpt2-124m-2l": GPT2_SHAPE,
}


# --------------------------------------------------------------------------- hardware and alpha-beta


def test_gpu_catalog_aliases_overrides_and_unknown_names():
    assert hardware.get_gpu("H100-SXM") is hardware.get_gpu("h100-80gb")
    assert hardware.get_gpu("a100-40gb").memory_bytes == 40 * hardware.GiB
    with pytest.raises(TensorparError, match="known GPUs: .*a100-80gb.*h100-80gb"):
        hardware.get_gpu("v100")
    cl = hardware.make_cluster("a100-80gb", 64, intra_bandwidth=200e9, inter_latency=1e-5, mfu_ceiling=0.5,
                               memory_gib=75)
    assert cl.intra.bandwidth == 200e9 and cl.inter.latency == 1e-5 and cl.inter.bandwidth == 25e9
    assert cl.mfu_ceiling == 0.5 and cl.memory_bytes == 75 * hardware.GiB and cl.nodes == 8
    assert cl.link_for_span(8) is cl.intra and cl.link_for_span(16) is cl.inter
    with pytest.raises(TensorparError, match="whole nodes"):
        hardware.make_cluster("h100", 12)


def test_alpha_beta_formulas():
    link = hardware.Link(100e9, 5e-6)
    B, n = 64e6, 8
    ring = lambda op: comm.collective_time(op, B, n, link, "ring")  # noqa: E731
    tree = lambda op: comm.collective_time(op, B, n, link, "tree")  # noqa: E731
    assert ring("all_reduce") == pytest.approx(2 * 7 * (5e-6 + B / (8 * 100e9)))
    assert ring("all_gather") == ring("reduce_scatter") == pytest.approx(7 * (5e-6 + B / (8 * 100e9)))
    assert ring("all_reduce") == pytest.approx(ring("all_gather") + ring("reduce_scatter"))
    assert tree("all_reduce") == pytest.approx(2 * 3 * (5e-6 + B / 100e9))
    assert tree("broadcast") == tree("reduce") == pytest.approx(3 * (5e-6 + B / 100e9))
    assert comm.collective_time("send", B, n, link) == pytest.approx(5e-6 + B / 100e9)
    assert comm.collective_time("all_reduce", B, 1, link) == 0.0
    # small messages: the tree's log2(n) latency wins; large ones: the ring's bandwidth
    assert comm.collective_time("all_reduce", 8, 64, link) == comm.collective_time("all_reduce", 8, 64, link, "tree")
    assert comm.collective_time("all_reduce", B, 64, link) == comm.collective_time("all_reduce", B, 64, link, "ring")


# --------------------------------------------------------------------------- communication == CommStats


def check_model_comm_and_params(tp, config, sp, recompute, bf16):
    """One micro-batch forward/backward: counted bytes per (op, group), and the local parameters."""
    from tensorpar.models import Transformer

    cfg = CONFIGS[config]
    m = harness_mesh(tp=tp, dp=WORLD // tp)
    torch.manual_seed(0)
    B, S = 2, 16
    ids = torch.randint(0, cfg.vocab_size, (B, S))
    targets = torch.randint(0, cfg.vocab_size, (B, S))
    model = Transformer(cfg, m, sequence_parallel=sp, recompute=recompute, seed=1)
    model.train()
    m.stats.reset()
    ctx = torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else torch.autocast("cpu", enabled=False)
    with ctx:
        loss = model(ids, targets)
    loss.backward()
    counted = {k: c.bytes for k, c in m.stats.snapshot().items()}
    predicted = comm.comm_bytes_per_step(cfg, Layout(tp=tp, sequence_parallel=sp, recompute=recompute), B, S, 4,
                                         matmul_dtype_bytes=2 if bf16 else 4)
    params = [(n, p.numel(), p.ndim) for n, p in model.named_parameters()]
    grads = sum(p.grad.numel() * p.grad.element_size() for p in model.parameters())
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
]


@pytest.mark.parametrize("tp,config,sp,recompute,bf16", COMM_CASES)
def test_predicted_comm_bytes_equal_counted_and_parameters_match(pools, tp, config, sp, recompute, bf16):
    cfg = CONFIGS[config]
    expected_params = planned_params.local_parameters(cfg, tp)
    for rank, (counted, predicted, params, grads) in enumerate(pools(WORLD).run(
            check_model_comm_and_params, tp, config, sp, recompute, bf16)):
        assert counted == predicted, f"rank {rank}: counted {counted} != predicted {predicted}"
        assert params == expected_params, f"rank {rank}: parameters differ from the prediction"
        assert grads == precision.PRECISIONS["tensorpar-fp32"].grad_bytes * planned_params.parameter_count(cfg, tp)


def check_training_step_comm(zero, micro_batches):
    """A trainer step (tensorpar.training.trainer.train's loop body) at tp=2 x dp=2."""
    from tensorpar.models import Transformer
    from tensorpar.parallel.data_parallel import DistributedOptimizer

    cfg = CONFIGS["tiny-gpt2"]
    m = harness_mesh(tp=2, dp=2)
    torch.manual_seed(m.dp_rank)
    B, S = 2, 16
    model = Transformer(cfg, m, sequence_parallel=True, seed=1)
    model.train()
    opt = DistributedOptimizer(model, m, lr=1e-3, weight_decay=0.1, zero=zero, bucket_bytes=64 * 1024)
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
    layout = Layout(tp=2, dp=2, sequence_parallel=True, micro_batch_size=B, zero=zero)
    colls = comm.step_collectives(cfg, layout, S, micro_batches, bucket_bytes=64 * 1024)
    return counted, comm.sum_bytes(colls)


@pytest.mark.parametrize("zero", [0, 1, 2])
def test_predicted_training_step_comm_equals_counted(pools, zero):
    for rank, (counted, predicted) in enumerate(pools(WORLD).run(check_training_step_comm, zero, 2)):
        assert counted == predicted, f"rank {rank}: counted {counted} != predicted {predicted}"


def check_pipeline_step_comm(tp, pp, dp, schedule, v, zero, sp):
    """A pipelined trainer step (PipelineRunner + DistributedOptimizer), as tensorpar.training.trainer runs it."""
    from tensorpar.models import Transformer
    from tensorpar.parallel.data_parallel import DistributedOptimizer
    from tensorpar.parallel.pipeline import PipelineRunner, rank_layers

    cfg = get_config("tiny-gpt2")  # 4 layers: tied embeddings on the first and last stage, learned positions
    m = harness_mesh(tp=tp, pp=pp, dp=dp)
    chunks = rank_layers(cfg.num_layers, pp, m.pp_rank, v)
    model = Transformer(cfg, m, sequence_parallel=sp, seed=1, layers=[i for c in chunks for i in c],
                        first_stage=m.pp_rank == 0, last_stage=m.pp_rank == pp - 1)
    model.train()
    B, S, micro_batches = 2, 16, 4
    opt = DistributedOptimizer(model, m, lr=1e-3, weight_decay=0.1, zero=zero, bucket_bytes=64 * 1024)
    runner = PipelineRunner(model, m, schedule, v, micro_batches, (B, S // tp if sp else S, cfg.hidden_size))
    torch.manual_seed(m.dp_rank)
    batches = [torch.randint(0, cfg.vocab_size, (B, S + 1)) for _ in range(micro_batches)]
    m.stats.reset()
    opt.begin_step(micro_batches)
    step_loss = torch.zeros(()) + runner.train_step(batches, lambda i: i)
    opt.finish_backward()
    opt.clip_and_step(1.0)
    m.dp_group.all_reduce(step_loss)
    counted = {k: c.bytes for k, c in m.stats.snapshot().items()}
    layout = Layout(tp=tp, pp=pp, dp=dp, sequence_parallel=sp, micro_batch_size=B, zero=zero, virtual_stages=v)
    colls = comm.step_collectives(cfg, layout, S, micro_batches, stage=m.pp_rank, bucket_bytes=64 * 1024)
    params = [(n, p.numel(), p.ndim) for n, p in model.named_parameters()]
    expected = planned_params.local_parameters(cfg, tp, pp, m.pp_rank, v)
    return counted, comm.sum_bytes(colls), params, expected, runner.peak_in_flight, m.pp_rank


PIPELINE_CASES = [(2, 2, 1, "1f1b", 1, 0, True), (1, 2, 2, "interleaved", 2, 1, False), (1, 4, 1, "afab", 1, 0, False)]


@pytest.mark.parametrize("tp,pp,dp,schedule,v,zero,sp", PIPELINE_CASES)
def test_predicted_pipeline_step_comm_equals_counted(pools, tp, pp, dp, schedule, v, zero, sp):
    layout = Layout(tp=tp, pp=pp, dp=dp, virtual_stages=v)
    for rank, (counted, predicted, params, expected, peak, stage) in enumerate(pools(WORLD).run(
            check_pipeline_step_comm, tp, pp, dp, schedule, v, zero, sp)):
        assert counted == predicted, f"rank {rank}: counted {counted} != predicted {predicted}"
        assert params == expected, f"rank {rank}: parameters differ from the prediction"
        if schedule != "afab":  # the memory model's chunk-forwards in flight (1F1B / interleaved)
            assert peak == memory.in_flight(layout, 4, stage), f"rank {rank}: {peak} in flight"


# --------------------------------------------------------------------------- memory == real tensors


def _optimizer_state_bytes(model) -> int:
    from tensorpar.optim import build_optimizer

    opt = build_optimizer(model, 1e-3, 0.1)
    opt.step()
    return sum(t.numel() * t.element_size() for st in opt.state.values() for t in st.values() if torch.is_tensor(t))


def check_parameter_memory(tp, config):
    """Parameters, gradients and AdamW states of one rank, in bytes."""
    from tensorpar.models import Transformer

    cfg = CONFIGS[config]
    m = harness_mesh(tp=tp, dp=WORLD // tp) if tp > 1 else None  # tp = 1 runs here, in the test process
    model = Transformer(cfg, m, seed=1)
    ids = torch.randint(0, cfg.vocab_size, (1, 8))
    model(ids, ids).backward()
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    grads = sum(p.grad.numel() * p.grad.element_size() for p in model.parameters())
    return params, grads, _optimizer_state_bytes(model)


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("config", ["tiny", "gpt2-124m-2l"])
def test_parameter_gradient_optimizer_bytes_equal_real_tensors(pools, tp, config):
    cfg = CONFIGS[config]
    prec = precision.PRECISIONS["tensorpar-fp32"]
    params = planned_params.local_parameters(cfg, tp)
    mb = memory.stage_memory(cfg, Layout(tp=tp), 8, 1, prec)
    results = [check_parameter_memory(tp, config)] if tp == 1 else pools(WORLD).run(check_parameter_memory, tp, config)
    for rank, (p, g, o) in enumerate(results):
        assert (p, g, o) == (mb.parameters, mb.gradients, mb.optimizer), f"rank {rank}"
        assert o == memory.optimizer_state_bytes(params, prec)
    if config == "gpt2-124m-2l" and tp == 4:  # 50257 rows padded to 50260 and split 4 ways
        assert dict((n, k) for n, k, _ in params)["embed.weight"] == 50260 // 4 * 768


class _LiveStorages(torch.utils._python_dispatch.TorchDispatchMode):
    """Every storage an op creates while active (weakly): what is still alive afterwards was kept for backward."""

    def __init__(self):
        super().__init__()
        self.storages = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.multiprocessing.reductions import StorageWeakRef

        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                st = t.untyped_storage()
                self.storages.setdefault(st._cdata, (StorageWeakRef(st), st.nbytes()))
        return out


def measure_saved_bytes(model, ids, targets, bf16: bool, method: str) -> int:
    """Bytes kept for backward by one forward, each storage once, parameters excluded.

    "hooks": every tensor autograd saves (saved_tensors_hooks). "live": storages created during
    the forward and still alive after it (needed under recomputation: checkpoint's own hooks
    replace ours inside checkpointed regions, and the inputs it keeps are not saved tensors)."""
    params = {p.untyped_storage()._cdata for p in model.parameters()}
    ctx = torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else torch.autocast("cpu", enabled=False)
    if method == "hooks":
        seen = {}

        def pack(t):
            st = t.untyped_storage()
            if st._cdata not in params:
                seen[st._cdata] = st.nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), ctx:
            loss = model(ids, targets)
        return sum(seen.values())
    mode = _LiveStorages()
    with mode, ctx:
        ids = ids.clone()  # created inside, so that the ids the embedding keeps are counted
        loss = model(ids, targets)
    del ids
    gc.collect()
    keep = loss.untyped_storage()._cdata
    return sum(n for k, (ref, n) in mode.storages.items() if not ref.expired() and k not in params and k != keep)


def check_activations(tp, config, sp, recompute, bf16, method):
    from tensorpar.models import Transformer

    cfg = CONFIGS[config]
    m = harness_mesh(tp=tp, dp=WORLD // tp) if tp > 1 else None
    torch.manual_seed(0)
    B, S = 2, 32
    ids = torch.randint(0, cfg.vocab_size, (B, S))
    targets = torch.randint(0, cfg.vocab_size, (B, S))
    model = Transformer(cfg, m, sequence_parallel=sp, recompute=recompute, seed=1)
    model.train()
    return measure_saved_bytes(model, ids, targets, bf16, method)


ACTIVATION_CASES = [(1, c, False, rc, bf16) for c in ("tiny", "tiny-gpt2") for rc in ("none", "selective", "full")
                    for bf16 in (False, True)] + [
    (2, "tiny", True, "none", False), (2, "tiny", True, "none", True), (2, "tiny", False, "selective", True),
    (2, "tiny-gpt2", True, "full", False), (2, "tiny-gpt2", False, "none", True)]


@pytest.mark.parametrize("tp,config,sp,recompute,bf16", ACTIVATION_CASES)
def test_activation_memory_matches_saved_tensors(pools, tp, config, sp, recompute, bf16):
    cfg = CONFIGS[config]
    prec = "tensorpar-bf16" if bf16 else "tensorpar-fp32"
    mb = memory.stage_memory(cfg, Layout(tp=tp, sequence_parallel=sp, micro_batch_size=2, recompute=recompute),
                             32, 2, prec)
    predicted = mb.activations + mb.weight_copies
    method = "hooks" if recompute == "none" else "live"
    args = (tp, config, sp, recompute, bf16, method)
    measured = [check_activations(*args)] if tp == 1 else pools(WORLD).run(check_activations, *args)
    for rank, got in enumerate(measured):
        assert abs(predicted - got) <= 0.10 * got, f"rank {rank}: predicted {predicted} vs measured {got}"
        assert abs(predicted - got) <= 1024, f"rank {rank}: predicted {predicted} vs measured {got} (expected ~exact)"


def test_playbook_activation_formula_special_cases():
    """The Playbook's s b h (34 + 5 a s / h) and its TP / SP / recomputation variants (GPT, dropout on)."""
    cfg = ModelConfig(family="gpt2", vocab_size=51200, hidden_size=4096, num_layers=32, num_heads=32,
                      ffn_hidden_size=4 * 4096, max_seq_len=4096, dropout=0.1)
    b, s, h, a = 1, 4096, 4096, 32
    sbh = s * b * h
    f = memory.playbook_layer_activations
    assert f(cfg, 1, False, b, s, "none", flash=False) == sbh * 34 + 5 * a * s * s * b
    assert f(cfg, 8, False, b, s, "none", flash=False) == sbh * (10 + 24 // 8) + 5 * a * s * s * b // 8
    assert f(cfg, 8, True, b, s, "none", flash=False) == (sbh * 34 + 5 * a * s * s * b) // 8
    assert f(cfg, 8, True, b, s, "selective", flash=False) == sbh * 34 // 8
    assert f(cfg, 8, True, b, s, "full") == 2 * sbh // 8


# --------------------------------------------------------------------------- step time


def test_step_time_model_bubble_flops_and_mfu():
    cfg = get_config("llama-8b")
    cl = hardware.make_cluster("h100-80gb", 64)
    for v, expected in ((1, 3 / (32 + 3)), (2, 3 / (64 + 3))):
        t = step_time.predict_step_time(cfg, Layout(tp=8, pp=4, dp=2, micro_batch_size=1, virtual_stages=v),
                                        cl, 4096, 64, "mixed-bf16")
        assert t.num_micro_batches == 32 and t.bubble_fraction == pytest.approx(expected)
    one = hardware.make_cluster("h100-80gb", 1)
    small = get_config("llama-1b")
    t = step_time.predict_step_time(small, Layout(), one, 2048, 4, "mixed-bf16")
    from tensorpar.models.flops import train_flops_per_token

    assert t.model_flops == pytest.approx(train_flops_per_token(small, 2048) * 4 * 2048)
    assert t.tp_comm_s == t.dp_comm_s == t.bubble_s == 0
    assert t.mfu == pytest.approx(one.mfu_ceiling * t.compute_s / t.step_time_s)
    # recomputation costs time, TP over nodes costs more than within
    full = step_time.predict_step_time(small, Layout(recompute="full"), one, 2048, 4, "mixed-bf16")
    assert full.recompute_s > 0 and full.step_time_s > t.step_time_s
    intra = step_time.predict_step_time(cfg, Layout(tp=8, dp=2), hardware.make_cluster("h100", 16), 4096, 32)
    inter = step_time.predict_step_time(cfg, Layout(tp=8, dp=2), hardware.make_cluster("h100", 16, gpus_per_node=4),
                                        4096, 32)
    assert inter.tp_comm_s > 5 * intra.tp_comm_s


# --------------------------------------------------------------------------- search


def test_search_ranks_feasible_first_and_explains_the_rest():
    cl = hardware.make_cluster("a100-40gb", 8, memory_gib=16)
    plans = search_mod.search(get_config("gpt2-774m"), cl, 1024, 64)  # 20 heads, 36 layers
    feasible = [p for p in plans if p.feasible]
    assert feasible and not plans[0].reason
    rates = [p.time.tokens_per_s for p in feasible]
    assert rates == sorted(rates, reverse=True)
    assert plans.index(feasible[-1]) == len(feasible) - 1  # feasible ones first
    reasons = {p.reason for p in plans if not p.feasible}
    assert "num_heads = 20 is not divisible by the tensor-parallel size 8" in reasons
    assert any(r.startswith("exceeds memory by") for r in reasons)
    assert "num_layers = 36 is not divisible by pp = 8" in reasons
    d = feasible[0].to_dict()
    for key in ("tp", "pp", "dp", "zero", "sequence_parallel", "micro_batch_size", "recompute", "feasible", "reason",
                "memory", "step_time_s", "tokens_per_s", "mfu"):
        assert key in d
    assert d["memory"]["total"] == pytest.approx(sum(v for k, v in d["memory"].items() if k != "total"))


# --------------------------------------------------------------------------- published runs


def _gpt(hidden, layers, heads):
    # Narayanan et al. 2021, Table 1 shapes: GPT, vocabulary 51200, sequence 2048, tied embeddings, dropout 0.1
    return ModelConfig(family="gpt2", vocab_size=51200, hidden_size=hidden, num_layers=layers, num_heads=heads,
                       ffn_hidden_size=4 * hidden, max_seq_len=2048, dropout=0.1)


# (name, config, GPUs, global batch, published teraFLOP/s per GPU, their layout)
PUBLISHED = [
    ("gpt3-175b", _gpt(12288, 96, 96), 1024, 1536, 138e12, Layout(8, 16, 8, False, 1, "full", 0, 2)),
    ("megatron-1t", _gpt(25600, 128, 160), 3072, 3072, 163e12, Layout(8, 64, 6, False, 1, "full", 0, 2)),
]
# What Megatron-LM could do in 2021: no sequence parallelism, no selective recomputation, no distributed optimizer.
ERA_SPACE = dict(sequence_parallel=(False,), zero=(0,), recompute=("none", "full"), virtual_stages=(1, 2),
                 max_micro_batch=8)
FULL_SPACE = dict(virtual_stages=(1, 2), max_micro_batch=8)


def published_prediction(cfg, gpus, batch, layout):
    # A100-80GB DGX nodes; their data-parallel all-reduce ran after the pipeline flush: no overlap.
    cl = hardware.make_cluster("a100-80gb", gpus, overlap=0.0)
    plan = search_mod.evaluate(cfg, layout, cl, 2048, batch, "mixed-bf16", flash_attention=False)
    # Their teraFLOP/s use eq. 3 of the paper (full recomputation counted); so does our step time here.
    return plan, compute.megatron_flops_per_step(cfg, batch, 2048) / (gpus * plan.time.step_time_s), cl


@pytest.mark.parametrize("name,cfg,gpus,batch,published,layout", PUBLISHED, ids=[p[0] for p in PUBLISHED])
def test_published_throughput_within_20_percent(name, cfg, gpus, batch, published, layout):
    for v in (1, 2):  # interleaved (what they used) and plain 1F1B (sensitivity)
        plan, predicted, _ = published_prediction(cfg, gpus, batch, dataclasses.replace(layout, virtual_stages=v))
        assert plan.feasible, plan.reason
        assert abs(predicted / published - 1) < 0.20, f"{name} v={v}: {predicted / 1e12:.0f} vs {published / 1e12:.0f}"


def mesh_rank(plans, layout) -> tuple[int, int]:
    """(0-based rank, count) of the layout's (tp, pp) among mesh shapes, each at its best configuration."""
    meshes = sorted(search_mod.best_by_mesh(plans).values(), key=lambda p: -p.time.tokens_per_s)
    return [(p.layout.tp, p.layout.pp) for p in meshes].index((layout.tp, layout.pp)), len(meshes)


@pytest.mark.parametrize("name,cfg,gpus,batch,published,layout", PUBLISHED, ids=[p[0] for p in PUBLISHED])
def test_published_layout_ranks_among_the_top_choices(name, cfg, gpus, batch, published, layout):
    """"Top choices": (1) among what Megatron-LM could run in 2021 (no SP, no selective recomputation, no
    distributed optimizer) their exact configuration is in the planner's top 5; (2) their mesh shape (tp, pp)
    - the Playbook heatmap's cell, each shape at its best micro-batch / recomputation / ZeRO / SP - is among
    the 5 best shapes, both in the 2021 space and with every feature the planner knows."""
    _, _, cl = published_prediction(cfg, gpus, batch, layout)
    era = search_mod.search(cfg, cl, 2048, batch, "mixed-bf16", flash_attention=False, **ERA_SPACE)
    rank, _ = search_mod.find(era, **dataclasses.asdict(layout))
    assert rank < 5, f"{name}: their layout ranks {rank + 1} among {sum(p.feasible for p in era)} feasible"
    full = search_mod.search(cfg, cl, 2048, batch, "mixed-bf16", flash_attention=False, **FULL_SPACE)
    for space, plans in (("2021", era), ("full", full)):
        shape, count = mesh_rank(plans, layout)
        assert shape < 5, f"{name} ({space}): (tp, pp) = ({layout.tp}, {layout.pp}) ranks {shape + 1} of {count}"


# --------------------------------------------------------------------------- command line


def _main(*args):
    from tensorpar.cli import main

    return main(["plan", *args])


def test_plan_command_text_json_and_pngs(capsys, tmp_path):
    base = ["--model", "llama-8b", "--gpus", "16", "--gpu", "h100-80gb", "--seq-len", "4096",
            "--global-batch-size", "256"]
    assert _main(*base, "--top", "3", "--png", str(tmp_path / "plan.png")) == 0
    out = capsys.readouterr().out
    assert "searched" in out and "feasible" in out and "tokens/s" in out and "exceed the GPU memory" in out
    assert (tmp_path / "plan.png").stat().st_size > 0 and (tmp_path / "plan-heatmap.png").stat().st_size > 0
    assert _main(*base, "--json", "--top", "2", "--inter-bandwidth", "25", "--mfu-ceiling", "0.5") == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["feasible"] for r in rows] == [True, True, False, False]
    assert rows[0]["tokens_per_s"] >= rows[1]["tokens_per_s"] and rows[2]["reason"].startswith("exceeds memory")
    assert set(rows[0]["memory"]) >= {"parameters", "gradients", "optimizer", "activations", "total"}


def test_plan_command_errors_and_schedule_mode(capsys, monkeypatch):
    assert _main("--model", "tiny") == 2
    assert "plan needs --gpus, --gpu, --seq-len, --global-batch-size" in capsys.readouterr().err
    assert _main("--model", "tiny", "--gpus", "2", "--gpu", "tpu", "--seq-len", "8", "--global-batch-size", "2") == 2
    assert "unknown GPU 'tpu'; known GPUs:" in capsys.readouterr().err
    seen = {}
    monkeypatch.setattr(plan_command, "run_schedule_command", lambda args: seen.update(vars(args)) or 0)
    assert _main("--schedule", "interleaved", "--pp", "4", "--microbatches", "8", "--virtual-stages", "2") == 0
    assert _main("--schedule", "1f1b", "--pp", "4") == 2
    assert "--schedule 1f1b needs --microbatches" in capsys.readouterr().err
    assert (seen["schedule"], seen["pp"], seen["microbatches"], seen["virtual_stages"]) == ("interleaved", 4, 8, 2)


def test_python_m_tensorpar_plan():
    proc = subprocess.run([sys.executable, "-m", "tensorpar", "plan", "--model", "tiny", "--gpus", "8", "--gpu", "a100",
                           "--seq-len", "256", "--global-batch-size", "32", "--top", "2"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("\n") > 5 and "a100-80gb" in proc.stdout


# --------------------------------------------------------------------------- the tables of docs/planner.md


def _cells(counted, predicted) -> str:
    return ", ".join(f"{op} {g}: {counted.get((op, g), 0):,}" for op, g in sorted(set(counted) | set(predicted)))


def _report() -> None:  # pragma: no cover - `python tests/test_planner.py` prints the validation tables
    from harness import Pools

    pools = Pools()
    gib = hardware.GiB
    try:
        print("## Communication: predicted vs counted bytes per (op, group), one micro-batch (B=2, S=16)\n")
        print("| tp | model | SP | recompute | dtype | (op, group): counted = predicted | equal |")
        print("|---|---|---|---|---|---|---|")
        for tp, config, sp, rc, bf16 in COMM_CASES:
            counted, predicted, _, _ = pools(WORLD).run(check_model_comm_and_params, tp, config, sp, rc, bf16)[0]
            cells = _cells(counted, predicted)
            print(f"| {tp} | {config} | {'on' if sp else 'off'} | {rc} | {'bf16' if bf16 else 'fp32'} | {cells} | "
                  f"{'yes' if counted == predicted else 'NO'} |")
        print("\n| training step, tp=2 x dp=2, tiny-gpt2 + SP, 2 micro-batches | counted = predicted | equal |")
        print("|---|---|---|")
        for zero in (0, 1, 2):
            counted, predicted = pools(WORLD).run(check_training_step_comm, zero, 2)[0]
            cells = _cells(counted, predicted)
            print(f"| ZeRO-{zero} | {cells} | {'yes' if counted == predicted else 'NO'} |")

        print("\n| pipelined step, tiny-gpt2 (4 layers), 4 micro-batches | rank | counted = predicted | equal |")
        print("|---|---|---|---|")
        for tp, pp, dp, schedule, v, zero, sp in PIPELINE_CASES:
            for rank, (counted, predicted, *_rest) in enumerate(pools(WORLD).run(
                    check_pipeline_step_comm, tp, pp, dp, schedule, v, zero, sp)):
                if rank % (tp * dp) == 0:
                    label = f"tp={tp} pp={pp} dp={dp} {schedule}{f' v={v}' if v > 1 else ''} ZeRO-{zero}"
                    label += " SP" if sp else ""
                    print(f"| {label} | {rank} | {_cells(counted, predicted)} | "
                          f"{'yes' if counted == predicted else 'NO'} |")
        print("\n## Parameters, gradients, AdamW states per rank (bytes): predicted vs real tensors\n")
        print("| model | tp | parameters (pred / real) | gradients (pred / real) | AdamW states (pred / real) |")
        print("|---|---|---|---|---|")
        prec = precision.PRECISIONS["tensorpar-fp32"]
        for config in ("tiny", "gpt2-124m-2l"):
            for tp in (1, 2, 4):
                mb = memory.stage_memory(CONFIGS[config], Layout(tp=tp), 8, 1, prec)
                real = check_parameter_memory(tp, config) if tp == 1 else pools(WORLD).run(check_parameter_memory, tp,
                                                                                          config)[0]
                print(f"| {config} | {tp} | {mb.parameters:,} / {real[0]:,} | {mb.gradients:,} / {real[1]:,} | "
                      f"{mb.optimizer:,} / {real[2]:,} |")

        print("\n## Activations of one micro-batch (B=2, S=32), bytes: predicted vs measured\n")
        print("| tp | model | SP | recompute | dtype | predicted | measured | method | error "
              "| Playbook formula (bf16) |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        for tp, config, sp, rc, bf16 in ACTIVATION_CASES:
            cfg = CONFIGS[config]
            mb = memory.stage_memory(cfg, Layout(tp=tp, sequence_parallel=sp, micro_batch_size=2, recompute=rc), 32, 2,
                                     "tensorpar-bf16" if bf16 else "tensorpar-fp32")
            pred = mb.activations + mb.weight_copies
            method = "hooks" if rc == "none" else "live"
            args = (tp, config, sp, rc, bf16, method)
            got = check_activations(*args) if tp == 1 else pools(WORLD).run(check_activations, *args)[0]
            pb = memory.stage_memory(cfg, Layout(tp=tp, sequence_parallel=sp, micro_batch_size=2, recompute=rc), 32, 2,
                                     "mixed-bf16").activations
            print(f"| {tp} | {config} | {'on' if sp else 'off'} | {rc} | {'bf16' if bf16 else 'fp32'} | {pred:,} | "
                  f"{got:,} | {method} | {100 * (pred - got) / got:+.3f}% | {pb:,} |")
    finally:
        pools.close()

    print("\n## Published runs (Narayanan et al. 2021) vs predicted\n")
    print("| run | layout | schedule | published TFLOP/s/GPU | predicted | error | predicted step s | memory GiB |")
    print("|---|---|---|---|---|---|---|---|")
    for name, cfg, gpus, batch, published, layout in PUBLISHED:
        for v in (2, 1):
            lay = dataclasses.replace(layout, virtual_stages=v)
            plan, pred, _ = published_prediction(cfg, gpus, batch, lay)
            print(f"| {name} | TP{lay.tp} PP{lay.pp} DP{lay.dp} mbs 1 full recompute | "
                  f"{'interleaved v=2' if v == 2 else '1F1B'} | {published / 1e12:.0f} | {pred / 1e12:.1f} | "
                  f"{100 * (pred / published - 1):+.1f}% | {plan.time.step_time_s:.1f} | "
                  f"{plan.memory.gib()['total']:.1f} |")
    print("\n| run | space | feasible layouts | rank of their layout (MFU) | rank of their (tp, pp) | "
          "planner's best (MFU, GiB) |")
    print("|---|---|---|---|---|---|")
    for name, cfg, gpus, batch, published, layout in PUBLISHED:
        theirs, _, cl = published_prediction(cfg, gpus, batch, layout)
        for label, space in (("2021 features", ERA_SPACE), ("all features", FULL_SPACE)):
            plans = search_mod.search(cfg, cl, 2048, batch, "mixed-bf16", flash_attention=False, **space)
            feasible = [p for p in plans if p.feasible]
            rank, _ = search_mod.find(plans, **dataclasses.asdict(layout))
            shape, count = mesh_rank(plans, layout)
            best = feasible[0]
            print(f"| {name} | {label} | {len(feasible)} | {rank + 1} (top {100 * (rank + 1) / len(feasible):.1f}%; "
                  f"{100 * theirs.time.mfu:.1f}%) | {shape + 1} of {count} | {best.layout.label()} "
                  f"({100 * best.time.mfu:.1f}%, {best.memory.gib()['total']:.1f}) |")


if __name__ == "__main__":
    _report()
