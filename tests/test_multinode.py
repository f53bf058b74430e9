"""Several nodes on this host: two torchrun agents (c10d rendezvous on the loopback address), and the four tasks of
a faked 2 x 2 Slurm step. Each trains the losses of the one-node run at the same layout and only global rank 0 writes
the shared files; a killed agent ends the other node's ranks within a minute, naming rank and node, and the
checkpoint the two nodes wrote resumes to the one-node run's losses; SIGTERM to every task (Slurm's time limit)
saves."""

import os
import re
import signal
import subprocess
import sys
import uuid

import pytest

from tensorpar.checkpoints.sharded import read_meta
from tensorpar.distributed.launch import free_port
from tensorpar.training import TrainOptions

from harness import run_cli, train
from test_launch import TAG, finish, job_pids, lines, wait_for

TORCHRUN = os.path.join(os.path.dirname(sys.executable), "torchrun")
STEPS = 1000  # the runs are stopped (or killed) long before
# A constant learning rate: the restart may stop at another --steps and still follow the same run.
COMMON = ["--tp", "2", "--dp", "2", "--seq-len", "16", "--global-batch-size", "4", "--lr", "0.003", "--min-lr",
          "0.003", "--warmup-steps", "0", "--no-progress", "--val-every", "0", "--timeout", "10"]


def one_node_losses(config_file, steps):
    options = TrainOptions(model=config_file, tp=2, dp=2, steps=steps, seq_len=16, global_batch_size=4, lr=3e-3,
                           min_lr=3e-3, warmup_steps=0, val_every=0, progress=False, device="cpu")
    return {r["step"]: r["loss"] for r in train(options)["history"]}


def assert_same_losses(records, reference):
    """One record per step (none written twice, by two nodes), each the one-node run's loss."""
    steps = [r["step"] for r in records]
    assert steps and steps == list(range(steps[0], steps[0] + len(steps))), steps
    for r in records:
        assert abs(r["loss"] - reference[r["step"]]) <= 1e-6 * reference[r["step"]], (r, reference[r["step"]])


def start_job(commands: list[tuple[list[str], dict]]) -> tuple[list[subprocess.Popen], str]:
    """Processes started as a cluster would start them, each in a session of its own, all tagged with one job id."""
    job = uuid.uuid4().hex
    procs = []
    for cmd, extra in commands:
        env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
        env.update(OMP_NUM_THREADS="1", **{TAG: job}, **extra)
        procs.append(subprocess.Popen(cmd, env=env, start_new_session=True, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    return procs, job


def two_agents(*args):
    """Two torchrun agents of 2 processes each, meeting at a c10d rendezvous on 127.0.0.1 (their node ranks are
    assigned by the rendezvous)."""
    endpoint = f"127.0.0.1:{free_port()}"
    agent = [TORCHRUN, "--nnodes", "2", "--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint",
             endpoint, "--rdzv-id", "test", "--max-restarts", "0", "-m", "tensorpar", "train", *args, *COMMON]
    return start_job([(agent, {}), (agent, {})])


def kill_all(job: str) -> None:
    for pid in job_pids(job):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.mark.skipif(not os.path.exists(TORCHRUN), reason="torchrun not installed")
def test_two_torchrun_agents_train_as_one_node_and_a_killed_agent_ends_the_other(pools, config_file, tmp_path):
    save, out = tmp_path / "ck", tmp_path / "run"
    # Both agents are given the same folders, as on a cluster's shared file system.
    agents, job = two_agents("--model", config_file, "--save", str(save), "--save-every", "1", "--steps", str(STEPS),
                             "--out-dir", str(out), "--metrics", str(tmp_path / "first.jsonl"))
    try:
        wait_for(lambda: len(lines(tmp_path / "first.jsonl")) >= 2 or any(a.poll() is not None for a in agents),
                 what="two steps")
        assert all(a.poll() is None for a in agents), [a.communicate()[1] for a in agents if a.poll() is not None]
        os.killpg(agents[1].pid, signal.SIGKILL)  # the agent alone: torchrun starts its workers in their own sessions
        code, err, seconds = finish(agents[0], timeout=60)
        assert code != 0 and seconds < 60, err
        # The other node's ranks fail their next collective with the killed node's ranks, and say so.
        said = [ln for ln in err.splitlines() if ln.startswith("tensorpar: error: [rank ")]
        assert said and all(" on nodes [" in ln for ln in said), err
        # torchrun numbers the ranks node by node (2 per node), as the messages and the mesh's TP groups assume.
        named = [re.match(r"tensorpar: error: \[rank (\d+) on node (\d+) ", ln) for ln in said]
        assert all(m and int(m[1]) // 2 == int(m[2]) for m in named), said
        wait_for(lambda: not job_pids(job), timeout=30, what="every process of the job to die")
    finally:
        kill_all(job)
    first = lines(tmp_path / "first.jsonl")
    # The checkpoint the two nodes wrote (each model-parallel shard once, whichever node held it) resumes exactly.
    latest = read_meta(str(save))[1]["step"]
    code, _, err = pools(4).run(run_cli, ["train", "--model", config_file, "--resume", save, "--steps", latest + 2,
                                          "--metrics", tmp_path / "second.jsonl", "--out-dir", out, *COMMON])[0]
    assert code == 0 and f"at step {latest}" in err, err
    second = lines(tmp_path / "second.jsonl")
    assert [r["step"] for r in second] == [latest + 1, latest + 2]
    reference = pools(4).run(one_node_losses, config_file, max(latest + 2, len(first)))[0]
    assert_same_losses(first, reference)
    assert_same_losses(second, reference)


def test_a_faked_slurm_step_of_2_nodes_x_2_tasks_trains_as_one_node_and_saves_on_sigterm(pools, config_file,
                                                                                          tmp_path):
    """Four plain `python -m tensorpar train` processes with the variables srun gives its tasks (no RANK), the node
    list in Slurm's compressed form; SIGTERM to every task, as Slurm's time limit sends it, saves the last step."""
    save, out = tmp_path / "ck", tmp_path / "run"
    command = [sys.executable, "-m", "tensorpar", "train", "--model", config_file, "--save", str(save), "--steps",
               str(STEPS), "--out-dir", str(out), *COMMON]
    step = dict(SLURM_JOB_ID="4242", SLURM_STEP_ID="0", SLURM_NTASKS="4", SLURM_STEP_NUM_TASKS="4",
                SLURM_STEP_NUM_NODES="2", SLURM_STEP_TASKS_PER_NODE="2(x2)", SLURM_STEP_NODELIST="127.0.0.[1-2]",
                SLURM_JOB_NODELIST="127.0.0.[1-2]", MASTER_PORT=str(free_port()))
    tasks, job = start_job([(command, dict(step, SLURM_PROCID=str(t), SLURM_LOCALID=str(t % 2),
                                           SLURM_NODEID=str(t // 2))) for t in range(4)])
    try:
        wait_for(lambda: len(lines(out / "metrics.jsonl")) >= 2 or any(t.poll() is not None for t in tasks),
                 what="two steps")
        for t in tasks:
            t.send_signal(signal.SIGTERM)
        results = [finish(t, timeout=60) for t in tasks]
    finally:
        kill_all(job)
    assert [code for code, _, _ in results] == [128 + signal.SIGTERM] * 4, [err for _, err, _ in results]
    records = lines(out / "metrics.jsonl")
    assert f"stopped by SIGTERM after step {len(records)} of {STEPS}" in results[0][1]
    assert read_meta(str(save))[1]["step"] == len(records)
    assert_same_losses(records, pools(4).run(one_node_losses, config_file, len(records))[0])


def test_a_world_without_a_usable_rendezvous_fails_in_one_line(config_file, tmp_path):
    """RANK and WORLD_SIZE set by hand without MASTER_ADDR / MASTER_PORT, or rank 0's port held by another process:
    the rank says so in one line (no traceback) and exits 2 at once."""
    import socket

    cmd = [sys.executable, "-m", "tensorpar", "train", "--model", config_file, "--out-dir", str(tmp_path),
           "--steps", "1", *COMMON[4:]]
    base = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "MASTER_"))}
    base.update(OMP_NUM_THREADS="1", RANK="0", WORLD_SIZE="2", LOCAL_RANK="0")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        for extra, says in (({}, "needs MASTER_ADDR and MASTER_PORT"),
                            ({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port},
                             f"cannot host the rendezvous at MASTER_ADDR 127.0.0.1 MASTER_PORT {port}")):
            proc = subprocess.run(cmd, env={**base, **extra}, capture_output=True, text=True, timeout=120)
            assert proc.returncode == 2, proc.stderr
            assert "Traceback" not in proc.stderr and says in proc.stderr.strip().splitlines()[-1], proc.stderr
