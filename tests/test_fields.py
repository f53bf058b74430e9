"""Options written once: the flags, the --config TOML file and the resolved configuration come from one dataclass."""

import argparse
import dataclasses

import pytest

from tensorpar.cli import ArgumentParser, build_parser, main
from tensorpar.config.choices import DTYPES, PIPELINE_SCHEDULES, RECOMPUTE_MODES, TRAIN_DTYPES
from tensorpar.config.fields import (
    add_options,
    changed_options,
    check_choices,
    cli_specs,
    options_from_args,
    to_dict,
    to_toml,
)
from tensorpar.config.options import (
    EvalOptions,
    GenerateOptions,
    PlanOptions,
    TrainOptions,
)
from tensorpar.errors import TensorparError


def parse(cls, *argv, config_file=True):
    parser = ArgumentParser(prog="t")
    add_options(parser, cls, config_file=config_file)
    return options_from_args(cls, parser.parse_args(list(argv)), "t")


def test_flags_follow_the_fields():
    o = parse(TrainOptions, "--tp", "2", "--global-batch-size", "8", "--sequence-parallel", "--no-progress",
              "--min-lr", "1e-4", "--recompute", "full")
    assert (o.tp, o.global_batch_size, o.sequence_parallel, o.progress, o.min_lr, o.recompute) == \
        (2, 8, True, False, 1e-4, "full")
    assert parse(TrainOptions) == TrainOptions()
    flags = {s.flag for s in cli_specs(TrainOptions)}
    # the command-line contract of DESIGN.md section 3
    assert {"--model", "--tp", "--pp", "--dp", "--sequence-parallel", "--steps", "--seed", "--global-batch-size",
            "--micro-batch-size", "--seq-len", "--dropout", "--dtype", "--data", "--metrics", "--save", "--save-every",
            "--resume"} <= flags
    assert "--return-state" not in flags  # Python-only


def test_choices_come_from_one_place():
    specs = {s.name: s for s in cli_specs(TrainOptions)}
    assert specs["dtype"].meta["choices"] == TRAIN_DTYPES
    assert {s.name: s for s in cli_specs(EvalOptions)}["dtype"].meta["choices"] == DTYPES
    assert specs["recompute"].meta["choices"] == RECOMPUTE_MODES
    assert specs["schedule"].meta["choices"] == PIPELINE_SCHEDULES
    assert {s.name: s for s in cli_specs(PlanOptions)}["recompute"].meta["choices"] == RECOMPUTE_MODES
    with pytest.raises(TensorparError, match="--dtype must be one of fp32, bf16, fp16, fp8; got 'fp4'"):
        check_choices(TrainOptions(dtype="fp4"))


def test_toml_round_trip_and_flags_override(tmp_path):
    original = TrainOptions(tp=2, dp=1, model="tiny-gpt2", lr=1e-3, min_lr=1e-5, dropout=0.1, data="a b\"c.txt",
                            progress=False, sample_prompt="Il était", seq_len=64)
    path = tmp_path / "run.toml"
    path.write_text(to_toml(original, "a header\nof two lines"))
    assert path.read_text().startswith("# a header\n# of two lines\n")
    assert parse(TrainOptions, "--config", str(path)) == original
    overridden = parse(TrainOptions, "--config", str(path), "--tp", "1", "--lr", "0.01")
    assert overridden == dataclasses.replace(original, tp=1, lr=0.01)
    plan = PlanOptions(model="llama-8b", gpus=16, gpu="h100", zero=[0, 1], recompute=["full"], flash_attention=False)
    path.write_text(to_toml(plan))
    assert parse(PlanOptions, "--config", str(path)) == plan


def test_config_file_keys_may_be_written_like_flags(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('global-batch-size = 4\nseq_len = 32\nlr = 1\nsequence-parallel = true\n')
    o = parse(TrainOptions, "--config", str(path))
    assert (o.global_batch_size, o.seq_len, o.lr, o.sequence_parallel) == (4, 32, 1.0, True)
    assert isinstance(o.lr, float)


def test_comma_separated_options_may_be_toml_arrays(tmp_path):
    """--pipeline-layers 1,2,1 as a config file writes it naturally, and as plan --json and meta.json spell it."""
    path = tmp_path / "run.toml"
    path.write_text('pipeline_layers = [1, 2, 1]\nprofile-ranks = [0, 2]\nlora_targets = ["q", "v"]\n')
    o = parse(TrainOptions, "--config", str(path))
    assert (o.pipeline_layers, o.profile_ranks, o.lora_targets) == ("1,2,1", "0,2", "q,v")
    path.write_text('pipeline_layers = [1.5, 2]\n')
    with pytest.raises(TensorparError, match=r"pipeline_layers = \[1.5, 2\] should be a comma-separated string"):
        parse(TrainOptions, "--config", str(path))


@pytest.mark.parametrize("text,needle", [
    ("global_batch = 4\n", "unknown option 'global_batch' for tensorpar t; did you mean 'global_batch_size'?"),
    ("tp = \"two\"\n", "tp = \"two\" should be an integer"),
    ("tp = true\n", "tp = true should be an integer"),
    ("lr = \"fast\"\n", "lr = \"fast\" should be a number"),
    ("dtype = \"fp4\"\n", "dtype = \"fp4\" is not one of: fp32, bf16, fp16, fp8"),
    ("sequence_parallel = 1\n", "sequence_parallel = 1 should be true or false"),
    ("[train]\ntp = 2\n", "[train] is a table"),
    ("tp = \n", "is not valid TOML"),
    (b"\xff\xfe\x00\x01", "is not valid TOML: 'utf-8' codec can't decode byte 0xff"),
    ("global-batch-size = 8\nglobal_batch_size = 16\n", "'global_batch_size' sets global_batch_size a second time"),
])
def test_bad_config_files_are_refused_naming_the_key(tmp_path, text, needle):
    path = tmp_path / "run.toml"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(TensorparError) as e:
        parse(TrainOptions, "--config", str(path))
    assert needle in str(e.value) and str(path) in str(e.value)


def test_missing_config_file_and_required_options(tmp_path):
    with pytest.raises(TensorparError, match="config file '.*nope.toml' does not exist"):
        parse(TrainOptions, "--config", str(tmp_path / "nope.toml"))
    with pytest.raises(TensorparError, match="tensorpar t needs --checkpoint, --seq-len"):
        parse(EvalOptions)
    path = tmp_path / "eval.toml"
    path.write_text('checkpoint = "ck"\nseq_len = 8\n')
    assert parse(EvalOptions, "--config", str(path)).seq_len == 8


def test_repeatable_and_list_options():
    o = parse(GenerateOptions, "--checkpoint", "c", "--max-new-tokens", "2", "--prompt", "a", "--prompt", "b")
    assert o.prompt == ["a", "b"]
    p = parse(PlanOptions, "--zero", "1", "2", "--recompute", "none", "full")
    assert p.zero == [1, 2] and p.recompute == ["none", "full"]
    assert PlanOptions().zero == [0, 1, 2, 3] and PlanOptions().zero is not PlanOptions().zero


def test_changed_options_names_what_differs():
    old = to_dict(TrainOptions(tp=2, lr=1e-3))
    assert changed_options(old, TrainOptions(tp=1, lr=1e-3, resume="ck"), ignore=("resume",)) == ["tp 2 -> 1"]


def test_usage_errors_are_one_line(capsys):
    assert main(["train", "--tp", "x"]) == 2
    assert main(["train", "--dtype", "fp4"]) == 2
    assert main(["bogus"]) == 2
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(lines) == 3 and all(ln.startswith("tensorpar: error:") for ln in lines), lines
    assert "argument --tp: takes a whole number, got 'x'" in lines[0] and "tensorpar train --help" in lines[0]
    assert "invalid choice: 'fp4'" in lines[1]


def test_every_command_parses_its_help():
    parser = build_parser()
    for command in ("train", "eval", "generate", "plan", "demo", "explain", "convert"):
        with pytest.raises(SystemExit) as e:
            parser.parse_args([command, "--help"])
        assert e.value.code == 0


def test_a_field_without_option_metadata_is_a_programming_error():
    @dataclasses.dataclass
    class Bad:
        x: int = 1

    with pytest.raises(TypeError, match="not declared with option"):
        add_options(argparse.ArgumentParser(), Bad)


def test_options_built_in_python_with_a_wrong_type_are_refused_naming_the_field():
    """TrainOptions(steps="10") reached validate's `steps < 1` as a TypeError; seq_len=16.0 trained on as a float.
    A pathlib path for a string option failed deep inside (`'PosixPath' object has no attribute 'endswith'`): it is
    taken as its str, as the flag would give it."""
    import pathlib

    from tensorpar.config.fields import check_choices
    from tensorpar.config.options import EvalOptions, TrainOptions

    for options, needle in ((TrainOptions(steps="10"), r"steps \(--steps\) = '10' should be an integer"),
                            (TrainOptions(lr="1e-3"), r"lr \(--lr\) = '1e-3' should be a number"),
                            (TrainOptions(seq_len=16.0), r"seq_len \(--seq-len\) = 16.0 should be an integer"),
                            (TrainOptions(tp=True), r"tp \(--tp\) = True should be an integer"),
                            (TrainOptions(sequence_parallel="no"), "should be true or false"),
                            (EvalOptions(checkpoint="c", data=3), r"data \(--data\) = 3 should be a string"),
                            (TrainOptions(tp=pathlib.Path("2")),
                             r"tp \(--tp\) = PosixPath\('2'\) should be an integer")):
        with pytest.raises(TensorparError, match=needle):
            check_choices(options)
    paths = TrainOptions(data=pathlib.Path("x.npy"), model=pathlib.Path("m.json"))
    check_choices(paths)
    assert (paths.data, paths.model) == ("x.npy", "m.json") and type(paths.data) is str
    check_choices(TrainOptions(lr=1, data="x.npy", pipeline_layers=[2, 2], pp=2))  # a list for a comma-separated one
