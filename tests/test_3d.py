"""3D parallelism: any (tp, pp, dp) x schedule x ZeRO stage trains exactly like one process; bubbles,
in-flight activations, communication volumes and ZeRO memory are what the theory says."""

import json
import time
from types import SimpleNamespace

import pytest
import torch

from harness import mesh
from conftest import TINY8 as CONFIG
from tensorpar.models import get_config
from tensorpar.training import TrainOptions, train
BASE = dict(steps=10, seed=5, global_batch_size=8, micro_batch_size=1, seq_len=16, lr=3e-3, warmup_steps=2,
            val_every=0, val_fraction=0.0, progress=False, metrics=None, out_dir=None, device="cpu",
            return_state=True)




def run(config_file, **overrides):
    summary = train(TrainOptions(model=config_file, **{**BASE, **overrides}))
    return {
        "trajectory": [(r["loss"], r["grad_norm"]) for r in summary["history"]],
        "state": summary.get("state"),
        "comm": summary["comm"],
        "optimizer_state_bytes": summary["optimizer_state_bytes"],
        "peak_in_flight": summary["pipeline_peak_in_flight"],
    }


@pytest.fixture(scope="module")
def reference(pools, config_file):
    return pools(1).run(run, config_file)[0]


def _assert_same_training(results, reference, tol=1e-4):
    for rank, result in enumerate(results):
        for step, ((loss, gn), (loss_ref, gn_ref)) in enumerate(zip(result["trajectory"], reference["trajectory"]), 1):
            assert abs(loss - loss_ref) <= tol * loss_ref, f"rank {rank} step {step}: loss {loss} vs {loss_ref}"
            assert abs(gn - gn_ref) <= tol * gn_ref, f"rank {rank} step {step}: grad norm {gn} vs {gn_ref}"
        assert result["state"].keys() == reference["state"].keys()
        for name, ref in reference["state"].items():
            if name.endswith("attn.k_proj.bias"):
                # Its true gradient is identically zero (softmax ignores a shift shared by all keys), so AdamW
                # turns float noise into O(lr) steps that differ by layout, with no effect on the function:
                # the loss trajectories above, which match, are the check that matters for it.
                continue
            err = (result["state"][name] - ref).norm() / ref.norm()
            assert err <= tol, f"rank {rank}: final {name} differs by {err:.1e}"


LAYOUTS = [
    dict(tp=2, pp=2, schedule="afab"),
    dict(tp=2, pp=2, schedule="1f1b"),
    dict(tp=2, pp=2, schedule="interleaved", virtual_stages=2, sequence_parallel=True),
    dict(tp=1, pp=2, dp=2, schedule="1f1b", zero=0),
    dict(tp=1, pp=2, dp=2, schedule="afab", zero=1),
    dict(tp=1, pp=2, dp=2, schedule="interleaved", virtual_stages=2, zero=2),
    dict(tp=2, dp=2, zero=0),
    dict(tp=2, dp=2, zero=1),
    dict(tp=2, dp=2, zero=2),
    dict(pp=4, schedule="afab"),
    dict(pp=4, schedule="1f1b"),
    dict(pp=4, schedule="interleaved", virtual_stages=2),
    dict(dp=4, zero=0),
    dict(dp=4, zero=1),
    dict(dp=4, zero=2, micro_batch_size=2),
]


def _id(layout):
    return "-".join(f"{k}{v}" if k not in ("schedule",) else v for k, v in layout.items())


@pytest.mark.parametrize("layout", LAYOUTS, ids=[_id(lay) for lay in LAYOUTS])
def test_3d_layouts_train_like_one_process(pools, config_file, reference, layout):
    layout = {"tp": 1, "pp": 1, "dp": 4 // (layout.get("tp", 1) * layout.get("pp", 1)), **layout}
    _assert_same_training(pools(4).run(run, config_file, **layout), reference)


def test_reference_learns(reference):
    losses = [loss for loss, _ in reference["trajectory"]]
    assert losses[-1] < losses[0] - 0.5


# -- communication volumes ------------------------------------------------------------------------

def _param_bytes():
    return sum(4 * n for n in _param_numels().values())


def _param_numels():
    from tensorpar.models import Transformer

    return {k: p.numel() for k, p in Transformer(CONFIG, None, init=False).named_parameters()}


def test_dp_communicates_every_gradient_byte_once_per_step(pools, config_file):
    # 4 micro-batches per DP rank: gradients must not be communicated per micro-batch
    results = pools(4).run(run, config_file, dp=4, steps=1, warmup_steps=0, global_batch_size=16, micro_batch_size=1)
    for r in results:
        calls, nbytes = r["comm"]["all_reduce/dp"]
        assert nbytes == _param_bytes() + 4  # every gradient byte once, plus the logged loss (1 fp32)
        assert not any(key.endswith("/tp") or key.endswith("/pp") for key in r["comm"])


@pytest.mark.parametrize("zero", [1, 2])
def test_zero_reduce_scatters_gradients_and_all_gathers_parameters_once_per_step(pools, config_file, zero):
    results = pools(4).run(run, config_file, dp=4, zero=zero, steps=1, warmup_steps=0, global_batch_size=16, micro_batch_size=2)
    for r in results:
        rs_calls, rs_bytes = r["comm"]["reduce_scatter/dp"]
        ag_calls, ag_bytes = r["comm"]["all_gather/dp"]
        assert rs_calls == ag_calls  # one of each per bucket
        # the bucket is padded to a multiple of dp: at most dp - 1 extra elements per bucket
        assert _param_bytes() <= rs_bytes <= _param_bytes() + 4 * 3 * rs_calls
        assert ag_bytes == rs_bytes
        assert r["comm"]["all_reduce/dp"] == (2, 8)  # the grad-norm and the logged loss scalars


def test_pipeline_sends_one_activation_per_microbatch_per_boundary_each_way(pools, config_file):
    results = pools(4).run(run, config_file, pp=2, dp=2, steps=1, warmup_steps=0, global_batch_size=8, micro_batch_size=1)
    microbatches, activation = 8 // 2, 1 * 16 * CONFIG.hidden_size * 4
    for r in results:
        assert r["comm"]["send/pp"] == (microbatches, microbatches * activation)
        assert r["comm"]["recv/pp"] == (microbatches, microbatches * activation)


def test_zero1_optimizer_state_is_one_dp_th(pools, config_file):
    unsharded = pools(1).run(run, config_file, steps=1, warmup_steps=0)[0]["optimizer_state_bytes"]
    assert unsharded == 2 * _param_bytes()  # AdamW: two fp32 moments per parameter
    for r in pools(4).run(run, config_file, dp=4, zero=1, steps=1, warmup_steps=0):
        sharded = r["optimizer_state_bytes"]
        assert unsharded / 4 <= sharded <= unsharded / 4 + 2 * 4 * 3  # padding: < dp elements per bucket


# -- schedules executed for real: bubbles and in-flight activations -------------------------------

# Long enough that gloo's point-to-point latency (~1 ms per hop on this machine) is small against the work.
FORWARD_S, BACKWARD_S = 0.06, 0.12


class _Sleep(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, forward_s, backward_s):
        time.sleep(forward_s)
        ctx.backward_s = backward_s
        return x * 1.0

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.backward_s)
        return grad, None, None


class SleepingStage:
    """A stand-in pipeline stage whose forward and backward take fixed wall time without using a CPU core,
    so that 4 ranks on 2 cores behave like 4 devices: what is measured is the schedule's execution."""

    def __init__(self, pp, virtual_stages, shape):
        self.cfg = SimpleNamespace(num_layers=pp * virtual_stages)
        self.weight = torch.ones((), requires_grad=True)
        self.shape, self.v = shape, virtual_stages

    def forward_layers(self, x, layers, targets, seed, *, embed, head):
        if embed:
            x = torch.zeros(self.shape)
        # Every chunk takes the full time: the bubble formula depends only on the 1:2 forward:backward ratio,
        # and longer actions keep the per-hop p2p latency (v times more hops when interleaved) negligible.
        h = _Sleep.apply(x * self.weight, FORWARD_S, BACKWARD_S)
        return h.sum() if head else h


def check_measured_schedule(schedule, pp, microbatches, virtual_stages):
    from tensorpar.parallel.pipeline import PipelineRunner
    from tensorpar.parallel.pipeline_view import measured_bubble

    m = mesh(tp=1, pp=pp)
    shape = (1, 4, 8)
    runner = PipelineRunner(SleepingStage(pp, virtual_stages, shape), m, schedule, virtual_stages, microbatches, shape)
    batches = [torch.zeros(1, 5, dtype=torch.long) for _ in range(microbatches)]
    runner.train_step(batches, lambda i: None)  # warm-up (connections)
    runner.train_step(batches, lambda i: None)
    timelines = m.pp_group.all_gather_object([(k, mb, c, t0, t1) for k, mb, c, t0, t1 in runner.timeline])
    return measured_bubble(timelines), runner.peak_in_flight


@pytest.mark.parametrize("schedule,microbatches,virtual_stages", [
    ("afab", 8, 1), ("1f1b", 8, 1), ("1f1b", 4, 1), ("interleaved", 8, 2),
])
def test_measured_bubble_matches_the_formula(pools, schedule, microbatches, virtual_stages):
    from tensorpar.parallel.pipeline_schedules import theoretical_bubble

    pp = 4
    expected = theoretical_bubble(schedule, pp, microbatches, virtual_stages)
    results = pools(4).run(check_measured_schedule, schedule, pp, microbatches, virtual_stages)
    bubble = results[0][0]
    assert abs(bubble - expected) <= 0.10 * expected, f"measured {bubble:.3f}, formula {expected:.3f}"
    peaks = [peak for _, peak in results]
    if schedule == "1f1b":
        assert peaks == [min(pp - r, microbatches) for r in range(pp)]  # never more than p micro-batches
    elif schedule == "afab":
        assert peaks == [microbatches] * pp


def test_bad_pipeline_layouts_are_refused(config_file):
    from tensorpar.errors import LayoutError
    from tensorpar.training import validate

    bad = [
        (dict(pp=3, dp=1), "8 layers cannot be split evenly into pp=3"),
        (dict(pp=2, virtual_stages=3, dp=1), "pp=2 x virtual stages=3"),
        (dict(pp=2, schedule="interleaved", virtual_stages=2, dp=1, global_batch_size=3, micro_batch_size=1),
         "multiple of the pipeline-parallel size 2"),
    ]
    for overrides, needle in bad:
        args = TrainOptions(model=config_file, **{**BASE, **overrides})
        with pytest.raises(LayoutError, match=needle.replace("*", r"\*")):
            validate(args)


def test_tied_embeddings_stay_tied_across_pipeline_stages(pools, tmp_path):
    """GPT-2 ties the head to the embedding: the last stage's copy must train exactly like the one weight."""
    path = tmp_path / "gpt2.json"
    path.write_text(json.dumps(get_config("tiny-gpt2").replace(hidden_size=64, ffn_hidden_size=128).to_dict()))
    reference = pools(1).run(run, str(path))[0]
    _assert_same_training(pools(4).run(run, str(path), tp=2, pp=2, dp=1, schedule="1f1b"), reference)
    _assert_same_training(pools(4).run(run, str(path), tp=1, pp=2, dp=2, zero=1, schedule="afab"), reference)
