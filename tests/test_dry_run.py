"""`tensorpar train --dry-run`: one rank of a world of thousands, built for real on the meta device with a fake
process group; its parameter, gradient and optimizer bytes against the planner's at published layouts."""

import json

import pytest

from tensorpar.commands.dry_run_report import planned_bytes, planned_candidate
from tensorpar.models import get_config
from tensorpar.planning.params import layout_parameters
from tensorpar.training import TrainOptions, validate
from tensorpar.training.dry_run import dry_run

# Nemotron-4 340B's shape (96 layers, hidden 18432, 96 heads / 8 KV heads, a plain MLP of 73728, 256K vocabulary;
# gelu standing in for its squared ReLU: the same parameters). DeepSeek-V3 is the preset, as published (latent
# attention, 3 dense layers then 58 MoE layers of 256 experts, the MTP module on the last stage).
NEMOTRON_340B = get_config("llama-405b").replace(num_layers=96, hidden_size=18432, num_heads=96, num_kv_heads=8,
                                                 ffn_hidden_size=73728, gated_mlp=False, activation="gelu",
                                                 vocab_size=256000, max_seq_len=4096)


@pytest.fixture(scope="module")
def configs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("published")
    out = {}
    # Llama 3 8B's width in 4 layers: what its blocks hold, at an eighth of the meta-device operations.
    for name, cfg in (("nemotron-4-340b", NEMOTRON_340B),
                      ("llama-8b-4l", get_config("llama-8b").replace(num_layers=4))):
        path = folder / f"{name}.json"
        path.write_text(json.dumps(cfg.to_dict()))
        out[name] = str(path)
    return out


# Llama 3 405B as Meta trained it (TP 8, PP 16 with 7-layer first and last stages, 16,384 GPUs, 8K sequences);
# Nemotron-4 340B at TP 8 x PP 8 x v 12 on 6,144; DeepSeek-V3 as its report trained it, PP 16 x EP 64 (over DP 128)
# on 2,048, the last stage holding 2 layers and the MTP module;
# Mixtral 8x7B with EP 8 folded over DP at 512 ranks, ZeRO-1.
CASES = {
    "llama-405b-16384": dict(model="llama-405b", tp=8, pp=16, pipeline_layers="7" + ",8" * 14 + ",7", zero=1,
                             sequence_parallel=True, dtype="bf16", seq_len=8192, global_batch_size=2048,
                             micro_batch_size=1, recompute="full", world_size=16384),
    "nemotron-340b-6144": dict(model="nemotron-4-340b", tp=8, pp=8, virtual_stages=12, schedule="interleaved",
                               zero=1, sequence_parallel=True, dtype="bf16", seq_len=4096, global_batch_size=768,
                               micro_batch_size=1, recompute="selective", world_size=6144),
    "deepseek-v3-ep64-2048": dict(model="deepseek-v3", pp=16, ep=64, zero=1, dtype="bf16", seq_len=4096,
                                  global_batch_size=1024, micro_batch_size=1, recompute="full",
                                  pipeline_layers="3" + ",4" * 14 + ",2", world_size=2048),
    "mixtral-ep8-512": dict(model="mixtral-8x7b", tp=2, pp=4, ep=8, zero=1, sequence_parallel=True, dtype="bf16",
                            seq_len=4096, global_batch_size=256, micro_batch_size=1, recompute="full",
                            world_size=512),
}


@pytest.mark.parametrize("name,rank", [("llama-405b-16384", 0), ("llama-405b-16384", 16383),
                                       ("nemotron-340b-6144", 6143), ("deepseek-v3-ep64-2048", 1000),
                                       ("deepseek-v3-ep64-2048", 2047),
                                       ("mixtral-ep8-512", 300)])
def test_a_rank_of_a_large_world_holds_the_bytes_the_planner_predicts(configs, name, rank):
    kw = dict(CASES[name])
    kw["model"] = configs.get(kw["model"], kw["model"])
    world = kw.pop("world_size")  # the world validate() and dry_run() build (the option is --dry-run's alone)
    run = validate(TrainOptions(**{**kw, "progress": False}), world)
    result = dry_run(run, rank)
    planned = planned_bytes(run, result)
    assert result["layout"]["rank"] == rank and result["parameter_count"] > 0
    for key in ("parameter_bytes", "gradient_bytes"):  # the planner counts these to the byte
        assert result[key] == planned[key], (key, result[key], planned[key])
    # AdamW's step counters: one 4-byte tensor per parameter tensor in the planner, per master slice in the run
    assert abs(result["optimizer_bytes"] - planned["optimizer_bytes"]) <= 1e-5 * planned["optimizer_bytes"]
    if name.startswith("deepseek"):  # latent attention on every stage, the MTP module (layer 61) on the last
        stage = result["layout"]["pp_rank"]
        params = layout_parameters(run.cfg, planned_candidate(run), stage)
        assert sum(n for _, n, _ in params) == result["parameter_count"]
        assert any(".attn.kv_b_proj." in n for n, _, _ in params)
        assert any(n.startswith("layers.61.") for n, _, _ in params) == (stage == 15)
    ops = {(c["op"], c["group"]) for c in result["collectives"]}
    assert ("reduce_scatter", "dp") in ops, ops  # ZeRO-1's gradient buckets
    if run.cfg.is_moe:  # the step's traffic only (no micro-batch): the experts' buckets over expert-DP
        assert ("reduce_scatter", "edp") in ops and ("all_gather", "tp") not in ops, ops
    else:  # SP's gathers and reduce-scatters of the micro-batch
        assert {("all_gather", "tp"), ("reduce_scatter", "tp")} <= ops, ops


def test_a_dry_run_of_a_rank_outside_the_world_or_a_layout_that_cannot_run_is_refused(cli):
    code, _, err = cli("train", "--model", "llama-8b", "--tp", "8", "--dry-run", "--world-size", "64", "--rank",
                       "64", "--global-batch-size", "64")
    assert code != 0 and "--rank 64 is not a rank of a world of 64" in err, err
    code, _, err = cli("train", "--model", "llama-8b", "--tp", "8", "--dry-run", "--world-size", "60")
    assert code != 0 and "60" in err, err


@pytest.mark.parametrize("schedule,v", [("1f1b", 1), ("interleaved", 2), ("zb-h1", 1), ("zbv", 1)])
def test_every_schedule_puts_the_planned_bytes_on_its_first_and_last_rank(schedule, v):
    """Under zbv rank 0 holds both ends (the embedding and the head), under the others the last rank holds the head:
    the planner attributes each rank's parameters as the dry run builds them."""
    run = validate(TrainOptions(model="llama-8b", tp=8, pp=4, schedule=schedule, virtual_stages=v, zero=1,
                                dtype="bf16", seq_len=4096, global_batch_size=64, micro_batch_size=1,
                                progress=False), 64)
    built = {}
    for rank in (0, 63):  # pipeline ranks 0 and 3
        result = dry_run(run, rank)
        assert result["parameter_bytes"] == planned_bytes(run, result)["parameter_bytes"], (schedule, rank)
        built[rank] = result["parameter_bytes"]
    ends_on_rank_0 = built[0] > built[63]  # llama-8b's untied embedding and head: 2 x 128K x 4096 / 8 each
    assert ends_on_rank_0 == (schedule == "zbv"), built


@pytest.mark.parametrize("layout", [dict(dp=64), dict(dp=64, dp_replicate=8), dict(tp=8, dp=8)])
def test_fp8_zero3_ranks_hold_the_gradients_the_planner_plans(configs, layout):
    """fp8's ZeRO-3 rank holds one block's full gradient at a time, not bf16's two (it was over-planned by 0.87 GB)."""
    run = validate(TrainOptions(model=configs["llama-8b-4l"], zero=3, dtype="fp8", seq_len=4096, global_batch_size=256,
                                micro_batch_size=1, progress=False, **layout), 64)
    result = dry_run(run, 63)
    planned = planned_bytes(run, result)["gradient_bytes"]
    assert abs(result["gradient_bytes"] - planned) <= 1e-4 * planned, (result["gradient_bytes"], planned)


def test_a_zero3_first_stage_meets_its_root_gradient_in_the_second_micro_batch():
    """The embedding's gradient (ZeRO-3's root unit, reduced once a step) arrives last in a backward and stays: the
    second micro-batch's backward meets it, where one micro-batch's never did (0.87 GB short, 1.12x)."""
    run = validate(TrainOptions(model="llama-8b", pp=2, dp=4, zero=3, dtype="bf16", seq_len=4096, global_batch_size=64,
                                micro_batch_size=1, progress=False), 8)
    result = dry_run(run, 0)
    assert result["gradient_bytes"] == planned_bytes(run, result)["gradient_bytes"]


def test_a_split_backward_runs_its_weight_gradients_in_the_dry_run():
    """zb-h1 defers the weight gradients (W): the dry run runs them, so its ZeRO-2 rank reduce-scatters its buckets
    and holds at least what 1F1B's holds (it held 40% less, and reduce-scattered nothing)."""
    results = {}
    for schedule in ("1f1b", "zb-h1"):
        run = validate(TrainOptions(model="llama-8b", pp=2, dp=4, zero=2, schedule=schedule, dtype="bf16",
                                    seq_len=4096, global_batch_size=64, micro_batch_size=1, progress=False), 8)
        results[schedule] = dry_run(run, 0)
    for result in results.values():
        assert any(c["op"] == "reduce_scatter" for c in result["collectives"]), result["collectives"]
    assert results["zb-h1"]["gradient_bytes"] >= results["1f1b"]["gradient_bytes"]


@pytest.mark.parametrize("model,layout", [("gemma3-12b", dict(tp=8, pp=4, sequence_parallel=True)),
                                          ("qwen3-30b-a3b", dict(tp=2, pp=2, ep=8)),
                                          ("olmo2-7b", dict(tp=8, pp=2)), ("qwen2.5-7b", dict(tp=4, pp=2)),
                                          ("mistral-7b", dict(tp=16))])
def test_the_families_published_shapes_hold_the_planned_bytes(model, layout):
    """Sandwich norms, qk-norm per head (Gemma 3, Qwen3) or over the projection split by heads (OLMo 2), q/k/v
    biases (Qwen2.5), KV heads replicated (Mistral's 8 at TP 16): the last rank of 64 holds the planner's bytes."""
    run = validate(TrainOptions(model=model, zero=1, dtype="bf16", seq_len=4096, global_batch_size=64,
                                micro_batch_size=1, progress=False, **layout), 64)
    result = dry_run(run, 63)
    planned = planned_bytes(run, result)
    for key in ("parameter_bytes", "gradient_bytes"):
        assert result[key] == planned[key], (key, result[key], planned[key])


@pytest.mark.parametrize("layout", [dict(tp=2, dp=2, ep=2, expert_tp=2), dict(dp=4, ep=2, expert_tp=2, zero=1),
                                    dict(dp=4, ep=1, expert_tp=4, zero=1), dict(dp=4, ep=4, zero=1)])
def test_expert_tp_and_a_one_rank_expert_dp_hold_the_planned_bytes(layout):
    """Expert-TP splits each routed expert's width (the planner held them whole: 1.6x the parameters), and a ZeRO
    run's optimizer keeps its master slice of the experts also where their expert-DP group is one rank (the planner
    left the experts unsharded and masterless there: 0.75x the optimizer states in fp32)."""
    run = validate(TrainOptions(model="tiny-moe", seq_len=32, global_batch_size=4, micro_batch_size=1,
                                progress=False, **layout), 4)
    result = dry_run(run, 3)
    planned = planned_bytes(run, result)
    for key in ("parameter_bytes", "gradient_bytes"):
        assert result[key] == planned[key], (key, result[key], planned[key])
    assert abs(result["optimizer_bytes"] - planned["optimizer_bytes"]) <= 1e-3 * planned["optimizer_bytes"]


@pytest.mark.parametrize("layout,tol", [(dict(dp=4), 0), (dict(dp=4, ep=2), 0), (dict(dp=4, ep=4), 0),
                                        (dict(tp=2, dp=2, ep=4), 0.05), (dict(pp=2, dp=2, ep=2), 0.05)])
def test_zero3_moe_gradients_in_flight_are_near_the_built_ranks(layout, tol):
    """Under ZeRO-3 a block's routed experts are a unit of their own: one layer's full-size expert gradient is alive
    at the peak beside two blocks' dense ones, and experts whose expert-DP is one rank keep no fp32 slice (the
    planner counted two whole blocks with every expert, and a slice: 1.4x to 2.5x the built rank's bytes, which a
    real run's meter equals)."""
    run = validate(TrainOptions(model="tiny-moe", zero=3, seq_len=32, global_batch_size=4, micro_batch_size=1,
                                progress=False, **layout), 4)
    result = dry_run(run, 3)
    planned = planned_bytes(run, result)
    assert abs(planned["gradient_bytes"] - result["gradient_bytes"]) <= tol * result["gradient_bytes"], \
        (planned["gradient_bytes"], result["gradient_bytes"])


def test_a_zero3_rank_counts_the_parameters_its_model_holds_and_says_zero3_shards_them():
    """ZeRO-3 frees every block's gathered parameters after the step: the count is taken before (it said 0)."""
    from tensorpar.commands.dry_run_report import report

    run = validate(TrainOptions(model="tiny", dp=4, zero=3, dp_replicate=2, global_batch_size=8, seq_len=32,
                                progress=False), 4)
    result = dry_run(run, 3)
    assert result["parameter_count"] == get_config("tiny").num_parameters()
    line = report(run, result, planned_bytes(run, result)).splitlines()[0]
    assert f"{result['parameter_count']:,} parameters on this rank (ZeRO-3 stores 1/2 of them)" in line


@pytest.mark.parametrize("dtype,zero", [("bf16", 0), ("fp16", 0), ("bf16", 1), ("fp32", 0)])
def test_the_fp32_masters_of_low_precision_parameters_are_counted_at_every_zero_stage(dtype, zero):
    """Without ZeRO a bf16 run's AdamW steps whole fp32 masters: the meter (and this built column) left them out, so
    the planner's optimizer bytes read 1.5x the built ones."""
    dp = 1 if zero == 0 else 2
    run = validate(TrainOptions(model="tiny", tp=2, dp=dp, zero=zero, dtype=dtype, seq_len=64, global_batch_size=8,
                                progress=False), 2 * dp)
    result = dry_run(run, 0)
    planned = planned_bytes(run, result)
    assert abs(result["optimizer_bytes"] - planned["optimizer_bytes"]) <= 1e-3 * planned["optimizer_bytes"], (
        result["optimizer_bytes"], planned["optimizer_bytes"])
