"""`train(options)`: a whole training run on every rank of the running world.

    validate (once per process)  ->  build mesh  ->  build session (model, data, optimizer, resume, pipeline)
                                 ->  step loop   ->  summary (rank 0 also draws, samples and writes)

Each step has its own module: `validate`, `session`, `loop`, `summary`.
"""

from __future__ import annotations

from tensorpar.config.options import TrainOptions
from tensorpar.distributed.mesh import init_mesh
from tensorpar.training.loop import step_loop
from tensorpar.training.session import build_session
from tensorpar.training.summary import summarize
from tensorpar.training.validate import PreparedRun, validate


def train(options: TrainOptions) -> dict:
    """Validate `options`, then train; returns the summary (the same on every rank)."""
    return run_training(validate(options))


def run_training(run: PreparedRun) -> dict:
    """Train a validated run on every rank of the running world; returns the summary."""
    o = run.options
    mesh = init_mesh(tp=o.tp, pp=o.pp, dp=o.dp, device=o.device)
    try:
        session = build_session(run, mesh)
        records, seconds = step_loop(session)
        return summarize(session, records, seconds)
    finally:
        mesh.destroy()
