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
from tensorpar.training.stop import GracefulStop
from tensorpar.training.summary import summarize
from tensorpar.training.validate import PreparedRun, validate


def train(options: TrainOptions) -> dict:
    """Validate `options`, then train; returns the summary (the same on every rank)."""
    return run_training(validate(options))


def run_training(run: PreparedRun, stop: GracefulStop | None = None) -> dict:
    """Train a validated run on every rank of the running world; returns the summary. With `stop` (a
    `GracefulStop` the caller installed), a SIGTERM or SIGINT ends the run early, saved."""
    o = run.options
    mesh = init_mesh(tp=o.tp, pp=o.pp, dp=o.dp, cp=o.cp, ep=o.ep if run.cfg.is_moe else None,
                     expert_tp=o.expert_tp if run.cfg.is_moe else 1, device=o.device,
                     timeout=o.timeout)
    try:
        session = build_session(run, mesh, stop)
        return summarize(session, step_loop(session))
    finally:
        mesh.destroy()
