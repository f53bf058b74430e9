"""The command line from a plain shell and under torchrun: it works, and bad layouts fail fast and clearly."""

import os
import shutil
import subprocess
import sys
import time

import pytest

import tensorpar.commands.explain as explain
from tensorpar.cli import main


def tensorpar(*args, launcher=None, timeout=120, **env):
    env = dict(os.environ, OMP_NUM_THREADS="1", **env)
    cmd = (launcher or [sys.executable, "-m", "tensorpar"]) + list(args)
    t0 = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    return proc, time.monotonic() - t0


def test_demo_runs_across_local_processes():
    """The demo command's smoke test from a plain shell (2 ranks started by tensorpar), with sequence parallelism;
    without it under torchrun below."""
    proc, _ = tensorpar("demo", "--tp", "2", "--sequence-parallel")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "rank 0 (tp rank 0/2) holds" in out and "rank 1 (tp rank 1/2) holds" in out
    assert "OK: the 2-way model computes what the single-device model computes" in out
    assert "reduce_scatter" in out


def _assert_refused(result, needle):
    """An in-process `cli` result: status 2, one line naming the problem (no rank was started: see `cli`)."""
    code, out, err = result
    assert code == 2, (code, out, err)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("tensorpar: error:") and needle in lines[0], err


def test_layout_that_does_not_fit_the_world_fails_at_once(cli):
    _assert_refused(cli("demo", "--tp", "3", "--nproc", "4"), "tp=3 x pp=1 does not fit world size 4")


def test_a_toy_model_the_tp_size_cannot_split_is_refused_before_any_rank_starts(cli):
    # The layers would refuse it too, on every rank, one line each: the launching process says it once.
    _assert_refused(cli("demo", "--tp", "3"), "the toy MLP's width (--ffn) = 32 is not divisible by the "
                                              "tensor-parallel size 3; TP sizes that divide it: [1, 2, 4, 8, 16, 32]")
    _assert_refused(cli("demo", "--tp", "2", "--ffn", "9"), "= 9 is not divisible by the tensor-parallel size 2")
    _assert_refused(cli("demo", "--tp", "2", "--sequence-parallel", "--seq-len", "3"),
                    "sequence length 3 is not divisible by the tensor-parallel size 2")


def test_ranks_that_are_not_forked_run_the_demo_from_a_plain_shell():
    # Its ranks are new processes, not forked from the launcher's zygote (tests/test_launch.py has those).
    proc, _ = tensorpar("demo", "--tp", "2", TENSORPAR_FORK_RANKS="0")
    assert proc.returncode == 0, proc.stderr
    assert "OK: the 2-way model computes what the single-device model computes" in proc.stdout


@pytest.mark.skipif(shutil.which("torchrun") is None and not os.path.exists(os.path.join(os.path.dirname(sys.executable), "torchrun")), reason="torchrun not installed")
def test_under_torchrun_every_rank_reports_the_bad_layout(tmp_path):
    """Rank 0 starts 2 s late, as on a loaded machine: torchrun stops the job as soon as rank 1 exits, so rank 1
    must wait for rank 0 to refuse too (tensorpar.distributed.early_exit; every command refuses through cli.main)."""
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    torchrun = torchrun if os.path.exists(torchrun) else shutil.which("torchrun")
    late_rank0 = tmp_path / "late_rank0.py"
    late_rank0.write_text("import os, sys, time\nif os.environ['LOCAL_RANK'] == '0':\n    time.sleep(2)\n"
                          "from tensorpar.cli import main\nsys.argv[0] = 'tensorpar'\nsys.exit(main())\n")
    proc, elapsed = tensorpar(
        "demo", "--tp", "3", launcher=[torchrun, "--nproc-per-node", "2", "--standalone", str(late_rank0)]
    )
    assert proc.returncode != 0
    ours = [ln for ln in proc.stderr.splitlines() if ln.startswith("tensorpar: error:")]
    assert sorted(ln.split("]")[0] for ln in ours) == [f"tensorpar: error: [rank {r}" for r in range(2)], proc.stderr
    assert all("tp=3 x pp=1 does not fit world size 2" in ln for ln in ours)
    assert elapsed < 60


def test_under_torchrun_the_demo_uses_the_launchers_processes():
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    if not os.path.exists(torchrun):
        pytest.skip("torchrun not installed")
    proc, _ = tensorpar("demo", "--tp", "2", launcher=[torchrun, "--nproc-per-node", "2", "--standalone", "-m", "tensorpar"])
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "TP=2 over 2 process(es)" in out and "rank 0 (tp rank 0/2) holds" in out and "rank 1 (tp rank 1/2) holds" in out
    assert "OK: the 2-way model computes what the single-device model computes" in out
    assert "reduce_scatter" not in out  # no sequence parallelism: all-reduces only


@pytest.mark.parametrize(
    "args,needle",
    [
        (["train", "--tp", "7"], "num_heads = 4 is not divisible by the tensor-parallel size 7"),
        (["train", "--model", "gpt5"], "unknown model preset 'gpt5'; known presets: tiny"),
        (["train", "--data", "/no/such/file.txt"], "data file '/no/such/file.txt' does not exist"),
        (["train", "--tp", "2", "--sequence-parallel", "--seq-len", "33"], "sequence length 33 is not divisible"),
        (["train", "--pp", "3"], "4 layers cannot be split evenly into pp=3 x virtual stages=1"),
        (["train", "--pp", "3"], "or give uneven stages with --pipeline-layers 1,2,1"),
        (["train", "--pp", "2", "--pipeline-layers", "1,2"], "--pipeline-layers 1,2 sums to 3 layers but the model "
                                                             "has 4"),
        (["train", "--pp", "2", "--schedule", "interleaved", "--virtual-stages", "2", "--global-batch-size", "3",
          "--micro-batch-size", "1"], "multiple of the pipeline-parallel size 2"),
        (["train", "--dp", "2", "--global-batch-size", "6", "--micro-batch-size", "4"],
         "global batch size 6 does not divide into dp 2 x micro-batch size 4"),
        (["train", "--dp", "3", "--global-batch-size", "16"],
         "global batch size 16 is not a multiple of dp 3; the global batch must be a multiple of dp 3: nearby "
         "multiples [15, 18]"),
        (["train", "--global-batch-size", "0"], "global batch size must be positive, got 0"),
        (["train", "--micro-batch-size", "0"], "--micro-batch-size must be at least 1 (or left out: the global "
                                               "batch / dp, 1 with --pp > 1), got 0"),
        (["eval", "--checkpoint", "/no/such/dir", "--seq-len", "8"], "checkpoint '/no/such/dir' does not exist"),
        (["train", "--cp", "4", "--seq-len", "100"], "sequence length 100 is not divisible by 2 x cp = 8"),
        (["train", "--cp", "2", "--tp", "4", "--sequence-parallel", "--seq-len", "12"],
         "sequence length 12 / cp 2 = 6 is not divisible by the tensor-parallel size"),
    ],
    ids=["heads", "preset", "data", "sp-seq", "pp-layers", "pp-layers-proposal", "pipeline-layers-sum", "interleaved-microbatches", "dp-batch", "dp-batch-default-micro", "batch-zero", "micro-batch-zero", "checkpoint",
         "cp-seq", "cp-sp-seq"],
)
def test_bad_input_fails_at_once_with_one_line(cli, args, needle):
    _assert_refused(cli(*args), needle)


def test_a_model_config_file_that_is_not_json_is_refused_in_one_line(cli, tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"hidden_size": 64,\n')
    for args in (["train", "--model", str(bad), "--steps", "1"],
                 ["plan", "--model", str(bad), "--gpus", "8", "--gpu", "h100-80gb", "--seq-len", "512",
                  "--global-batch-size", "8"]):
        _assert_refused(cli(*args), f"model config file '{bad}' is unreadable or not JSON")


PLAN = ["plan", "--model", "llama-8b", "--gpus", "8", "--gpu", "h100", "--seq-len", "4096", "--global-batch-size", "64"]


@pytest.mark.parametrize("args,needle", [
    (["eval", "--checkpoint", "/no/such/dir", "--seq-len", "8", "--batch-size", "0"],
     "--batch-size must be at least 1 window, got 0"),
    (["eval", "--checkpoint", "/no/such/dir", "--seq-len", "8", "--batch-size", "-1"],  # was a loss of 0.0
     "--batch-size must be at least 1 window, got -1"),
    (["train", "--dtype", "fp16", "--loss-scale", "-5"], "--loss-scale must be a positive number, got -5.0"),
    (["train", "--dtype", "fp16", "--loss-scale", "nan"], "--loss-scale must be a positive number, got nan"),
    (["train", "--dtype", "fp16", "--loss-scale-window", "0"], "--loss-scale-window must be at least 1 step, got 0"),
    ([*PLAN, "--peak-tflops", "0"], "--peak-tflops must be a positive number of TFLOP/s, got 0.0"),  # was a traceback
    ([*PLAN, "--peak-tflops", "-5"], "--peak-tflops must be a positive number of TFLOP/s, got -5.0"),  # negative MFU
    ([*PLAN, "--memory-gib", "0"], "--memory-gib must be a positive number of GiB, got 0.0"),
    ([*PLAN, "--optimizer-offload", "--host-memory-gib", "-1"], "--host-memory-gib must be a positive number of GiB"),
], ids=["eval-batch-zero", "eval-batch-negative", "loss-scale-negative", "loss-scale-nan", "loss-scale-window-zero",
        "peak-zero", "peak-negative", "memory-zero", "host-memory-negative"])
def test_counts_and_scales_that_cannot_work_are_refused(cli, args, needle):
    _assert_refused(cli(*args), needle)


def test_a_reader_that_stops_early_ends_the_command_quietly(monkeypatch):
    """`tensorpar plan --json | head`: stdout's reader is gone; the command ends with status 141 (as SIGPIPE would
    end it) and no traceback, and only then (a BrokenPipeError with stdout still open is a bug, re-raised)."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    with open(write_end, "w", buffering=1) as stdout:  # line-buffered: the first line meets the closed pipe
        monkeypatch.setattr(sys, "stdout", stdout)
        assert main(["explain", "reduce-scatter", "--ranks", "4"]) == 141
        monkeypatch.undo()


def test_a_broken_pipe_elsewhere_is_not_hidden(monkeypatch, capsys):
    def broken(*_):
        raise BrokenPipeError("a peer's socket")
    monkeypatch.setattr(explain, "run", broken)
    with pytest.raises(BrokenPipeError):
        main(["explain", "reduce-scatter", "--ranks", "4"])


def test_an_unknown_flag_points_at_its_commands_help(cli):
    """argparse reports unrecognized arguments from the top-level parser: the hint named 'tensorpar --help', which
    lists the commands, not the command's flags."""
    _assert_refused(cli("convert", "ckpt", "hf-folder", "--device", "cuda"),
                    "unrecognized arguments: --device cuda (see 'tensorpar convert --help')")
    _assert_refused(cli("train", "--steps", "1", "--foo"),
                    "unrecognized arguments: --foo (see 'tensorpar train --help')")
