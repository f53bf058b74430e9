"""`train(options)`: a whole training run on every rank of the running world.

    validate (once per process)  ->  build mesh  ->  build session (model, data, optimizer, resume, pipeline)
                                 ->  step loop   ->  summary (rank 0 also draws, samples and writes)

Each step has its own module: `validate`, `session`, `loop`, `summary`.
"""

from __future__ import annotations

import os

from tensorpar.config.options import TrainOptions
from tensorpar.distributed.launch import signal_name
from tensorpar.distributed.mesh import Mesh, build_mesh
from tensorpar.training.loop import step_loop
from tensorpar.training.session import build_session
from tensorpar.training.stop import GracefulStop
from tensorpar.training.summary import summarize
from tensorpar.training.validate import PreparedRun, validate


def train(options: TrainOptions, mesh: Mesh | None = None) -> dict:
    """Validate `options`, then train; returns the summary (the same on every rank). `mesh`: see `run_training`."""
    return run_training(validate(options, mesh.world_size if mesh is not None else None), mesh=mesh)


def run_training(run: PreparedRun, stop: GracefulStop | None = None, mesh: Mesh | None = None) -> dict:
    """Train a validated run on every rank of the running world; returns the summary. With `stop` (a
    `GracefulStop` the caller installed), a SIGTERM or SIGINT ends the run early, saved.

    Without `mesh` the run creates its process groups and destroys them at the end. A caller that trains several
    times in the same processes (a sweep, a test harness) may pass a mesh of the run's layout instead, kept
    afterwards: creating and tearing down the groups costs a fraction of a second per run on gloo."""
    o = run.options
    owned = mesh is None
    if owned:
        mesh = build_mesh(run.layout, moe=run.cfg.is_moe, device=o.device, backend=o.backend, timeout=o.timeout)
    else:
        mesh.check_run(run.layout, run.cfg.is_moe)
    # Where each rank writes its flight record of collectives when one fails, the run is stopped, or it ends with
    # --dump-collectives-on-exit (`tensorpar diagnose OUT_DIR` reads them).
    mesh.stats.flight.folder = os.path.join(o.out_dir, "flight") if o.out_dir else None
    try:
        session = build_session(run, mesh, stop)
        result = step_loop(session)
        if result.stop_signal is not None or o.dump_collectives_on_exit:
            reason = f"stopped by {signal_name(result.stop_signal)}" if result.stop_signal else "the run ended"
            mesh.stats.flight.dump(reason)
        return summarize(session, result)
    finally:
        if owned:
            mesh.destroy()
