"""Reading a Slurm step's environment (in-process, no Slurm needed): node lists, tasks per node, which processes are
tasks of an srun step, the torchrun variables they get; and where tensor-parallel groups fall across nodes. The
processes of a faked 2 x 2 step train in tests/test_multinode.py."""

import os
import shlex

import pytest
import torch

from tensorpar.distributed.mesh import check_gpus_per_process, group_ranks
from tensorpar.distributed.nodes import NodeLayout, tp_across_nodes
from tensorpar.distributed.slurm import expand_nodelist, in_slurm_step, slurm_world, task_threads, tasks_per_node
from tensorpar.errors import LayoutError, TensorparError

from harness import run_cli

ADOPTED = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "MASTER_ADDR",
           "MASTER_PORT", "OMP_NUM_THREADS")


def step(**overrides):
    """Task 3 of a 2 nodes x 2 tasks srun step: what srun puts in its environment (the parts tensorpar reads)."""
    env = dict(SLURM_JOB_ID="123456", SLURM_STEP_ID="0", SLURM_PROCID="3", SLURM_LOCALID="1", SLURM_NODEID="1",
               SLURM_NTASKS="4", SLURM_STEP_NUM_TASKS="4", SLURM_STEP_NUM_NODES="2", SLURM_STEP_TASKS_PER_NODE="2(x2)",
               SLURM_STEP_NODELIST="gpu[07-08]", SLURM_JOB_NODELIST="gpu[07-08]")
    env.update(overrides)
    return {k: v for k, v in env.items() if v is not None}


@pytest.mark.parametrize("text,hosts", [
    ("gpu[01-04,07],cpu3", ["gpu01", "gpu02", "gpu03", "gpu04", "gpu07", "cpu3"]),
    ("node1", ["node1"]),
    ("n[008-010]", ["n008", "n009", "n010"]),
    ("rack[1-2]-gpu[1,3]", ["rack1-gpu1", "rack1-gpu3", "rack2-gpu1", "rack2-gpu3"]),
    ("a,b[9-10],c", ["a", "b9", "b10", "c"]),
    ("127.0.0.[1-2]", ["127.0.0.1", "127.0.0.2"]),
])
def test_the_node_list_expands_as_scontrol_show_hostnames_does(text, hosts):
    assert expand_nodelist(text) == hosts


@pytest.mark.parametrize("text", ["gpu[01-", "gpu]1[", "gpu[a-b]", "gpu[3-1]", "a,,b", "", "gpu[[1]]"])
def test_a_node_list_that_cannot_be_read_is_refused_naming_it(text):
    with pytest.raises(TensorparError, match="cannot read the Slurm node list"):
        expand_nodelist(text)


def test_tasks_per_node_expands_repeats():
    assert tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    assert tasks_per_node("8") == [8]
    with pytest.raises(TensorparError, match="tasks per node '2x3'"):
        tasks_per_node("2x3")


@pytest.mark.parametrize("env,inside", [
    (step(), True),
    (step(SLURM_STEP_ID=None), False),  # an salloc shell, or the batch script: a job, no step
    (step(SLURM_STEP_ID="4294967294"), False),  # Slurm's batch step
    (step(SLURM_STEP_ID="interactive"), False),
    (step(RANK="3"), False),  # torchrun started by srun (one per node) sets its own
    (step(SLURM_STEP_NUM_TASKS="1", SLURM_NTASKS="1"), False),  # one process: tensorpar may start local ones
    (step(TENSORPAR_SLURM="0"), False),
])
def test_only_the_tasks_of_a_multi_task_srun_step_are_a_launched_world(env, inside):
    assert in_slurm_step(env) == inside
    assert (slurm_world(env) is not None) == inside


def test_a_task_gets_torchruns_variables():
    assert slurm_world(step()) == dict(RANK="3", WORLD_SIZE="4", LOCAL_RANK="1", LOCAL_WORLD_SIZE="2", GROUP_RANK="1",
                                       GROUP_WORLD_SIZE="2", MASTER_ADDR="gpu07", MASTER_PORT=str(15000 + 3456))
    # Two steps of one job side by side on the same first node: each its own port.
    assert slurm_world(step(SLURM_STEP_ID="1"))["MASTER_PORT"] == str(25000 + 3456)
    assert slurm_world(step(SLURM_STEP_ID="4"))["MASTER_PORT"] == str(55000 + 3456)
    # Set by the user (or the sbatch script): they win.
    given = slurm_world(step(MASTER_ADDR="10.0.0.1", MASTER_PORT="6000"))
    assert (given["MASTER_ADDR"], given["MASTER_PORT"]) == ("10.0.0.1", "6000")
    # The step's own node list, not the job's (a step may run on some of the job's nodes).
    assert slurm_world(step(SLURM_JOB_NODELIST="cpu1,gpu[07-08]"))["MASTER_ADDR"] == "gpu07"
    # Nodes running different numbers of tasks.
    uneven = slurm_world(step(SLURM_STEP_TASKS_PER_NODE="3,1", SLURM_PROCID="3", SLURM_LOCALID="0"))
    assert (uneven["LOCAL_WORLD_SIZE"], uneven["GROUP_WORLD_SIZE"]) == ("1", "2")
    # Without the step's tasks per node: --ntasks-per-node, else the tasks over the step's nodes.
    assert slurm_world(step(SLURM_STEP_TASKS_PER_NODE=None, SLURM_NTASKS_PER_NODE="2"))["LOCAL_WORLD_SIZE"] == "2"
    assert slurm_world(step(SLURM_STEP_TASKS_PER_NODE=None))["LOCAL_WORLD_SIZE"] == "2"
    with pytest.raises(TensorparError, match="inconsistent Slurm step: task 3 on node 1 of a step of 4 tasks"):
        slurm_world(step(SLURM_STEP_TASKS_PER_NODE="4"))


def test_a_task_computes_with_its_share_of_the_nodes_cores():
    """Unless OMP_NUM_THREADS says: --cpus-per-task's threads; a bound task's own cores; else (tasks unbound, each
    seeing every core) the node's cores split between its tasks, not every task on all of them."""
    shared = {**step(), "LOCAL_WORLD_SIZE": "2"}
    assert task_threads(shared, 64, 64) == 32
    assert task_threads({**shared, "SLURM_CPUS_PER_TASK": "8"}, 64, 64) == 8
    assert task_threads(shared, 16, 64) == 16  # srun --cpu-bind: 16 cores of its own
    assert task_threads({**shared, "LOCAL_WORLD_SIZE": "4"}, 2, 2) == 1


def test_a_slurm_task_reports_a_bad_layout_as_its_rank_and_node_before_any_rendezvous(cli, monkeypatch):
    for name in ADOPTED:  # adopted into os.environ by the command line: undone after the test
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    for name, value in step().items():
        monkeypatch.setenv(name, value)
    code, _, err = cli("train", "--dp", "3")
    assert code == 2 and err.startswith("tensorpar: error: [rank 3 on node 1 ("), err
    assert "x dp=3 = 3 processes, but the world has 4" in err


@pytest.mark.parametrize("tp,per_node,nodes", [(1, 2, 2), (2, 2, 2), (4, 2, 2), (2, 3, 2), (4, 8, 2), (8, 4, 4),
                                                (3, 6, 2), (4, 6, 2), (2, 4, 1)])
def test_the_warning_says_exactly_when_a_tp_group_spans_two_nodes(tp, per_node, nodes):
    layout = NodeLayout(0, nodes, per_node, "h")
    groups = group_ranks(tp, 1, per_node * nodes // tp)["tp"]  # the mesh's TP groups
    spans = any(len({layout.node_of(r) for r in g}) > 1 for g in groups)
    warning = tp_across_nodes(tp, layout)
    assert (warning is not None) == spans, (tp, per_node, nodes, warning)
    if warning:
        divisors = [d for d in range(1, per_node + 1) if per_node % d == 0]
        assert warning.startswith(f"warning: --tp {tp} with {per_node} processes per node")
        assert f"--tp {' or '.join(map(str, divisors))}," in warning


def test_a_rank_is_named_with_its_node_only_across_nodes():
    torchrun = dict(WORLD_SIZE="4", LOCAL_WORLD_SIZE="2", GROUP_RANK="1", GROUP_WORLD_SIZE="2")
    assert NodeLayout.from_env(torchrun).describe(3).startswith("rank 3 on node 1 (")
    assert NodeLayout.from_env(dict(WORLD_SIZE="2", LOCAL_WORLD_SIZE="2")).describe(1) == "rank 1"
    assert NodeLayout.from_env({}).describe(0) == "rank 0"


def test_one_gpu_per_task_under_srun_gpus_per_task_is_not_mistaken_for_a_shared_gpu(monkeypatch):
    """srun --gpus-per-task=1 shows each task only its own GPU: 2 tasks on a node, 1 GPU visible to each, is fine
    there, and still refused where the tasks would share it."""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    with pytest.raises(LayoutError, match="2 processes on this node but 1 GPU visible"):
        check_gpus_per_process(torch.device("cuda", 0), None, 4)
    monkeypatch.setenv("SLURM_GPUS_PER_TASK", "1")
    check_gpus_per_process(torch.device("cuda", 0), None, 4)


@pytest.mark.parametrize("script", ["train.sbatch", "train_torchrun.sbatch"])
def test_the_example_sbatch_scripts_give_tensorpar_flags_it_has(script):
    from tensorpar.cli import build_parser

    path = os.path.join(os.path.dirname(__file__), "..", "examples", "slurm", script)
    text = open(path).read().replace("\\\n", " ")
    command = next(ln for ln in text.splitlines() if not ln.startswith("#") and "tensorpar train" in ln)
    args = build_parser().parse_args(shlex.split(command.split("tensorpar", 1)[1]))
    assert args.command == "train" and "--signal=TERM@" in text


def run_cli_on_nodes(argv, per_node, nodes):
    """`tensorpar ARGV` on a pool rank that the environment places on node RANK // per_node of `nodes`."""
    node_env = dict(LOCAL_WORLD_SIZE=str(per_node), GROUP_WORLD_SIZE=str(nodes),
                    GROUP_RANK=str(int(os.environ["RANK"]) // per_node))
    saved = {k: os.environ.get(k) for k in node_env}
    os.environ.update(node_env)
    try:
        return run_cli(argv)
    finally:
        for k, v in saved.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)


def test_rank_0_alone_warns_when_tp_spans_nodes_and_the_run_goes_on(pools, config_file, tmp_path):
    argv = ["train", "--model", config_file, "--tp", "2", "--steps", "1", "--seq-len", "16", "--global-batch-size",
            "2", "--no-progress", "--val-every", "0", "--out-dir", tmp_path]
    results = pools(2).run(run_cli_on_nodes, argv, 1, 2)  # one process per node: the TP group spans both
    assert [code for code, _, _ in results] == [0, 0], results
    warned = [err.count("tensorpar: warning: --tp 2 with 1 processes per node (2 nodes)") for _, _, err in results]
    assert warned == [1, 0], results
