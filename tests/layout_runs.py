"""Training runs of a model at any (tp, cp, pp, dp, zero) layout, compared with one process: the loss and grad-norm
trajectory step by step and the dense weights at the end."""

from tensorpar.training import TrainOptions

from conftest import TINY8 as CONFIG
from harness import train

# A few steps show a layout computes what one process computes: each step's loss and grad norm, and the weights
# after them (which every gradient and optimizer state has moved). The canonical runs of tests/test_trainer.py
# take 20 steps, to catch drift that only builds up over a longer run.
BASE = dict(steps=4, seed=5, global_batch_size=8, micro_batch_size=1, seq_len=16, lr=3e-3, warmup_steps=1,
            val_every=0, val_fraction=0.0, progress=False, metrics=None, out_dir=None, device="cpu",
            return_state=True)


def run(model, **overrides):
    """Train `model` (a preset or a config file) with BASE and `overrides` on the harness's cached mesh."""
    summary = train(TrainOptions(model=model, **{**BASE, **overrides}))
    return {
        "trajectory": [(r["loss"], r["grad_norm"]) for r in summary["history"]],
        "state": summary.get("state"),
        "comm": summary["comm"],
        "optimizer_state_bytes": summary["optimizer_state_bytes"],
        "peak_in_flight": summary["pipeline_peak_in_flight"],
    }


_references: dict = {}


def reference(pools, model, **overrides):
    """The one-process run of these settings, computed once per test session and shared by every test that compares
    a layout with it."""
    key = (model, tuple(sorted(overrides.items())))
    if key not in _references:
        _references[key] = pools(1).run(run, model, **overrides)[0]
    return _references[key]


def assert_same_training(results, reference, tol=1e-4):
    for rank, result in enumerate(results):
        assert len(result["trajectory"]) == len(reference["trajectory"]), f"rank {rank}: another number of steps"
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


def param_bytes():
    return sum(4 * n for n in param_numels().values())


def param_numels():
    from tensorpar.models import Transformer

    return {k: p.numel() for k, p in Transformer(CONFIG, None, init=False).named_parameters()}
