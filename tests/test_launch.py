"""The local launcher supervises its ranks as on a real cluster: a scheduler's SIGTERM stops every rank and saves
the last step, a dead or stopped rank ends the job with a line naming it, a crash-restart loop always continues
from `latest`, and no process is ever left behind."""

import json
import os
import random
import signal
import subprocess
import sys
import time
import uuid

import pytest

from tensorpar.checkpoints.sharded import read_meta
from tensorpar.training import TrainOptions

from harness import train

STEPS = 1000
COMMON = ["--seq-len", "16", "--global-batch-size", "4", "--no-progress", "--val-every", "0"]


TAG = "TENSORPAR_TEST_JOB"  # every process of a job started here carries it (the ranks inherit it)


def start(*args, python_file=False, **env):
    """`tensorpar ARGS` (with `python_file`, `python ARGS`) started as a scheduler would start it: in a session of
    its own, tagged with a job id."""
    env = dict(os.environ, OMP_NUM_THREADS="1", **{TAG: uuid.uuid4().hex}, **env)
    command = [sys.executable, *args] if python_file else [sys.executable, "-m", "tensorpar", *args]
    proc = subprocess.Popen(command, env=env, start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    proc.job = env[TAG]
    return proc


def job_pids(job: str) -> list[int]:
    """Every live process of the job (launcher and ranks, wherever they were re-parented)."""
    out = []
    for name in os.listdir("/proc"):
        if name.isdigit() and not gone(int(name)):
            try:
                with open(f"/proc/{name}/environ", "rb") as f:
                    if f"{TAG}={job}".encode() in f.read().split(b"\0"):
                        out.append(int(name))
            except OSError:
                pass
    return out


def rank_pids(launcher: int) -> dict[int, int]:
    """{rank: pid} of the launcher's worker processes (read from /proc: each names itself tensorpar-rN)."""
    out = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                comm, rest = f.read().split(" (", 1)[1].rsplit(")", 1)
            if int(rest.split()[1]) != launcher:
                continue
        except (OSError, ValueError, IndexError):
            continue
        if comm.startswith("tensorpar-r"):
            out[int(comm[len("tensorpar-r"):])] = int(name)
    return out


def gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"  # a zombie has finished
    except OSError:
        return True


def wait_for(predicate, timeout=90.0, what="condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def lines(path) -> list[dict]:
    try:
        return [json.loads(line) for line in open(path) if line.strip()]
    except OSError:
        return []


def wait_for_steps(proc, metrics, steps: int, timeout=90.0) -> None:
    """Until `proc`'s run has logged `steps` steps; an exit or a timeout first fails with the run's stderr (the job
    killed), not only "timed out"."""
    try:
        wait_for(lambda: len(lines(metrics)) >= steps or proc.poll() is not None, timeout, f"{steps} steps")
    except AssertionError:
        pass
    if len(lines(metrics)) < steps:
        ended = "the timeout" if proc.poll() is None else f"its exit ({proc.returncode})"
        for pid in job_pids(proc.job):
            os.kill(pid, signal.SIGKILL)
        _, err = proc.communicate(timeout=60)
        raise AssertionError(f"the run logged {len(lines(metrics))} of {steps} steps before {ended}:\n{err[-3000:]}")


def finish(proc, timeout=60.0):
    """(returncode, stderr, seconds) once the launcher has exited."""
    t0 = time.monotonic()
    _, err = proc.communicate(timeout=timeout)
    return proc.returncode, err, time.monotonic() - t0


def next_loss(config_file, stop_after, resume=None):
    options = TrainOptions(model=config_file, tp=2, steps=STEPS, seq_len=16, global_batch_size=4, val_every=0,
                           progress=False, device="cpu", stop_after=stop_after, resume=resume)
    return train(options)["history"][-1]["loss"]


def test_sigterm_to_the_launcher_stops_every_rank_and_saves_the_last_step(pools, config_file, tmp_path):
    save, metrics = tmp_path / "ck", tmp_path / "m.jsonl"
    proc = start("train", "--model", config_file, "--tp", "2", "--steps", str(STEPS), "--save", str(save),
                 "--metrics", str(metrics), "--out-dir", str(tmp_path / "run"), *COMMON)
    wait_for_steps(proc, metrics, 3)
    ranks = rank_pids(proc.pid)
    assert sorted(ranks) == [0, 1]
    proc.send_signal(signal.SIGTERM)
    code, err, seconds = finish(proc)
    assert code == 128 + signal.SIGTERM and seconds < 60, err
    assert all(gone(pid) for pid in ranks.values()) and not job_pids(proc.job)
    done = len(lines(metrics))
    assert f"stopped by SIGTERM after step {done} of {STEPS}" in err
    _, meta = read_meta(str(save))  # every shard present and intact
    assert meta["step"] == done
    # The saved step resumes to the loss the uninterrupted run has at the next step.
    expected = pools(2).run(next_loss, config_file, done + 1)[0]
    resumed = pools(2).run(next_loss, config_file, done + 1, str(save))[0]
    assert abs(resumed - expected) <= 1e-6 * expected


@pytest.mark.parametrize("when", ["start-up", "mid-training"])
def test_a_killed_rank_ends_the_job_with_a_line_naming_it(config_file, tmp_path, when):
    metrics = tmp_path / "m.jsonl"
    proc = start("train", "--model", config_file, "--tp", "2", "--steps", str(STEPS), "--metrics", str(metrics),
                 "--out-dir", str(tmp_path / "run"), *COMMON)
    ranks = wait_for(lambda: (r := rank_pids(proc.pid)) and len(r) == 2 and r, what="two ranks")
    if when == "mid-training":
        wait_for_steps(proc, metrics, 2)
    os.kill(ranks[1], signal.SIGKILL)
    code, err, seconds = finish(proc)
    assert code == 128 + signal.SIGKILL and seconds < 60, err
    assert f"tensorpar: error: rank 1 (pid {ranks[1]}) was killed by SIGKILL" in err
    assert all(gone(pid) for pid in ranks.values()) and not job_pids(proc.job)


def test_a_stopped_rank_is_caught_by_the_collective_timeout(config_file, tmp_path):
    metrics = tmp_path / "m.jsonl"
    proc = start("train", "--model", config_file, "--tp", "2", "--steps", str(STEPS), "--metrics", str(metrics),
                 "--out-dir", str(tmp_path / "run"), "--timeout", "4", *COMMON)
    wait_for_steps(proc, metrics, 2)
    ranks = rank_pids(proc.pid)
    os.kill(ranks[1], signal.SIGSTOP)
    code, err, seconds = finish(proc)
    assert code == 2 and seconds < 60, err
    failure = [ln for ln in err.splitlines() if ln.startswith("tensorpar: error: rank 0 (pid")]
    # Rank 0 waits in whichever collective rank 1 stopped before: a TP one, or the stop check on 'world'.
    assert len(failure) == 1 and "(timeout 4s)" in failure[0], err
    assert "on group 'tp'" in failure[0] or "on group 'world'" in failure[0], err
    assert "stopped rank 1 after rank 0 failed" in err
    assert all(gone(pid) for pid in ranks.values())
    # The live rank wrote its flight record when the collective failed; the stopped rank could not.
    from tensorpar.distributed.flight_diagnosis import diagnose, load_records

    records = load_records(str(tmp_path / "run"))
    assert sorted(records) == [0]
    group = "tp" if "on group 'tp'" in failure[0] else "world"
    said = diagnose(records)
    assert said.startswith("Rank 1 left no flight record"), said
    assert "Rank 0 (failed) waited in" in said and f"on group '{group}'" in said and "rank 1 left no record" in said


def test_a_crash_restart_loop_always_continues_from_latest(config_file, tmp_path):
    """The same `--resume ck --save ck` command, killed -9 at random moments (during start-up, mid-step, mid-save)
    five times, then left to finish: every restart continues from what `latest` names."""
    save, metrics = tmp_path / "ck", tmp_path / "run" / "metrics.jsonl"
    command = ["train", "--model", config_file, "--tp", "2", "--steps", "30", "--resume", str(save), "--save",
               str(save), "--save-every", "1", "--keep-last", "2", "--out-dir", str(tmp_path / "run"), *COMMON]
    rng = random.Random(17)
    latest, mid_training = 0, 0
    for attempt in range(6):
        if metrics.exists():
            metrics.unlink()
        proc = start(*command, TMPDIR=str(tmp_path))  # where a launcher killed -9 leaves its temporary folder
        if attempt < 5:
            if rng.random() < 0.3:
                time.sleep(rng.uniform(0.2, 2.5))  # most likely during start-up
            else:
                steps = rng.randint(1, 10)
                wait_for(lambda: len(lines(metrics)) >= steps or proc.poll() is not None, what=f"{steps} steps")
                time.sleep(rng.uniform(0.0, 0.05))
            os.kill(proc.pid, signal.SIGKILL)  # the whole job dies: its ranks follow their launcher
            code, err, _ = finish(proc)
            assert code == -signal.SIGKILL, (attempt, err)
            wait_for(lambda: not job_pids(proc.job), timeout=30, what="every process of the job to die")
        else:
            code, err, _ = finish(proc, timeout=180)
            assert code == 0, err
        said = "no checkpoint there yet; starting from step 0" if latest == 0 else f"at step {latest}"
        first = lines(metrics)[:1]
        mid_training += bool(first)
        assert said in err or not first, (attempt, latest, err)  # killed before it could say anything
        assert not first or first[0]["step"] == latest + 1, (attempt, latest, first)
        if (save / "latest").exists():
            latest = read_meta(str(save))[1]["step"]  # `latest` always names a complete, intact checkpoint
    assert latest == 30 and mid_training >= 3  # most kills landed in training, not only in start-up


def test_ctrl_c_at_the_terminal_reaches_the_ranks_once(config_file, tmp_path):
    """Ctrl-C sends SIGINT to the launcher (its ranks are in sessions of their own): one stop, saved."""
    save, metrics = tmp_path / "ck", tmp_path / "m.jsonl"
    proc = start("train", "--model", config_file, "--tp", "2", "--steps", str(STEPS), "--save", str(save),
                 "--metrics", str(metrics), "--out-dir", str(tmp_path / "run"), *COMMON)
    wait_for_steps(proc, metrics, 2)
    os.killpg(proc.pid, signal.SIGINT)  # the terminal signals the foreground process group
    code, err, _ = finish(proc)
    assert code == 128 + signal.SIGINT, err
    assert read_meta(str(save))[1]["step"] == len(lines(metrics))


def test_a_stop_sent_to_every_process_of_the_job_still_saves(config_file, tmp_path):
    """Slurm and `pkill` signal every process: each rank gets the stop twice (directly and forwarded by the
    launcher), which must not turn into "stop at once"."""
    save, metrics = tmp_path / "ck", tmp_path / "m.jsonl"
    proc = start("train", "--model", config_file, "--tp", "2", "--steps", str(STEPS), "--save", str(save),
                 "--metrics", str(metrics), "--out-dir", str(tmp_path / "run"), *COMMON)
    wait_for_steps(proc, metrics, 2)
    for pid in job_pids(proc.job):
        os.kill(pid, signal.SIGTERM)
    code, err, _ = finish(proc)
    assert code == 128 + signal.SIGTERM and "tensorpar: error" not in err, err
    assert read_meta(str(save))[1]["step"] == len(lines(metrics))
    assert not job_pids(proc.job)


def test_a_stop_sent_to_one_rank_stops_the_job_as_a_stop(config_file, tmp_path):
    save, metrics = tmp_path / "ck", tmp_path / "m.jsonl"
    proc = start("train", "--model", config_file, "--tp", "2", "--steps", str(STEPS), "--save", str(save),
                 "--metrics", str(metrics), "--out-dir", str(tmp_path / "run"), *COMMON)
    wait_for_steps(proc, metrics, 2)
    os.kill(rank_pids(proc.pid)[1], signal.SIGTERM)
    code, err, _ = finish(proc)
    assert code == 128 + signal.SIGTERM and "tensorpar: error" not in err, err
    assert f"stopped by SIGTERM after step {len(lines(metrics))}" in err
    assert read_meta(str(save))[1]["step"] == len(lines(metrics))
    assert not job_pids(proc.job)



ZYGOTE_SCRIPT = """
import os, sys, time
from tensorpar.distributed import zygote
zygote.fork_at_entry()
if "RANK" in os.environ:  # a rank, forked from the zygote: one write (three ranks share the pipe)
    os.write(1, f"rank {os.environ['RANK']} child {os.getppid() == int(os.environ['LAUNCHER'])} "
                f"session {os.getsid(0) == os.getpid()} torch {'torch' in sys.modules}\\n".encode())
    sys.exit(3)
if sys.argv[1] == "discard":
    zygote.discard()
    print("left", flush=True)
    time.sleep(30)  # killed by the test once it has looked for the zygote
pids = zygote.take().start([dict(os.environ, RANK=str(r), LAUNCHER=str(os.getpid())) for r in range(3)])
print("codes", [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in pids], flush=True)
"""


def test_the_zygote_forks_ranks_that_are_the_launchers_children_and_leaves_nothing_behind(tmp_path):
    """The launcher's ranks are forked from a copy of it made after its imports (tensorpar.distributed.zygote):
    each gets its own environment and session and is the launcher's child; a zygote let go leaves no process."""
    script = tmp_path / "launcher.py"
    script.write_text(ZYGOTE_SCRIPT)
    out = subprocess.run([sys.executable, str(script), "start"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    lines = sorted(out.stdout.splitlines())
    # torch came imported with the zygote
    assert lines == ["codes [3, 3, 3]"] + [f"rank {r} child True session True torch True" for r in range(3)]
    proc = start(str(script), "discard", python_file=True)
    wait_for(lambda: proc.stdout.readline().strip() == "left", what="the zygote let go")
    assert job_pids(proc.job) == [proc.pid]  # the zygote has exited and been reaped
    proc.kill()
    finish(proc)


def test_ranks_share_the_cores_the_launcher_may_use(monkeypatch):
    """A Slurm task or a cgroup gives the launcher 6 of a node's 64 cores: 2 ranks get 3 threads each, not 32."""
    from tensorpar.distributed import launch

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(6)), raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    assert launch.usable_cpus() == 6
    assert launch.threads_per_process(2) == 3 and launch.threads_per_process(8) == 1
    assert launch.threads_per_process(2, 112) == 56


def test_one_process_stuck_in_a_step_ends_a_grace_period_after_sigterm():
    """Without a launcher to kill it, a process whose step outlasts the grace period after the first SIGTERM ends
    itself then, naming the signal (a one-process run at seq-len 8,192 took 62 s to stop; a stuck one, never)."""
    script = ("import os, signal, time\n"
              "from tensorpar.training.stop import GracefulStop\n"
              "with GracefulStop(escalate=True, grace_s=1.0):\n"
              "    os.kill(os.getpid(), signal.SIGTERM)\n"
              "    time.sleep(60)  # the step that does not end\n")
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 128 + signal.SIGTERM and time.monotonic() - started < 30, done
    assert "still running 1 s after SIGTERM (--grace-period): stopped without finishing the step" in done.stderr
