"""`tensorpar train` as a user runs it: --config with flags overriding it, the resolved configuration in the run
folder and the checkpoint, what a resumed run says changed, and pictures that cannot fail a finished run."""

import json

import pytest

from tensorpar.checkpoints.sharded import read_meta
from tensorpar.commands.train import with_output_defaults
from tensorpar.config.fields import load_toml
from tensorpar.config.options import TrainOptions

from harness import run_cli
from test_cli import tensorpar


def _lines(path):
    return [json.loads(line) for line in open(path)]


def test_config_file_flags_override_resolved_config_and_resume(pools, tmp_path, config_file):
    """The first run is the train command's smoke test: `python -m tensorpar` from a shell, starting 2 ranks."""
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
    # A share held out for validation that changed changes the windows trained on: warned as a seed's change is.
    code, _, err = pools(1).run(run_cli, ["train", "--config", out / "config.toml", "--resume", save, "--tp", "1",
                                      "--steps", "3", "--lr", "0.02", "--val-fraction", "0.1"])[0]
    assert code == 0, err
    note = [ln for ln in err.splitlines() if "changed since it was saved" in ln]
    assert len(note) == 1 and "tp 2 -> 1" in note[0] and "steps 2 -> 3" in note[0] and "lr 0.01 -> 0.02" in note[0]
    assert "resume" not in note[0].split("saved:")[1] and "val_fraction" not in note[0]
    assert "warning: resuming with val_fraction 0.05 -> 0.1: the samples (and the continued losses) will differ" in err
    # The resumed run continues the metrics of the steps before its checkpoint: none lost, none twice.
    assert [r["step"] for r in _lines(out / "metrics.jsonl")] == [1, 2, 3]


def test_unknown_config_key_is_one_line_naming_the_key(tmp_path, cli):
    config = tmp_path / "run.toml"
    config.write_text("tp = 1\nglobal_batch = 4\n")
    code, _, err = cli("train", "--config", config)
    assert code == 2
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and "unknown option 'global_batch'" in lines[0] and "global_batch_size" in lines[0]


@pytest.mark.parametrize("draw", [True, False], ids=["matplotlib", "no-matplotlib"])
def test_a_pipeline_run_exits_0_and_draws_its_timeline_or_warns(pools, tmp_path, config_file, draw):
    """Two ranks run the train command as torchrun would start them; without matplotlib (its import fails on every
    rank) the finished run warns that it cannot draw, and exits 0."""
    out = tmp_path / "run"
    argv = ["train", "--model", config_file, "--pp", "2", "--steps", "2", "--seq-len", "16", "--global-batch-size",
            "4", "--micro-batch-size", "2", "--no-progress", "--out-dir", out]
    (code, stdout, stderr), _ = pools(2).run(run_cli, argv, hide_modules=() if draw else ("matplotlib",))
    assert code == 0, stderr
    assert len(_lines(out / "metrics.jsonl")) == 2
    assert (out / "pipeline.png").exists() == draw and (out / "loss.png").exists() == draw
    warnings = [ln for ln in stderr.splitlines() if ln.startswith("tensorpar: warning: could not draw")]
    assert len(warnings) == (0 if draw else 2), stderr
    assert "pipeline bubble (measured, last step)" in stdout


def test_a_resumed_run_draws_the_loss_curve_of_every_step_so_far(tmp_path):
    """Resumed at step 2 (the file holds an abandoned step 3 too): the curve is steps 1-2 from metrics.jsonl, then
    the resumed run's own."""
    import types

    from tensorpar.training.summary import _whole_run

    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": n, "loss": 9.0 - n}) + "\n" for n in (1, 2, 3)))
    session = types.SimpleNamespace(start_step=2, options=types.SimpleNamespace(metrics=str(path)))
    ran = [{"step": 3, "loss": 0.5}, {"step": 4, "loss": 0.25}]
    assert [(r["step"], r["loss"]) for r in _whole_run(session, ran)] == [(1, 8.0), (2, 7.0), (3, 0.5), (4, 0.25)]
    session.start_step = 0
    assert _whole_run(session, ran) == ran


@pytest.mark.parametrize("given, out_dir", [(dict(model="tiny"), "runs/tiny-tp2"),
                                             (dict(init_from="models/Qwen2.5-0.5B-Instruct/"),
                                              "runs/Qwen2.5-0.5B-Instruct-tp2"),
                                             (dict(model="configs/my-config.json"), "runs/my-config.json-tp2")])
def test_default_out_dir_names_the_model_whatever_its_path_ends_with(given, out_dir):
    """`--init-from FOLDER/` (a trailing slash, as the shell completes a folder) wrote to runs/-tp2."""
    options = with_output_defaults(TrainOptions(tp=2, **given))
    assert options.out_dir == out_dir and options.metrics == f"{out_dir}/metrics.jsonl"


@pytest.mark.parametrize("args,message", [
    (["train", "--save", "{file}"], "--save folder '{file}' is a file, not a folder"),
    (["train", "--save", "{file}/ck"], "is a file, not a folder"),
    (["train", "--out-dir", "{file}"], "--out-dir '{file}' is a file, not a folder"),
    (["train", "--tensorboard", "{file}"], "is a file, not a folder"),
    (["train", "--metrics", "{folder}"], "--metrics file '{folder}' is a folder, not a file"),
    (["train", "--metrics", "{file}/m.jsonl"], "cannot be written: '{file}' is a file"),
    (["prepare-data", "--data", "{data}", "--output", "{file}/x"], "cannot be written: '{file}' is a file"),
    (["convert", "{hf}", "{file}"], "destination '{file}' is a file, not a folder"),
])
def test_an_output_path_that_cannot_be_written_is_refused_before_the_run(tmp_path, cli, config_file, args, message):
    """A file where a command makes a folder (or a folder where it writes a file) is refused in one line before any
    rank starts: a --save path found unusable at the first save would have trained until then for nothing."""
    paths = dict(file=str(tmp_path / "a-file.txt"), folder=str(tmp_path), data=str(tmp_path / "d.jsonl"),
                 hf=str(tmp_path / "hf"))
    (tmp_path / "a-file.txt").write_text("x")
    (tmp_path / "d.jsonl").write_text(json.dumps({"text": "a document"}) + "\n")
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (tmp_path / "hf" / "model.safetensors").write_bytes(b"")
    argv = [a.format(**paths) for a in args]
    if argv[0] == "train":
        argv += ["--model", config_file, "--steps", "1", "--seq-len", "16", "--global-batch-size", "2"]
    code, _, err = cli(*argv)
    assert code != 0 and message.format(**paths) in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("args,message", [
    (["--lr", "nan"], "--lr must be a number >= 0, got nan"),
    (["--lr", "-1"], "--lr must be a number >= 0, got -1.0"),
    (["--lr", "1", "--min-lr", "5"], "--min-lr 5.0 must not exceed --lr 1.0"),
    (["--weight-decay", "nan"], "--weight-decay must be a number >= 0, got nan"),
    (["--grad-clip", "-1"], "--grad-clip must be a number >= 0, got -1.0 (0: no clipping)"),
    (["--timeout", "-5", "--tp", "2"], "--timeout must be a positive number of seconds, got -5.0"),
    (["--data", "{empty}"], "is not a readable .npy array"),
])
def test_bad_numbers_and_files_are_refused_before_any_rank_starts(cli, config_file, tmp_path, args, message):
    (tmp_path / "empty.npy").write_bytes(b"")  # a 0-byte file
    code, _, err = cli("train", "--model", config_file, "--steps", "1",
                       *[a.format(empty=tmp_path / "empty.npy") for a in args])
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err


def test_no_validation_windows_is_refused_rather_than_reported_as_a_loss_of_0(cli, config_file):
    code, _, err = cli("train", "--model", config_file, "--steps", "1", "--val-windows", "0")
    assert code != 0 and "--val-windows must be at least 1, got 0" in err and len(err.strip().splitlines()) == 1, err


def test_prompt_text_that_is_not_utf8_is_refused_before_the_run(cli, config_file):
    """Bytes that are not UTF-8 on the command line reach Python as lone surrogates (b'\\xff' -> '\\udcff'): the
    tokenizer raised a traceback on them, for --sample-prompt only after the whole run had trained."""
    code, _, err = cli("train", "--model", config_file, "--steps", "1", "--sample-tokens", "2",
                       "--sample-prompt", "ab\udcff")
    assert code != 0 and "--sample-prompt is not UTF-8 text (byte ff at character 2)" in err, err
    assert len(err.strip().splitlines()) == 1, err


def test_a_generate_prompt_that_is_not_utf8_is_refused_in_one_line(cli, tmp_path):
    from tensorpar.checkpoints.dense_checkpoint import write_dense_checkpoint
    from tensorpar.models import Transformer, get_config
    from tensorpar.models.state import full_state_dict

    cfg = get_config("tiny").replace(hidden_size=32, ffn_hidden_size=64, num_layers=1)
    write_dense_checkpoint(str(tmp_path / "ck"), cfg, full_state_dict(Transformer(cfg, None)))
    code, _, err = cli("generate", "--checkpoint", tmp_path / "ck", "--prompt", "fine", "--prompt", "\udcffab",
                       "--max-new-tokens", "1")
    assert code != 0 and "--prompt 1 is not UTF-8 text (byte ff at character 0)" in err, err
    assert len(err.strip().splitlines()) == 1, err
