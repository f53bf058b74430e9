"""Where the metrics record goes (training/metric_sinks.py): --tensorboard DIR and --wandb PROJECT hold every scalar
of metrics.jsonl at every step, read back with TensorBoard's and W&B's own formats; missing packages are refused."""

import glob
import json
import os
import struct
import sys

import numpy as np
import pytest

from tensorpar.training import TrainOptions

import layout_runs
from harness import train


def check_tiny_run(out_dir, **sinks):
    """4 steps of tiny at TP 2 with a validation loss every 2 steps, its metrics in OUT_DIR/metrics.jsonl."""
    settings = {**layout_runs.BASE, "return_state": False, "tp": 2, "global_batch_size": 2, "micro_batch_size": 2,
                "val_fraction": 0.05, "val_every": 2, "val_windows": 2, "out_dir": out_dir,
                "metrics": os.path.join(out_dir, "metrics.jsonl"), **sinks}
    train(TrainOptions(model="tiny", **settings))


def expected_scalars(out_dir) -> dict[int, dict[str, float]]:
    """{step: {name: value}} from metrics.jsonl: every number of each line, nested dicts as "outer/inner"."""
    out = {}
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        for record in map(json.loads, f):
            flat = {}
            for key, value in record.items():
                items = value.items() if isinstance(value, dict) else [(None, value)]
                flat.update({key if inner is None else f"{key}/{inner}": v for inner, v in items})
            step = flat.pop("step")
            out[step] = {name: float(v) for name, v in flat.items()}
    return out


def test_a_resumed_run_continues_the_metrics_file_from_its_checkpoint(tmp_path):
    """Resumed at step 2: steps 1-2 kept, the abandoned branch's step 3 and a line a kill cut short dropped."""
    from tensorpar.training.metrics import MetricsWriter

    path = str(tmp_path / "metrics.jsonl")
    with open(path, "w") as f:
        f.write('{"step": 1, "loss": 5.0}\n{"step": 2, "loss": 4.0}\n{"step": 3, "loss": 3.0}\n{"step": 4, "lo')
    writer = MetricsWriter(path, resumed_at=2)
    writer.write({"step": 3, "loss": 3.5})
    writer.close()
    with open(path) as f:
        assert [(r["step"], r["loss"]) for r in map(json.loads, f)] == [(1, 5.0), (2, 4.0), (3, 3.5)]
    MetricsWriter(path).close()  # a new run starts afresh
    assert os.path.getsize(path) == 0


def test_tensorboard_holds_every_metric_of_every_step(pools, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = str(tmp_path / "run")
    pools(2).run(check_tiny_run, out, tensorboard=str(tmp_path / "tb"))
    expected = expected_scalars(out)
    assert sorted(expected) == [1, 2, 3, 4] and "val_loss" in expected[2] and "memory_mib/activations" in expected[1]
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    logged: dict[int, dict[str, float]] = {}
    for tag in events.Tags()["scalars"]:
        for e in events.Scalars(tag):
            logged.setdefault(e.step, {})[tag] = e.value
    assert sorted(logged) == sorted(expected)
    for step, values in expected.items():
        assert sorted(logged[step]) == sorted(values), step
        for name, value in values.items():  # TensorBoard keeps float32
            assert logged[step][name] == np.float32(value), (step, name, logged[step][name], value)


def test_a_resumed_run_shows_each_step_once_in_tensorboard(tmp_path):
    """Steps 1-4 logged, then a run resumed at step 2 logs 3 again: TensorBoard shows the resumed run's step 3 only."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from tensorpar.training.metric_sinks import TensorBoardSink

    folder = str(tmp_path / "tb")
    first = TensorBoardSink(folder)
    for step in range(1, 5):
        first.write({"step": step, "loss": float(10 - step)})
    first.close()
    resumed = TensorBoardSink(folder, resumed_at=2)
    resumed.write({"step": 3, "loss": 0.5})
    resumed.close()
    events = EventAccumulator(folder)
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("loss")] == [(1, 9.0), (2, 8.0), (3, 0.5)]


def test_tensorboard_shows_each_step_as_soon_as_it_is_written(tmp_path):
    """What a live `tensorboard --logdir` reads: the step is on disk before the writer is closed."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from tensorpar.training.metric_sinks import TensorBoardSink

    sink = TensorBoardSink(str(tmp_path))
    sink.write({"step": 3, "loss": 2.5, "memory_mib": {"activations": 1.25}, "skipped": True})
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    assert {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]} == {
        "loss": [(3, 2.5)], "memory_mib/activations": [(3, 1.25)], "skipped": [(3, 1.0)]}
    sink.close()


def wandb_records(path):
    """The records of a .wandb file: W&B's protobuf `Record`s in a LevelDB-style log (32 KiB blocks of chunks, each
    with a 7-byte header: checksum, length, type FULL / FIRST / MIDDLE / LAST), after a 7-byte file header."""
    from wandb.proto import wandb_internal_pb2

    block, header = 32768, 7
    with open(path, "rb") as f:
        data = f.read()
    assert struct.unpack("<4sHB", data[:header])[:2] == (b":W&B", 0xBEE1)
    pos, pending = header, b""
    while pos + header <= len(data):
        room = block - pos % block
        if room < header:  # a block's last bytes are padding
            pos += room
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + header])
        pending += data[pos + header:pos + header + length]
        pos += header + length
        if kind in (1, 4):  # FULL, LAST
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def check_wandb_run(out_dir):
    os.environ.update(WANDB_MODE="offline", WANDB_SILENT="true")
    try:
        check_tiny_run(out_dir, wandb="tensorpar-test", wandb_run="tiny-tp2")
    finally:
        for name in ("WANDB_MODE", "WANDB_SILENT"):
            os.environ.pop(name)


def test_wandb_offline_run_holds_the_config_and_every_metric_of_every_step(pools, tmp_path):
    pytest.importorskip("wandb")
    out = str(tmp_path / "run")
    pools(2).run(check_wandb_run, out)
    expected = expected_scalars(out)
    (path,) = glob.glob(os.path.join(out, "wandb", "offline-run-*", "run-*.wandb"))
    logged, config = {}, None
    for record in wandb_records(path):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            assert (record.run.project, record.run.display_name) == ("tensorpar-test", "tiny-tp2")
            config = {item.key: json.loads(item.value_json) for item in record.run.config.update}
        elif kind == "history":
            items = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            logged[items.pop("_step")] = {k: v for k, v in items.items() if not k.startswith("_")}
    assert logged == expected
    # The resolved configuration: what validate() worked out (dp, the micro-batch size), not only what was given.
    assert config is not None and config["tp"] == 2 and config["dp"] == 1 and config["micro_batch_size"] == 2


@pytest.mark.parametrize("flag,package", [("--tensorboard", "tensorboard"), ("--wandb", "wandb")])
def test_a_logger_without_its_package_is_refused_with_the_install_line(cli, monkeypatch, tmp_path, flag, package):
    monkeypatch.setitem(sys.modules, package, None)  # as if not installed
    code, _, err = cli("train", "--tp", "2", flag, str(tmp_path / "x"), "--out-dir", str(tmp_path))
    assert code == 2 and f"{flag} needs the {package} package" in err and f"pip install 'tensorpar[{package}]'" in err
    assert len(err.strip().splitlines()) == 1, err


def test_a_wandb_run_name_needs_a_project(cli, tmp_path):
    code, _, err = cli("train", "--wandb-run", "x", "--out-dir", str(tmp_path))
    assert code == 2 and "--wandb-run names a run of --wandb PROJECT" in err
