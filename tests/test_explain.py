"""`tensorpar explain`: the blog's reduce-scatter example, every collective, and one-line errors."""

import os
import re
import subprocess
import sys

import pytest

from tensorpar.distributed import collective_simulation as S
from tensorpar.errors import TensorparError


def _tensorpar(*args):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "tensorpar", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)


def test_explain_reduce_scatter_prints_the_blog_example():
    proc = _tensorpar("explain", "reduce-scatter", "--ranks", "4")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    final = [re.match(r"\s*rank (\d): \[(.*)\]", ln) for ln in lines[-4:]]
    assert all(final), lines[-5:]
    assert [(int(f.group(1)), f.group(2)) for f in final] == [(0, "28"), (1, "32"), (2, "36"), (3, "40")]
    assert lines[-5].startswith("result")
    out = proc.stdout
    assert "ring" in out and "N-1 = 3 steps" in out
    assert "rank 0: [1 | 2 | 3 | 4]" in out and "rank 3: [13 | 14 | 15 | 16]" in out
    assert "rank 0 -> rank 1: chunk 3 [4]" in out  # the first message of the ring
    assert [ln for ln in lines if ln.startswith("step ")] == [f"step {i} of 3 (reduce-scatter):" for i in (1, 2, 3)]


def test_explain_bad_input_is_one_line(cli):
    code, out, err = cli("explain", "all-to-all")
    assert code == 2, (out, err)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("tensorpar: error:") and "all-to-all" in lines[0], err


@pytest.mark.parametrize(
    "args,needle",
    [
        (["reduce", "--ranks", "1"], "at least 2"),
        (["reduce", "--ranks", "x"], "whole number"),
        (["reduce-scatter", "--algorithm", "tree"], "no 'tree' algorithm"),
        (["gather", "--root", "4"], "--root 4"),
        (["all-gather", "--root", "1"], "no root"),
        (["all-reduce", "--values", "1,2;3,x"], "not a number"),
    ],
)
def test_explain_errors_in_process(capsys, args, needle):
    from tensorpar.cli import main

    assert main(["explain", *args]) == 2
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("tensorpar: error:") and needle in lines[0], err


@pytest.mark.parametrize("collective", list(S.COLLECTIVES) + ["all_reduce --algorithm tree"])
def test_explain_every_collective(capsys, collective):
    from tensorpar.cli import main

    name, *rest = collective.split()
    assert main(["explain", name, "--ranks", "3", *rest]) == 0
    out = capsys.readouterr().out
    norm = S.normalize(name)
    algorithm = rest[-1] if rest else S.ALGORITHMS[norm][0]
    values = [[r * 3 + i + 1 for i in range(3)] for r in range(3)]
    outputs, trace = S.simulate(norm, values, algorithm)
    assert sum(ln.startswith("step ") for ln in out.splitlines()) == len(trace)
    tail = out.strip().splitlines()[-3:]
    for r, (line, want) in enumerate(zip(tail, outputs)):
        shown = "-" if want is None else "[" + ", ".join(str(v) for v in want) + "]"
        assert line.strip().startswith(f"rank {r}: {shown}"), (line, want)
    if (norm, algorithm) == ("all-reduce", "ring"):
        assert "2(N-1) = 4 steps" in out and "every rank 4 messages, 4 values = 16 bytes" in out


def test_explain_values_and_ranks():
    from tensorpar.commands.explain import explain

    lines = explain("all-reduce", values=[[1, 2], [3, 4], [5, 6]])
    assert lines[-3:] == ["  rank 0: [9, 12]", "  rank 1: [9, 12]", "  rank 2: [9, 12]"]
    with pytest.raises(TensorparError, match="--ranks 4 but --values gives 3"):
        explain("all-reduce", ranks=4, values=[[1], [2], [3]])
