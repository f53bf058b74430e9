import json
import os

import pytest

# The suite is the CPU/gloo suite, whatever the machine: on a GPU machine its many-process checks would
# otherwise put several ranks on one GPU. The checks that need a GPU are tests/test_cuda.py, run with
# TENSORPAR_TEST_CUDA=1 (they skip without it). Set before torch first looks for CUDA, and inherited by
# every process the tests start.
if os.environ.get("TENSORPAR_TEST_CUDA") != "1":
    os.environ["CUDA_VISIBLE_DEVICES"] = ""

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
