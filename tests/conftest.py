import json
import os

import pytest

# The suite is the CPU/gloo suite, whatever the machine: on a GPU machine its many-process checks would
# otherwise put several ranks on one GPU. The checks that need a GPU are tests/test_cuda.py, run with
# TENSORPAR_TEST_CUDA=1 (they skip without it). Set before torch first looks for CUDA, and inherited by
# every process the tests start.
if os.environ.get("TENSORPAR_TEST_CUDA") != "1":
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
# The suite runs more processes than there are cores (two pytest workers, each with its ranks): OpenMP threads that
# spin while they wait for work take the cores the other processes need. Waiting passively, the whole suite took
# 366 s on 2 cores instead of 500 to 570 (the same tests, the same CPU work otherwise). Read when torch loads.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from tensorpar.models import get_config

from harness import Pools

# 8 layers so that pp=4 with 2 virtual stages splits evenly; 2 KV heads (replicated at tp=4).
TINY8 = get_config("tiny").replace(hidden_size=64, num_layers=8, ffn_hidden_size=176)


@pytest.fixture(scope="session")
def pools():
    """pools(n): a pool of n gloo processes, started on first use and shared by the session."""
    p = Pools()
    yield p
    p.close()


@pytest.fixture(scope="session")
def config_file(tmp_path_factory):
    """TINY8 saved as a config .json, as `tensorpar train --model` takes it."""
    path = tmp_path_factory.mktemp("cfg") / "tiny8.json"
    path.write_text(json.dumps(TINY8.to_dict()))
    return str(path)


@pytest.fixture
def cli(capsys, monkeypatch):
    """cli(*args): `tensorpar ARGS` run in this process, as (exit status, stdout, stderr).

    For bad input, which every command refuses in the launching process before any rank exists, and for commands
    that run in one process (convert, explain, plan): starting a rank fails the test. Each command has one
    subprocess smoke test (`python -m tensorpar` from a shell) in its own test file."""
    import tensorpar.distributed.launch as launch
    from tensorpar.cli import main

    class NoRanks:
        def __init__(self, nprocs, argv, *_, **__):
            raise AssertionError(f"`tensorpar {' '.join(argv)}` started {nprocs} ranks: bad input must be refused "
                                 f"before any rank starts")

    monkeypatch.setattr(launch, "Supervisor", NoRanks)

    def run(*args):
        capsys.readouterr()
        code = main([str(a) for a in args])
        out, err = capsys.readouterr()
        return code, out, err

    return run
