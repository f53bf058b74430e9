"""--async-save: the files are those a blocking save writes, a resume continues exactly, `latest` moves only once every
rank has written its files, a second save (and a stop) waits for the pending one, a failed write fails every rank."""

import os
import signal
import time

import pytest
import torch
from safetensors.torch import load_file
from tensorpar.checkpoints import async_save, sharded
from tensorpar.checkpoints.sharded import read_meta
from tensorpar.errors import TensorparError
from tensorpar.training import TrainOptions

from harness import mesh, train

BASE = dict(steps=20, seed=11, global_batch_size=8, micro_batch_size=None, seq_len=16, lr=3e-3, warmup_steps=1,
            val_every=0, val_fraction=0.0, progress=False, metrics=None, out_dir=None, device="cpu")
ZERO3 = dict(dp=2, zero=3)  # the parameters are whole only inside the optimizer's gathered(): copied there


def run(config_file, **overrides):
    summary = train(TrainOptions(model=config_file, **{**BASE, **overrides}))
    return {"losses": [r["loss"] for r in summary["history"]], "state": summary.get("state"),
            "async_save": summary.get("async_save")}


def assert_same_tensors(checkpoint, reference):
    """The two checkpoints' files hold the same tensors, bit for bit (their bytes may differ: safetensors orders the
    header's entries as it likes)."""
    (step_dir, meta), (ref_dir, ref_meta) = read_meta(checkpoint), read_meta(reference)
    assert meta["files"].keys() == ref_meta["files"].keys()
    for name in meta["files"]:
        ours, ref = load_file(os.path.join(step_dir, name)), load_file(os.path.join(ref_dir, name))
        assert ours.keys() == ref.keys()
        for key, t in ref.items():
            assert ours[key].dtype == t.dtype and torch.equal(ours[key].flatten().view(torch.uint8),
                                                              t.flatten().view(torch.uint8)), f"{name}: {key}"


def test_async_saves_resume_exactly_and_write_the_files_a_blocking_save_writes(pools, config_file, tmp_path):
    straight = pools(1).run(run, config_file, stop_after=5, return_state=True)[0]
    blocking, background = str(tmp_path / "blocking"), str(tmp_path / "async")
    pools(2).run(run, config_file, stop_after=3, save=blocking, **ZERO3)
    # A save after every step, each written while the next step trains.
    first = pools(2).run(run, config_file, stop_after=3, save=background, save_every=1, async_save=True, **ZERO3)[0]
    for loss, ref in zip(first["losses"], straight["losses"][:3], strict=True):
        assert abs(loss - ref) <= 1e-6 * ref
    assert [d for d in sorted(os.listdir(background)) if d.startswith("step-")] == [f"step-00000{i}" for i in (1, 2, 3)]
    assert_same_tensors(background, blocking)
    # DP rank 0 writes the one file (and stages its payload: the host copy); DP rank 1 writes and stages nothing.
    (written,) = [f["bytes"] for f in read_meta(background)[1]["files"].values()]
    assert first["async_save"]["staged_rank"] == 0
    assert 0.98 * written <= first["async_save"]["staged_mib"] * 2**20 <= written
    resumed = pools(2).run(run, config_file, resume=background, stop_after=5, save=background, async_save=True,
                           return_state=True, **ZERO3)[0]
    for loss, ref in zip(resumed["losses"], straight["losses"][3:], strict=True):
        assert abs(loss - ref) <= 1e-6 * ref
    for name, ref in straight["state"].items():
        assert (resumed["state"][name] - ref).norm() <= 1e-4 * ref.norm(), name
    assert read_meta(background)[1]["step"] == 5  # the end of the run waited for its last save and committed it


class StopAt:
    """A stop agreed by every rank before 0-based step `step` (the command line's GracefulStop, without the
    signal)."""

    def __init__(self, step):
        self.calls, self.step = 0, step

    def agreed(self, group, device):
        self.calls += 1
        return signal.SIGTERM if self.calls > self.step else None


def slow_second_rank_then_stop(config_file, save):
    """tp 2, a save every 2 steps; rank 1 writes step 2's file slowly; a stop before step 4. Every rank's log of
    (event, step, time) and the summary."""
    from tensorpar.training import run_training, validate

    rank, log = int(os.environ["RANK"]), []
    write, commit = sharded._write_shard, async_save.commit_save

    def logged_write(tmp, file_name, params, moments, step, position):
        log.append(("write-start", step, time.monotonic()))
        if rank == 1 and step == 2:
            time.sleep(0.8)
        info = write(tmp, file_name, params, moments, step, position)
        log.append(("written", step, time.monotonic()))
        return info

    def logged_commit(root, step, *args):
        final = commit(root, step, *args)
        log.append(("committed", step, time.monotonic()))
        return final

    sharded._write_shard, async_save.commit_save = logged_write, logged_commit
    try:
        run = validate(TrainOptions(model=config_file, **{**BASE, "tp": 2, "save": save, "save_every": 2,
                                                          "async_save": True}))
        summary = run_training(run, stop=StopAt(3), mesh=mesh(2))
    finally:
        sharded._write_shard, async_save.commit_save = write, commit
    return log, {k: summary[k] for k in ("async_save", "stop_checkpoint", "stopped_at_step")}


def test_latest_moves_once_every_rank_has_written_and_saves_and_stops_wait_for_the_pending_one(pools, config_file,
                                                                                           tmp_path):
    save = str(tmp_path / "ck")
    (log0, summary), (log1, _) = pools(2).run(slow_second_rank_then_stop, config_file, save)
    at = {(rank, event, step): t for rank, log in enumerate((log0, log1)) for event, step, t in log}
    # `latest` moved to step 2 only after rank 1, the slow one, had written its file ...
    assert at[0, "committed", 2] > at[1, "written", 2] > at[0, "written", 2]
    # ... while training went on: the stop came before step 4, and the stop's save of step 3 waited for step 2's
    # commit before it began writing, on every rank.
    saves = summary["async_save"]["saves"]
    assert [(s["step"], s["committed_after_step"]) for s in saves] == [(2, 3), (3, 3)]
    assert saves[0]["waited_s"] > 0
    for rank in (0, 1):
        assert at[rank, "write-start", 3] > at[0, "committed", 2] and at[rank, "write-start", 3] > at[1, "committed", 2]
    # The stop's checkpoint is committed before the run returns, and `latest` names it.
    assert summary["stopped_at_step"] == 3 and summary["stop_checkpoint"] == os.path.join(save, "step-000003")
    step_dir, meta = read_meta(save)
    assert step_dir == summary["stop_checkpoint"] and meta["step"] == 3
    # Rank 1 wrote step 2's file while step 3 updated the weights in place: it holds step 2's, as a blocking save's.
    blocking = str(tmp_path / "blocking")
    pools(2).run(run, config_file, tp=2, stop_after=2, save=blocking)
    assert_same_tensors(os.path.join(save, "step-000002"), blocking)


def failing_write(config_file, save):
    """tp 2, saves at steps 1 and 2; rank 1 cannot write step 2's file (a full disk). What each rank raised."""
    rank, write = int(os.environ["RANK"]), sharded._write_shard

    def full_disk(tmp, file_name, params, moments, step, position):
        if rank == 1 and step == 2:
            raise OSError(28, "No space left on device")
        return write(tmp, file_name, params, moments, step, position)

    sharded._write_shard = full_disk
    try:
        train(TrainOptions(model=config_file, **{**BASE, "tp": 2, "steps": 4, "save": save, "save_every": 1,
                                                 "async_save": True}))
    except TensorparError as e:
        return str(e)
    finally:
        sharded._write_shard = write
    return None


def test_a_failed_background_write_fails_every_rank_naming_the_rank_and_the_file(pools, config_file, tmp_path):
    save = str(tmp_path / "ck")
    errors = pools(2).run(failing_write, config_file, save)
    path = os.path.join(save, ".tmp-step-000002", "model-tp01-pp00.safetensors")
    for error in errors:
        assert error is not None and "the save of step 2 failed" in error, error
        assert f"rank 1: writing '{path}' failed: OSError: [Errno 28] No space left on device" in error, error
    assert read_meta(save)[1]["step"] == 1  # `latest` still names the previous checkpoint


def failing_adapter_write(config_file, save, async_save):
    """LoRA at tp 2, saves at steps 1 and 2; the disk fills up as rank 0 writes step 2's PEFT adapter (after every
    shard is written: safetensors reports the I/O error as its own SafetensorError). What each rank raised."""
    from safetensors import SafetensorError
    from tensorpar.checkpoints import peft_adapter

    write = peft_adapter.save_file

    def full_disk(tensors, path, metadata=None):
        if "step-000002" in path:
            raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
        return write(tensors, path, metadata=metadata)

    peft_adapter.save_file = full_disk
    try:
        train(TrainOptions(model=config_file, **{**BASE, "tp": 2, "steps": 3, "save": save, "save_every": 1,
                                                 "async_save": async_save, "lora_rank": 4}))
    except TensorparError as e:
        return str(e)
    finally:
        peft_adapter.save_file = write
    return None


@pytest.mark.parametrize("async_save", [False, True])
def test_a_failed_adapter_write_fails_every_rank_in_one_line(pools, config_file, tmp_path, async_save):
    save = str(tmp_path / "ck")
    errors = pools(2).run(failing_adapter_write, config_file, save, async_save)
    for error in errors:
        assert error is not None and "the save of step 2 failed (rank 0: " in error, error
        assert "No space left on device" in error, error
    assert read_meta(save)[1]["step"] == 1  # `latest` still names the previous checkpoint


def failing_folder(config_file, save):
    """tp 2, saves at steps 1 and 2; rank 0 cannot make step 2's temporary folder. What each rank raised."""
    makedirs = os.makedirs

    def refused(path, *args, **kwargs):
        if str(path).endswith(".tmp-step-000002"):
            raise PermissionError(13, "Permission denied", path)
        return makedirs(path, *args, **kwargs)

    sharded.os.makedirs = refused
    try:
        train(TrainOptions(model=config_file, **{**BASE, "tp": 2, "steps": 3, "save": save, "save_every": 1}))
    except TensorparError as e:
        return str(e)
    finally:
        sharded.os.makedirs = makedirs
    return None


def test_a_save_folder_rank_0_cannot_make_fails_every_rank_in_one_line(pools, config_file, tmp_path):
    save = str(tmp_path / "ck")
    errors = pools(2).run(failing_folder, config_file, save)
    for error in errors:
        assert error is not None and "the save of step 2 failed (rank 0 cannot make '" in error, error
        assert "Permission denied" in error, error
    assert read_meta(save)[1]["step"] == 1


def test_async_save_without_save_is_refused(cli, config_file):
    code, _, err = cli("train", "--model", config_file, "--steps", "2", "--async-save", "--no-progress")
    assert code == 2 and "--async-save needs --save DIR" in err, err
