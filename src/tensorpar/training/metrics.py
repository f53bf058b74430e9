"""Metrics output: one JSON object per optimizer step, the loss-curve picture, and drawing without failing a run."""

from __future__ import annotations

import json
import os
import sys


class MetricsWriter:
    """Appends JSON lines to `path` (or does nothing when path is None): the metrics.jsonl sink
    (tensorpar.training.metric_sinks). A run resumed at step `resumed_at` keeps the file's records of steps 1 to
    `resumed_at` and continues it; a new run starts it afresh."""

    def __init__(self, path: str | None, resumed_at: int = 0):
        self.path = path
        self._file = None
        if path:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            if resumed_at:  # replaced whole, so that a kill now leaves the old file or the kept records
                with open(path + ".tmp", "w") as f:
                    f.writelines(_records_until(path, resumed_at))
                os.replace(path + ".tmp", path)
            self._file = open(path, "a" if resumed_at else "w")

    def write(self, record: dict) -> None:
        if self._file:
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()

    def close(self, failed: bool = False) -> None:
        if self._file:
            self._file.close()
            self._file = None


def read_records(path: str) -> list[dict]:
    """The step records of the metrics file `path` (none if absent), without a line a killed run left half written."""
    try:
        with open(path) as f:
            lines = f.readlines()
    except OSError:
        return []
    records = []
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and isinstance(record.get("step"), int):
            records.append(record)
    return records


def _records_until(path: str, step: int) -> list[str]:
    """The lines of the metrics file `path` of steps up to `step`: those a resumed run continues from, without the
    steps of a branch past its checkpoint."""
    return [json.dumps(r) + "\n" for r in read_records(path) if r["step"] <= step]


def draw_or_warn(what: str, draw, *args) -> str | None:
    """`draw(*args)` (which returns the path it wrote), or None and a warning if it cannot draw: a picture is
    not a reason to fail a finished run (no matplotlib, a full disk, an unwritable folder)."""
    try:
        return draw(*args)
    except Exception as e:  # noqa: BLE001 - whatever stops the picture, the run's results stand
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        sys.stderr.write(f"tensorpar: warning: could not draw {what} ({reason}); the run's results are saved\n")
        return None


def plot_loss_curve(records: list[dict], path: str, title: str) -> str:
    """Training loss per step and validation loss where measured; for a mixture-of-experts run, a second panel
    with the routing metrics (load imbalance, the auxiliary losses, dropped share when a capacity is set).
    Returns the path."""
    import matplotlib  # a heavy import, paid only by the runs that draw

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    moe = [r for r in records if r.get("moe_load_imbalance") is not None]
    if moe:
        fig, (ax, ax_moe) = plt.subplots(2, 1, figsize=(7, 6.5), sharex=True, height_ratios=(3, 2))
    else:
        fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([r["step"] for r in records], [r["loss"] for r in records], label="train loss", lw=1)
    val = [r for r in records if r.get("val_loss") is not None]
    if val:
        ax.plot([r["step"] for r in val], [r["val_loss"] for r in val], "o-", label="validation loss")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    if moe:
        _plot_moe_panel(ax_moe, moe)
    (ax_moe if moe else ax).set_xlabel("optimizer step")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _plot_moe_panel(ax, records: list[dict]) -> None:
    """Load imbalance (busiest expert / mean, left axis) and the auxiliary losses and dropped share (right)."""
    steps = [r["step"] for r in records]
    ax.plot(steps, [r["moe_load_imbalance"] for r in records], color="tab:red", lw=1, label="load imbalance")
    ax.axhline(1.0, color="tab:red", lw=0.5, ls=":")
    ax.set_ylabel("busiest expert / mean")
    ax.grid(alpha=0.3)
    right = ax.twinx()
    lines = [("moe_aux_loss", "balance loss (x coef)", "tab:blue"), ("moe_z_loss", "z-loss (x coef)", "tab:green"),
             ("moe_dropped_fraction", "dropped share", "tab:gray")]
    for key, label, color in lines:
        values = [r.get(key) or 0.0 for r in records]
        if any(values):
            right.plot(steps, values, color=color, lw=1, label=label)
    right.set_ylabel("auxiliary losses, dropped share")
    handles = ax.get_legend_handles_labels()[0] + right.get_legend_handles_labels()[0]
    ax.legend(handles=handles, loc="upper right", fontsize=8)
