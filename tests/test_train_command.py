"""`tensorpar train` as a user runs it: --config with flags overriding it, the resolved configuration in the run
folder and the checkpoint, what a resumed run says changed, and pictures that cannot fail a finished run."""

import json
import os
import subprocess
import sys

import pytest

from tensorpar.checkpoints.sharded import read_meta
from tensorpar.config.fields import load_toml
from tensorpar.config.options import TrainOptions

from test_cli import tensorpar


def _lines(path):
    return [json.loads(line) for line in open(path)]


def test_config_file_flags_override_resolved_config_and_resume(tmp_path, config_file):
    out, save = tmp_path / "run", tmp_path / "ckpt"
    config = tmp_path / "run.toml"
    config.write_text(f'model = "{config_file}"\nsteps = 4\nseq_len = 16\nglobal-batch-size = 4\n'
                      f'save = "{save}"\nout_dir = "{out}"\nprogress = false\nval_every = 0\nlr = 0.01\n')
    proc, _ = tensorpar("train", "--config", str(config), "--tp", "2", "--steps", "2")
    assert proc.returncode == 0, proc.stderr
    assert [r["step"] for r in _lines(out / "metrics.jsonl")] == [1, 2]  # --steps 2 overrode steps = 4
    written = (out / "config.toml").read_text()
    given = load_toml(str(out / "config.toml"), TrainOptions, "train")
    assert given["tp"] == 2 and given["steps"] == 2 and given["lr"] == 0.01 and given["global_batch_size"] == 4
    # What the run worked out is recorded, as a comment: a file that froze dp or min_lr would go wrong when
    # the world size or the learning rate is changed on the command line.
    assert "dp" not in given and "min_lr" not in given
    assert "# worked out: dp = 1, micro_batch_size = 4, min_lr = 0.001, warmup_steps = 0" in written
    assert f"configuration: {out / 'config.toml'}" in proc.stdout
    meta = read_meta(str(save))[1]  # the checkpoint keeps every resolved value
    assert meta["options"]["tp"] == 2 and meta["options"]["dp"] == 1 and meta["options"]["min_lr"] == 0.001

    # The resolved file is itself a --config; the resumed run names what differs from the saved one.
    proc, _ = tensorpar("train", "--config", str(out / "config.toml"), "--resume", str(save), "--tp", "1",
                        "--steps", "3", "--lr", "0.02")
    assert proc.returncode == 0, proc.stderr
    note = [ln for ln in proc.stderr.splitlines() if "changed since it was saved" in ln]
    assert len(note) == 1 and "tp 2 -> 1" in note[0] and "steps 2 -> 3" in note[0] and "lr 0.01 -> 0.02" in note[0]
    assert "resume" not in note[0].split("saved:")[1]
    assert [r["step"] for r in _lines(out / "metrics.jsonl")] == [3]


def test_unknown_config_key_is_one_line_naming_the_key(tmp_path):
    config = tmp_path / "run.toml"
    config.write_text("tp = 1\nglobal_batch = 4\n")
    proc, elapsed = tensorpar("train", "--config", str(config))
    assert proc.returncode == 2 and elapsed < 15
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "unknown option 'global_batch'" in lines[0] and "global_batch_size" in lines[0]


@pytest.fixture()
def no_matplotlib(tmp_path):
    """An environment in which `import matplotlib` fails, in the launcher and in every rank it starts."""
    fake = tmp_path / "fake" / "matplotlib"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('No module named matplotlib (hidden by the test)')\n")
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(fake.parent),
                                                                             os.environ.get("PYTHONPATH", "")]))


@pytest.mark.parametrize("draw", [True, False], ids=["matplotlib", "no-matplotlib"])
def test_a_pipeline_run_exits_0_and_draws_its_timeline_or_warns(tmp_path, config_file, no_matplotlib, draw):
    out = tmp_path / "run"
    env = dict(os.environ, OMP_NUM_THREADS="1") if draw else no_matplotlib
    cmd = [sys.executable, "-m", "tensorpar", "train", "--model", config_file, "--pp", "2", "--steps", "2",
           "--seq-len", "16", "--global-batch-size", "4", "--micro-batch-size", "2", "--no-progress",
           "--out-dir", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env)
    assert proc.returncode == 0, proc.stderr
    assert len(_lines(out / "metrics.jsonl")) == 2
    assert (out / "pipeline.png").exists() == draw and (out / "loss.png").exists() == draw
    warnings = [ln for ln in proc.stderr.splitlines() if ln.startswith("tensorpar: warning: could not draw")]
    assert len(warnings) == (0 if draw else 2), proc.stderr
    assert "pipeline bubble (measured, last step)" in proc.stdout
