"""`--compile` (tensorpar.models.compile): torch.compile per transformer block trains exactly like the eager model
(TP 2 with its collectives inside the blocks, with and without activation recomputation), and where the backend
cannot compile the run warns and goes on uncompiled."""

import pytest
import torch

from tensorpar.models import Transformer
from tensorpar.models.compile import compile_blocks, compile_problem
from tensorpar.training import TrainOptions

from harness import train

from conftest import TINY8

BASE = dict(model="tiny", tp=2, steps=3, seed=3, global_batch_size=4, micro_batch_size=2, seq_len=16, lr=3e-3,
            warmup_steps=1, val_every=0, progress=False, metrics=None, out_dir=None, device="cpu")


def compiled_vs_eager(**overrides):
    """(eager losses, compiled losses, whether the blocks were compiled, why the backend cannot compile or None) of
    the same short TP run."""
    eager = train(TrainOptions(**{**BASE, **overrides}))
    compiled = train(TrainOptions(**{**BASE, **overrides, "compile": True}))
    blocks_compiled = torch._dynamo.utils.counters["stats"]["unique_graphs"] > 0
    problem = None if blocks_compiled else compile_problem()
    return [r["loss"] for r in eager["history"]], [r["loss"] for r in compiled["history"]], blocks_compiled, problem


def test_compiled_blocks_train_like_eager_ones(pools):
    # the ranks find out whether inductor compiles here (as `--compile` does): probing here too would cost seconds
    results = pools(2).run(compiled_vs_eager, recompute="full")
    if results[0][3] is not None:
        pytest.skip(f"torch.compile cannot compile here: {results[0][3]}")
    for rank, (eager, compiled, blocks_compiled, _) in enumerate(results):
        assert blocks_compiled, f"rank {rank}: nothing was compiled"
        for step, (a, b) in enumerate(zip(compiled, eager), 1):
            assert abs(a - b) <= 1e-4 * abs(b), f"rank {rank} step {step}: compiled loss {a} vs eager {b}"
    assert eager[-1] != eager[0], "the losses did not move: a vacuous comparison"


def _failing_backend(gm, example_inputs):
    raise RuntimeError("no C compiler found (simulated)")


def test_a_backend_that_cannot_compile_warns_and_runs_uncompiled():
    model = Transformer(TINY8.replace(num_layers=2), None, seed=0)
    ids = torch.randint(0, TINY8.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))
    before = model(ids, ids).item()
    with pytest.warns(RuntimeWarning, match=r"cannot compile on this machine \(.*no C compiler found.*running "
                                            r"uncompiled"):
        assert compile_blocks(model, backend=_failing_backend) is False
    assert all(block._compiled_call_impl is None for block in model.layers.values())
    assert model(ids, ids).item() == before
