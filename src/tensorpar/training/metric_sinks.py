"""Where each optimizer step's metrics record goes: metrics.jsonl (--metrics), TensorBoard event files
(--tensorboard DIR) and a Weights & Biases run (--wandb PROJECT).

The record is the one source of names: every number in it becomes a scalar of the same name at the record's step,
nested dicts flattened with "/" (``memory_mib/activations``), flags as 0 / 1 (``skipped``). A metric added to the
record reaches every sink with no list to update. Rank 0, which writes metrics.jsonl, writes them all.

A sink is anything with ``write(record)`` and ``close(failed=False)``.
"""

from __future__ import annotations

import importlib.util
import os

from tensorpar.errors import TensorparError
from tensorpar.training.metrics import MetricsWriter

# (option, its flag, the package it needs, the extra that installs it)
_PACKAGES = (("tensorboard", "--tensorboard", "tensorboard", "tensorboard"), ("wandb", "--wandb", "wandb", "wandb"))


def check_sink_packages(options) -> None:
    """Refuse --tensorboard / --wandb when their package is not installed, with the line that installs it."""
    for name, flag, package, extra in _PACKAGES:
        if getattr(options, name) and importlib.util.find_spec(package) is None:
            raise TensorparError(f"{flag} needs the {package} package, which is not installed: "
                                 f"pip install 'tensorpar[{extra}]' (or pip install {package})")
    if options.wandb_run and not options.wandb:
        raise TensorparError("--wandb-run names a run of --wandb PROJECT: give --wandb too")


def scalars(record: dict, prefix: str = "") -> dict[str, float]:
    """Every number of `record` but its step, by name: nested dicts as "outer/inner", booleans as 0 / 1."""
    out = {}
    for key, value in record.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(scalars(value, f"{name}/"))
        elif isinstance(value, (bool, int, float)) and name != "step":
            out[name] = float(value)
    return out


class TensorBoardSink:
    """TensorBoard event files in `folder`, flushed every step so that a running `tensorboard --logdir` shows it. A run
    resumed at step `resumed_at` hides the steps after it that `folder` already holds (an abandoned branch's, or a
    killed run's after its checkpoint), as TensorBoard's purge_step does, so that no step is shown twice."""

    def __init__(self, folder: str, resumed_at: int = 0):
        from torch.utils.tensorboard import SummaryWriter  # the optional tensorboard package, checked at validation

        self.writer = SummaryWriter(folder, purge_step=resumed_at + 1 if resumed_at else None)

    def write(self, record: dict) -> None:
        for name, value in scalars(record).items():
            self.writer.add_scalar(name, value, record["step"])
        self.writer.flush()

    def close(self, failed: bool = False) -> None:
        self.writer.close()


class WandbSink:
    """A Weights & Biases run of `project` holding the run's resolved configuration and the scalars of each step.
    W&B's own variables apply (WANDB_MODE=offline, WANDB_ENTITY, WANDB_RUN_ID, WANDB_RESUME, ...); its files go to
    $WANDB_DIR, else to `folder` (the run's OUT_DIR), else to the working directory."""

    def __init__(self, project: str, name: str | None, config: dict, folder: str | None):
        import wandb  # the optional wandb package, checked at validation

        where = {} if os.environ.get("WANDB_DIR") or not folder else {"dir": folder}
        if where:
            os.makedirs(folder, exist_ok=True)
        self.run = wandb.init(project=project, name=name, config=config, **where)

    def write(self, record: dict) -> None:
        self.run.log(scalars(record), step=record["step"])

    def close(self, failed: bool = False) -> None:
        self.run.finish(exit_code=1 if failed else 0)


def open_sinks(options, config: dict, resumed_at: int = 0) -> list:
    """The sinks the options ask for (rank 0 only): metrics.jsonl and TensorBoard (continued from step `resumed_at` by
    a resumed run), W&B (given `config`, the resolved options)."""
    sinks = []
    if options.metrics:
        sinks.append(MetricsWriter(options.metrics, resumed_at))
    if options.tensorboard:
        sinks.append(TensorBoardSink(options.tensorboard, resumed_at))
    if options.wandb:
        sinks.append(WandbSink(options.wandb, options.wandb_run, config, options.out_dir))
    return sinks
