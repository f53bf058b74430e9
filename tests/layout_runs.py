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
        "memory_mib": summary["memory_mib_per_rank"],
    }


_references: dict = {}


def reference(pools, model, **overrides):
    """The one-process run of these settings, computed once per test session and shared by every test that compares
    a layout with it."""
    key = (model, tuple(sorted(overrides.items())))
    if key not in _references:
        _references[key] = pools(1).run(run, model, **overrides)[0]
    return _references[key]


def reassociated(pools, model, **overrides):
    """The one-process run of these settings with its gradient sums in another order (micro-batches of half the size,
    accumulated): how far float reassociation alone moves each step's loss and grad norm and each final weight."""
    micro = overrides.get("micro_batch_size", BASE["micro_batch_size"])
    micro = (overrides.get("global_batch_size", BASE["global_batch_size"]) if micro is None else micro)
    return reference(pools, model, **{**overrides, "micro_batch_size": 2 if micro == 1 else micro // 2})


def assert_same_training(results, reference, tol=1e-4, floor=None):
    """Every rank's loss and grad norm at each step, and every final weight, within `tol` of the one-process
    `reference`. With `floor` (`reassociated`'s run), a step or a weight that one process itself reproduces only to
    more than tol / 10 when its sums are reordered is dominated by float noise (AdamW turns a gradient at noise level
    into steps of O(lr)) and is left out: a layout is a reordering of the same sums. `floor` may also be a list of
    (run, the same run reassociated) pairs, one per side of a comparison of two devices: the noise of either."""
    pairs = [] if floor is None else floor if isinstance(floor, list) else [(reference, floor)]

    def noisy(step: int, index: int) -> bool:  # index 0: the loss, 1: the grad norm
        return any(abs(alt["trajectory"][step][index] - base["trajectory"][step][index])
                   > tol / 10 * abs(base["trajectory"][step][index]) for base, alt in pairs)

    def noisy_weight(name: str) -> bool:
        return any(((alt["state"][name] - base["state"][name]).norm() / base["state"][name].norm()).item() > tol / 10
                   for base, alt in pairs)

    for rank, result in enumerate(results):
        assert len(result["trajectory"]) == len(reference["trajectory"]), f"rank {rank}: another number of steps"
        for step, ((loss, gn), (loss_ref, gn_ref)) in enumerate(zip(result["trajectory"], reference["trajectory"]), 1):
            assert noisy(step - 1, 0) or abs(loss - loss_ref) <= tol * loss_ref, \
                f"rank {rank} step {step}: loss {loss} vs {loss_ref}"
            assert noisy(step - 1, 1) or abs(gn - gn_ref) <= tol * gn_ref, \
                f"rank {rank} step {step}: grad norm {gn} vs {gn_ref}"
        assert result["state"].keys() == reference["state"].keys()
        for name, ref in reference["state"].items():
            if name.endswith("attn.k_proj.bias"):
                # Its true gradient is identically zero (softmax ignores a shift shared by all keys), so AdamW
                # turns float noise into O(lr) steps that differ by layout, with no effect on the function:
                # the loss trajectories above, which match, are the check that matters for it.
                continue
            if noisy_weight(name):
                continue
            err = (result["state"][name] - ref).norm() / ref.norm()
            assert err <= tol, f"rank {rank}: final {name} differs by {err:.1e}"


def param_bytes():
    return sum(4 * n for n in param_numels().values())


def param_numels():
    from tensorpar.models import Transformer

    return {k: p.numel() for k, p in Transformer(CONFIG, None, init=False).named_parameters()}
