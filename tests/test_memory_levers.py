"""The memory levers train like the run without them and the planner predicts their memory: at TP 2, DP 2 ZeRO-1 and
DP 2 ZeRO-3, --optimizer-offload with --activation-offload gives bit for bit the run without them on CPU (the same
arithmetic through the host-copy path), and so does --activation-offload-layers 3, which keeps the later layers'
saved tensors on the device (there and at PP 2, under torch.compile too); --optimizer-state-dtype bf16 follows the fp32-state run closely (its
200-step comparison: bench/precision.py, docs/benchmarks.md); the bytes each run measures where they are (device:
optimizer, activations; host: host_optimizer, host_activations) are within 10% of the planner's. Levers that cannot
apply are refused in one line; bf16 moments take torch's AdamW arithmetic, rounded to nearest."""

import pytest
import torch

from tensorpar.config.memory_levers import MemoryLevers
from tensorpar.optim.adamw import AdamW
from tensorpar.planning.candidates import Candidate
from tensorpar.planning.memory import stage_memory
from tensorpar.training import TrainOptions
from tensorpar.training.activation_offload import HostActivations

from conftest import TINY8
from harness import train

RUN = dict(steps=3, seed=5, global_batch_size=8, micro_batch_size=2, seq_len=16, lr=3e-3, warmup_steps=1,
           val_every=0, val_fraction=0.0, progress=False, metrics=None, out_dir=None, device="cpu", return_state=True)
LAYOUTS = {"tp2": dict(tp=2), "dp2-zero1": dict(dp=2, zero=1), "dp2-zero3": dict(dp=2, zero=3)}
LEVERS = {"none": {}, "offload": dict(optimizer_offload=True, activation_offload=True),
          "bf16-states": dict(optimizer_state_dtype="bf16"),
          "first-3-layers": dict(activation_offload=True, activation_offload_layers=3)}
MiB = 2**20


def _runs(config_file, layout: dict) -> dict:
    """Each lever's run at `layout`: its (loss, grad norm) trajectory, final weights and measured peak memory."""
    out = {}
    for name, levers in LEVERS.items():
        s = train(TrainOptions(model=config_file, **RUN, **layout, **levers))
        out[name] = {"trajectory": [(r["loss"], r["grad_norm"]) for r in s["history"]], "state": s["state"],
                     "memory": s["memory_mib_per_rank"]}
    return out


_found: dict = {}


@pytest.fixture
def runs(pools, config_file):
    """runs(layout): the lever runs at that layout, made once per session (rank 0's)."""
    def get(name: str) -> dict:
        if name not in _found:
            _found[name] = pools(2).run(_runs, config_file, LAYOUTS[name])[0]
        return _found[name]
    return get


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_offloading_trains_bit_for_bit_like_the_run_without_it(runs, layout):
    plain, offload = runs(layout)["none"], runs(layout)["offload"]
    assert offload["trajectory"] == plain["trajectory"]
    assert all(torch.equal(offload["state"][k], v) for k, v in plain["state"].items())
    for rank, mem in enumerate(offload["memory"]):  # no optimizer left on the device, the layers' tensors moved
        assert mem["optimizer"] == 0 and mem["host_optimizer"] > 0, (rank, mem)
        assert 0 < mem["activations"] < 0.25 * mem["host_activations"], (rank, mem)  # the embedding's, head's, loss's


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_offloading_the_first_layers_trains_bit_for_bit_and_keeps_the_rest_on_the_device(runs, layout):
    plain, first = runs(layout)["none"], runs(layout)["first-3-layers"]
    assert first["trajectory"] == plain["trajectory"]
    assert all(torch.equal(first["state"][k], v) for k, v in plain["state"].items())
    for rank, (mem, ref) in enumerate(zip(first["memory"], plain["memory"])):
        # 3 of the 8 layers moved: of what the plain run saves, some 3/8 (less the embedding's and the head's share)
        assert 0.3 * ref["activations"] < mem["host_activations"] < 0.375 * ref["activations"], (rank, mem, ref)
        assert mem["activations"] + mem["host_activations"] >= ref["activations"], (rank, mem, ref)


def _pipeline_runs(config_file) -> dict:
    layout = dict(pp=2, schedule="1f1b")
    return {name: train(TrainOptions(model=config_file, **RUN, **layout, **levers))
            for name, levers in (("none", {}), ("first-2-layers", dict(activation_offload=True,
                                                                       activation_offload_layers=2)))}


def test_offloading_the_first_layers_of_each_pipeline_stage_trains_bit_for_bit(pools, config_file):
    """PP 2, 1F1B over 4 micro-batches: each stage moves the first 2 of its 4 layers, whose saved tensors wait on the
    host while later micro-batches' forwards run."""
    for rank, runs in enumerate(pools(2).run(_pipeline_runs, config_file)):
        plain, first = runs["none"], runs["first-2-layers"]
        assert [r["loss"] for r in first["history"]] == [r["loss"] for r in plain["history"]]
        assert all(torch.equal(first["state"][k], v) for k, v in plain["state"].items())
        mem, ref = first["memory_mib_per_rank"][rank], plain["memory_mib_per_rank"][rank]
        assert 0 < mem["host_activations"] < ref["activations"] and 0 < mem["activations"] < ref["activations"], (
            rank, mem, ref)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_bf16_moments_follow_the_fp32_moments(runs, layout):
    plain, bf16 = runs(layout)["none"], runs(layout)["bf16-states"]
    for step, ((loss, _), (ref, _)) in enumerate(zip(bf16["trajectory"], plain["trajectory"]), 1):
        assert abs(loss - ref) <= 1e-3 * ref, f"step {step}: {loss} vs {ref}"
    assert bf16["trajectory"] != plain["trajectory"]  # the moments are rounded: not the fp32 run


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_the_planner_predicts_each_lever_within_10_percent(runs, layout):
    candidate = Candidate.of(**LAYOUTS[layout], micro_batch_size=2)
    for name, options in LEVERS.items():
        mb = stage_memory(TINY8, candidate, 16, 8, "tensorpar-fp32", levers=MemoryLevers(**options))
        planned = {"optimizer": mb.optimizer, "host_optimizer": mb.host_optimizer,
                   "activations": mb.activations + mb.weight_copies, "host_activations": mb.host_activations}
        for rank, mem in enumerate(runs(layout)[name]["memory"]):
            for kind, plan in planned.items():
                got = mem.get(kind, 0.0) * MiB
                assert abs(plan - got) <= 0.10 * max(got, plan), f"{name} rank {rank} {kind}: planned {plan}, got {got}"


@pytest.mark.parametrize("flags,message", [
    (["--optimizer", "muon", "--optimizer-offload"], "--optimizer-offload steps AdamW on the host"),
    (["--optimizer", "muon", "--optimizer-state-dtype", "bf16"], "--optimizer-state-dtype bf16 stores AdamW's"),
    (["--activation-offload", "--recompute", "full"], "--activation-offload with --recompute full"),
    (["--activation-offload-layers", "2"], "--activation-offload-layers 2 needs --activation-offload"),
    (["--activation-offload", "--activation-offload-layers", "9"], "--activation-offload-layers 9: the model has 4"),
    (["--activation-offload", "--activation-offload-layers", "0"], "--activation-offload-layers must be at least 1"),
], ids=["offload-muon", "bf16-muon", "activations-full-recompute", "layers-without-offload", "layers-beyond-model",
        "no-layers"])
def test_levers_that_cannot_apply_are_refused_in_one_line(cli, flags, message):
    code, _, err = cli("train", "--steps", 1, *flags)
    assert code != 0 and len(err.strip().splitlines()) == 1 and message in err, err


def test_bf16_moments_take_torchs_adamw_arithmetic_rounded_to_nearest():
    g = torch.Generator().manual_seed(0)
    params = [torch.randn(37, generator=g), torch.randn(5, 3, generator=g)]
    grads = [[torch.randn(p.shape, generator=g) for p in params] for _ in range(3)]

    def trained(state_dtype, fp32_moments=False, round_after_step=False):
        """AdamW with `state_dtype` after the three steps; `fp32_moments`: its moments kept in fp32 all the same,
        `round_after_step`: and rounded to bf16 after each step."""
        ps = [torch.nn.Parameter(p.clone()) for p in params]
        opt = AdamW([{"params": ps, "weight_decay": 0.1}], lr=1e-2, state_dtype=state_dtype)
        if fp32_moments:
            opt.moment_dtype = lambda p: torch.float32
        for step_grads in grads:
            for p, grad in zip(ps, step_grads):
                p.grad = grad
            opt.step()
            if round_after_step:
                for st in opt.state.values():
                    for key in ("exp_avg", "exp_avg_sq"):
                        st[key].copy_(st[key].bfloat16())
        return opt, ps

    opts = {dtype: trained(dtype) for dtype in (torch.float32, torch.bfloat16)}
    states = [opts[torch.bfloat16][0].state[p] for p in opts[torch.bfloat16][1]]
    assert all(st["exp_avg"].dtype == st["exp_avg_sq"].dtype == torch.bfloat16 for st in states)
    for a, b in zip(opts[torch.bfloat16][1], opts[torch.float32][1]):
        assert a.dtype == torch.float32 and (a - b).abs().max() <= 1e-2 * 3 * 1e-2  # lr x steps x 1%
    # the same arithmetic: the same step with fp32 moments kept fp32 is torch's, bit for bit
    _, mine = trained(torch.bfloat16, fp32_moments=True)
    assert all(torch.equal(a, b) for a, b in zip(mine, opts[torch.float32][1]))
    # ... and rounded to nearest only after the step: that arithmetic with its fp32 moments rounded to bf16 after
    # each step (the update takes them unrounded) is the bf16-moment run, bit for bit
    rounded, rounded_params = trained(torch.bfloat16, fp32_moments=True, round_after_step=True)
    bf16_params = opts[torch.bfloat16][1]
    assert all(torch.equal(a, b) for a, b in zip(rounded_params, bf16_params))
    assert all(torch.equal(rounded.state[a][key], opts[torch.bfloat16][0].state[b][key].float())
               for a, b in zip(rounded_params, bf16_params) for key in ("exp_avg", "exp_avg_sq"))


def test_activation_offload_copies_each_storage_once_and_again_after_an_in_place_change():
    offload = HostActivations("cpu")
    base = torch.arange(12.0)
    first, second = offload.pack(base[:6]), offload.pack(base.view(3, 4)[1:])
    assert offload.bytes.now == base.untyped_storage().nbytes()
    base.add_(1)  # a version later: copied again
    third = offload.pack(base[2:4])
    assert offload.bytes.now == 2 * base.untyped_storage().nbytes()
    assert torch.equal(offload.unpack(first), torch.arange(6.0))
    assert torch.equal(offload.unpack(second), torch.arange(12.0).view(3, 4)[1:])
    assert torch.equal(offload.unpack(third), torch.arange(2.0, 4.0) + 1)
    del first, second, third
    assert offload.bytes.now == 0


def test_the_dry_run_counts_the_offloaded_optimizer_as_the_planner_does():
    from tensorpar.commands.dry_run_report import planned_bytes
    from tensorpar.training import validate
    from tensorpar.training.dry_run import dry_run

    run = validate(TrainOptions(model="tiny", tp=2, dp=4, zero=1, dtype="bf16", seq_len=64, global_batch_size=8,
                                micro_batch_size=1, dry_run=True, optimizer_offload=True,
                                optimizer_state_dtype="bf16", activation_offload=True), world_size=8)
    result = dry_run(run, rank=5)
    planned = planned_bytes(run, result)
    assert result["optimizer_bytes"] == planned["optimizer_bytes"] == 0
    assert abs(result["host_optimizer_bytes"] - planned["host_optimizer_bytes"]) <= 1e-3 * planned["host_optimizer_bytes"]
    assert planned["host_activation_bytes"] > 0


def test_plan_json_reports_the_host_memory_of_the_levers(cli):
    import json

    args = ["plan", "--model", "llama-8b", "--gpus", 8, "--gpu", "h100-80gb", "--seq-len", 4096,
            "--global-batch-size", 64, "--tp", 1, "--pp", 1, "--zero", 1, "--recompute", "none", "--json"]
    plain = json.loads(cli(*args)[1])
    levers = json.loads(cli(*args, "--optimizer-offload", "--activation-offload", "--optimizer-state-dtype", "bf16")[1])
    by_mbs = {row["micro_batch_size"]: row for row in plain}
    for row in levers:
        if row["memory"] is None:
            continue
        ref = by_mbs[row["micro_batch_size"]]
        kept = row["memory"]["activations"] + row["memory"]["weight_copies"]
        assert row["memory"]["optimizer"] == 0 and 0 < kept < 0.1 * row["host_memory"]["activations"]
        assert row["host_memory"]["optimizer"] > 0 and row["host_memory"]["activations"] + kept == pytest.approx(
            ref["memory"]["activations"] + ref["memory"]["weight_copies"])
        assert ref["host_memory"]["total"] == 0 and row["memory"]["total"] < ref["memory"]["total"]


def test_under_compile_only_the_first_layers_saved_tensors_move():
    """The blocks' hooks run eagerly around each compiled block, so autograd, which saves a compiled block's tensors as
    it leaves it, moves the first blocks' and no others (aot_eager: when tensors are saved is AOTAutograd's doing,
    not the backend's)."""
    from tensorpar.models import Transformer
    from tensorpar.models.compile import compile_block
    from tensorpar.training.memory_meter import ActivationMeter

    ids = torch.randint(0, TINY8.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))

    def step(first_layers):
        """(gradients, device bytes, host bytes) of a forward and backward of the compiled model."""
        model = Transformer(TINY8, None, seed=0)
        for block in model.layers.values():  # as compile_blocks does, without its probe of inductor
            compile_block(block, backend="aot_eager")
        offload = None if first_layers == 0 else HostActivations.of_model("cpu", model, first_layers)
        meter = ActivationMeter(offload, compiled=True)
        with meter.measuring(model):
            model(ids, ids).backward()
        return [p.grad for p in model.parameters()], meter.bytes.peak, offload.bytes.peak if offload else 0

    plain, first3, blocks = step(0), step(3), step(TINY8.num_layers)
    for grads, _, _ in (first3, blocks):
        assert all(torch.equal(a, b) for a, b in zip(grads, plain[0]))
    assert first3[2] == pytest.approx(blocks[2] * 3 / TINY8.num_layers, rel=0.01)  # 3 of the 8 identical blocks
    assert first3[1] + first3[2] == pytest.approx(plain[1], rel=0.01) and blocks[1] < 0.1 * plain[1]


def test_plan_moves_the_first_layers_share_of_the_saved_bytes(cli):
    import json

    args = ["plan", "--model", "llama-8b", "--gpus", 8, "--gpu", "h100-80gb", "--seq-len", 4096, "--global-batch-size",
            64, "--tp", 1, "--pp", 1, "--zero", 1, "--recompute", "none", "--max-micro-batch", 1, "--json"]
    everything = json.loads(cli(*args, "--activation-offload")[1])[0]
    first8 = json.loads(cli(*args, "--activation-offload", "--activation-offload-layers", 8)[1])[0]
    moved = first8["host_memory"]["activations"]
    # 8 of llama-8b's 32 layers: a quarter of the layers' bytes, which is all the plain lever moves
    assert moved == pytest.approx(0.25 * everything["host_memory"]["activations"], rel=1e-6)
    kept = first8["memory"]["activations"] + first8["memory"]["weight_copies"]
    ends = everything["memory"]["activations"] + everything["memory"]["weight_copies"]
    assert 0 < ends < 0.1 * everything["host_memory"]["activations"]  # the embedding's, head's, loss's stay
    assert kept + moved == pytest.approx(ends + everything["host_memory"]["activations"], rel=1e-6)


def test_gpu_ranks_stepping_an_offloaded_optimizer_on_one_thread_each_are_warned():
    from tensorpar.data_parallel.host_masters import host_step_threads_warning

    warning = host_step_threads_warning("cuda", 1, 112, 8)  # torchrun's OMP_NUM_THREADS=1 on a DGX node
    assert "OMP_NUM_THREADS=14" in warning and "112 cores for 8 ranks" in warning
    assert host_step_threads_warning("cuda", 14, 112, 8) is None  # threads given
    assert host_step_threads_warning("cuda", 1, 8, 8) is None  # no core to spare
    assert host_step_threads_warning("cpu", 1, 112, 8) is None  # CPU ranks share their cores with the compute
