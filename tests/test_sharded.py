"""Sharded checkpoints: exact resume, resharding across layouts, rotation, atomic saves, integrity checks."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

from tensorpar.checkpoints.sharded import dense_model_state, load_checkpoint, read_meta, rotate
from tensorpar.checkpoints.sources import load_config
from tensorpar.models import ModelConfig, Transformer
from tensorpar.errors import TensorparError
from tensorpar.training import TrainOptions

from harness import train

BASE = dict(steps=20, seed=11, global_batch_size=8, micro_batch_size=None, seq_len=16, lr=3e-3, warmup_steps=1,
            val_every=0, val_fraction=0.0, progress=False, metrics=None, out_dir=None, device="cpu")
SAVED_AT, RESUMED_TO = 3, 5  # saved after step 3 of a 20-step schedule, resumed for 2 steps


def run(config_file, **overrides):
    summary = train(TrainOptions(model=config_file, **{**BASE, **overrides}))
    return {"history": [(r["step"], r["loss"], r["grad_norm"]) for r in summary["history"]],
            "state": summary.get("state")}


@pytest.fixture(scope="module")
def straight(pools, config_file):
    """The first steps of a 20-step schedule in one go, one process, and the weights after them."""
    return pools(1).run(run, config_file, stop_after=RESUMED_TO, return_state=True)[0]


def _layout(tp, pp, dp, **extra):
    """A layout; pipelines run 4 micro-batches of 2 per DP rank, the others one micro-batch per DP rank."""
    return dict(tp=tp, pp=pp, dp=dp, **({"micro_batch_size": 8 // dp // 4} if pp > 1 else {}), **extra)


@pytest.mark.parametrize(
    "before,after",
    [
        (_layout(1, 1, 1), _layout(1, 1, 1)),
        (_layout(2, 1, 1), _layout(1, 1, 1)),
        (_layout(1, 1, 1), _layout(4, 1, 1)),
        (_layout(2, 1, 1), _layout(1, 1, 2, zero=1)),
        (_layout(2, 2, 1, schedule="1f1b"), _layout(1, 1, 4, zero=1)),
        (_layout(1, 2, 2, zero=1, schedule="afab"), _layout(2, 2, 1, schedule="interleaved", virtual_stages=2)),
        (_layout(1, 1, 1, cp=4), _layout(2, 1, 1)),
        (_layout(2, 1, 1), _layout(1, 1, 2, cp=2, zero=1)),
        (_layout(1, 1, 2, zero=3), _layout(1, 1, 2, zero=3)),
        (_layout(1, 1, 4, zero=3), _layout(2, 1, 2, zero=1)),
        (_layout(2, 1, 2, zero=1), _layout(1, 2, 2, zero=3)),
        (_layout(1, 2, 2, pipeline_layers="2,6"), _layout(1, 2, 2)),
        (_layout(1, 2, 1, pipeline_layers="6,2"), _layout(2, 2, 1, pipeline_layers="1,7")),
    ],
    ids=["same", "tp2-to-tp1", "tp1-to-tp4", "tp2-to-dp2-zero1", "tp2pp2-to-dp4-zero1", "pp2dp2zero1-to-tp2pp2v2",
         "cp4-to-tp2-cp1", "tp2-to-cp2dp2-zero1", "dp2zero3-same", "dp4zero3-to-tp2dp2zero1",
         "tp2dp2zero1-to-pp2dp2zero3", "pp2-2.6-to-pp2-even", "pp2-6.2-to-tp2pp2-1.7"],
)
def test_resume_continues_exactly_at_any_layout(pools, config_file, straight, tmp_path, before, after):
    save = str(tmp_path / "ckpt")
    world = lambda lay: lay["tp"] * lay["pp"] * lay["dp"] * lay.get("cp", 1)  # noqa: E731
    # Saved at step 3 of a 20-step schedule and resumed for 2 steps: the steps after a resume show any state the
    # checkpoint lost (moments, step count, schedule position, sample order), and so do the weights after them.
    first = pools(world(before)).run(run, config_file, stop_after=SAVED_AT, save=save, **before)[0]["history"]
    for (_, loss, _), (_, loss_ref, _) in zip(first, straight["history"][:SAVED_AT], strict=True):
        assert abs(loss - loss_ref) <= 1e-4 * loss_ref
    resaved = str(tmp_path / "resaved")
    resumed = pools(world(after)).run(run, config_file, resume=os.path.join(save, f"step-{SAVED_AT:06d}"),
                                      stop_after=RESUMED_TO, return_state=True, save=resaved, **after)[0]
    assert [s for s, _, _ in resumed["history"]] == list(range(SAVED_AT + 1, RESUMED_TO + 1))
    # The checkpoint this layout writes reads back as the weights it trained, bit for bit (at tp 4 each KV head's
    # two copies: the reader takes one file per distinct shard)
    _, written = dense_model_state(os.path.join(resaved, f"step-{RESUMED_TO:06d}"))
    assert written.keys() == resumed["state"].keys()
    assert all(torch.equal(written[name], value) for name, value in resumed["state"].items())
    # Against one process: within float reassociation at any layout. Resumed at the layout it was saved at, the run
    # is the straight run of that layout: the same losses and grad norms to 1e-6, the same weights to 1e-6.
    references = [(straight, 1e-4, 1e-4)]
    if before == after:
        here = straight if world(after) == 1 else pools(world(after)).run(
            run, config_file, stop_after=RESUMED_TO, return_state=True, **after)[0]
        references.append((here, 1e-6, 1e-6))
    for reference, tol, weight_tol in references:
        for (step, loss, gn), (_, loss_ref, gn_ref) in zip(resumed["history"], reference["history"][SAVED_AT:],
                                                            strict=True):
            assert abs(loss - loss_ref) <= tol * loss_ref, f"step {step}: loss {loss} vs {loss_ref}"
            assert abs(gn - gn_ref) <= tol * gn_ref, f"step {step}: grad norm {gn} vs {gn_ref}"
        assert resumed["state"].keys() == reference["state"].keys()
        for name, ref in reference["state"].items():
            err = (resumed["state"][name] - ref).norm() / ref.norm()
            assert err <= weight_tol, f"weights after step {RESUMED_TO}: {name} differs by {err:.1e}"


def test_rotation_keeps_the_last_n_and_latest_points_to_the_newest(pools, config_file, tmp_path):
    save = str(tmp_path / "ckpt")
    pools(2).run(run, config_file, tp=2, steps=3, save=save, save_every=1, keep_last=2)
    assert sorted(d for d in os.listdir(save) if d.startswith("step-")) == ["step-000002", "step-000003"]
    assert open(os.path.join(save, "latest")).read().strip() == "step-000003"
    _, meta = read_meta(save)
    assert meta["step"] == 3 and meta["layout"]["tp"] == 2 and len(meta["files"]) == 2


def test_a_save_never_overwrites_a_complete_checkpoint(pools, config_file, tmp_path):
    save = str(tmp_path / "ckpt")
    pools(1).run(run, config_file, steps=2, save=save, save_every=1, keep_last=0)
    sha = read_meta(save)[1]["files"]
    # Resumed from step 1 with another learning rate, it reaches step 2 again: the first step 2 is kept intact
    # beside it (renamed, not overwritten), and `latest` names the new one, which this run continues from.
    pools(1).run(run, config_file, steps=2, save=save, lr=1e-2, resume=os.path.join(save, "step-000001"))
    assert read_meta(os.path.join(save, "superseded-step-000002-1"))[1]["files"] == sha
    step_dir, meta = read_meta(save)
    assert step_dir == os.path.join(save, "step-000002") and meta["files"] != sha and meta["train"]["lr"] == 1e-2


def test_a_kill_between_a_resaves_two_renames_leaves_latest_loadable(saved):
    """A re-save of the step `latest` names moves the old folder aside, then renames the new into place: killed
    between the two, `latest` resolves to the folder moved aside (the highest K, the one it last named)."""
    save, step_dir, _ = saved
    os.makedirs(os.path.join(save, "superseded-step-000002-1"))  # an older re-save's, already superseded
    os.replace(step_dir, os.path.join(save, "superseded-step-000002-2"))
    assert read_meta(save)[0] == os.path.join(save, "superseded-step-000002-2")


def _tree(folder):
    return {os.path.join(d, f): os.stat(os.path.join(d, f)).st_mtime_ns for d, _, fs in os.walk(folder) for f in fs}


def test_a_fresh_run_into_a_folder_holding_checkpoints_is_refused_and_the_folder_untouched(pools, config_file,
                                                                                            tmp_path, cli):
    save = str(tmp_path / "ckpt")
    pools(1).run(run, config_file, steps=2, save=save)
    before = _tree(save)
    code, _, err = cli("train", "--model", config_file, "--steps", "4", "--save", save, "--no-progress",
                       "--out-dir", tmp_path / "run")
    assert code == 2, err
    assert f"--save folder '{save}' already holds checkpoints of a run (newest: '{save}/step-000002')" in err
    assert f"--resume {save}" in err
    assert _tree(save) == before


def _fake_checkpoint(root, step, run_id):
    os.makedirs(os.path.join(root, f"step-{step:06d}"))
    with open(os.path.join(root, f"step-{step:06d}", "meta.json"), "w") as f:
        json.dump({"format": "tensorpar-checkpoint", "step": step, "run_id": run_id}, f)


def test_rotation_spares_latest_other_runs_and_later_branches(tmp_path):
    """A run resumed from step 3 of a folder that also holds its own steps 4-5 (a branch it abandoned) and another
    run's step 9 rotates only its own steps up to the current one, never the one `latest` names."""
    root = str(tmp_path)
    for step in (1, 2, 3, 4, 5):
        _fake_checkpoint(root, step, "run-a")
    _fake_checkpoint(root, 9, "run-b")
    with open(os.path.join(root, "latest"), "w") as f:
        f.write("step-000003\n")
    rotate(root, keep_last=1, run_id="run-a", step=3)
    assert sorted(os.listdir(root)) == ["latest", "step-000003", "step-000004", "step-000005", "step-000009"]
    rotate(root, keep_last=0, run_id="run-a", step=3)  # 0: keep everything
    assert len(os.listdir(root)) == 5


# A rank of the job below: tensorpar's command line, with its second save stopped for a minute once its shard is on
# disk (the test kills the job there).
SLOW_SECOND_SAVE = """
import sys, time
import tensorpar.checkpoints.sharded as sharded
from tensorpar.cli import main

write = sharded._write_shard

def write_then_hang(tmp, file_name, params, moments, step, position):
    info = write(tmp, file_name, params, moments, step, position)
    if step == 4:
        time.sleep(60)
    return info

sharded._write_shard = write_then_hang
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize("mode", [[], ["--async-save"]], ids=["blocking", "async"])
def test_a_run_killed_during_a_save_leaves_the_previous_checkpoint_loadable(config_file, tmp_path, mode):
    """Two ranks, started as torchrun starts them, SIGKILLed together while the second save is half written (with
    --async-save: by the writer thread, the training thread waiting for it at the end of the run)."""
    from tensorpar.distributed.launch import free_port
    from tensorpar.models import ModelConfig, Transformer, load_full_state_dict

    save, script = str(tmp_path / "ckpt"), tmp_path / "slow_second_save.py"
    script.write_text(SLOW_SECOND_SAVE)
    cmd = [sys.executable, str(script), "train", "--model", config_file, "--tp", "2", "--steps", "4", "--save", save,
           "--save-every", "2", "--seq-len", "16", "--global-batch-size", "4", "--no-progress", "--val-every", "0",
           "--out-dir", str(tmp_path / "run"), *mode]
    port = str(free_port())
    ranks = [subprocess.Popen(cmd, env=dict(os.environ, OMP_NUM_THREADS="1", RANK=str(r), LOCAL_RANK=str(r),
                                            WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=port),
                              start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
             for r in range(2)]
    tmp_second = os.path.join(save, ".tmp-step-000004")
    try:
        deadline = time.monotonic() + 120
        while not (os.path.isdir(tmp_second) and os.listdir(tmp_second)) and time.monotonic() < deadline:
            for proc in ranks:
                assert proc.poll() is None, proc.stderr.read().decode()
            time.sleep(0.05)
        assert os.path.isdir(tmp_second), "the second save never started"
    finally:
        for proc in ranks:
            os.killpg(proc.pid, signal.SIGKILL)  # mid-save
            proc.wait()
    assert not os.path.exists(os.path.join(save, "step-000004"))
    step_dir, meta = read_meta(save)  # every shard present and intact
    assert meta["step"] == 2 and step_dir.endswith("step-000002")
    meta, state = dense_model_state(save)  # and loadable: the model it holds computes a loss
    model = Transformer(ModelConfig(**meta["model"]), None, init=False)
    load_full_state_dict(model, state)
    ids = torch.arange(17).remainder(model.cfg.vocab_size)[None]
    assert 0 < model(ids[:, :-1], ids[:, 1:]).item() < 10


@pytest.fixture(scope="module")
def saved_once(pools, config_file, tmp_path_factory):
    """A tp 2 run's checkpoint of step 2, and what each rank flushed to disk while saving it (`synced_save`)."""
    save = str(tmp_path_factory.mktemp("saved") / "ckpt")
    return save, pools(2).run(synced_save, config_file, save)


@pytest.fixture
def saved(saved_once, tmp_path):
    """A copy of `saved_once`'s checkpoint for a test to damage."""
    save = str(tmp_path / "ckpt")
    shutil.copytree(saved_once[0], save)
    step_dir = os.path.join(save, "step-000002")
    return save, step_dir, os.path.join(step_dir, "model-tp01-pp00.safetensors")


def synced_save(config_file, save):
    """A tp 2 run of 2 steps saved at its end, recording what each rank flushed to disk (os.fsync's files, by name;
    none where /proc cannot name them)."""
    fsync, synced = os.fsync, []

    def record(fd):
        if os.path.isdir("/proc/self/fd"):
            synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        return fsync(fd)

    os.fsync = record
    try:
        run(config_file, tp=2, steps=2, save=save)
    finally:
        os.fsync = fsync
    return synced


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="reads the names of open files from /proc")
def test_a_save_is_on_disk_before_latest_names_it(saved_once):
    """Every shard, meta.json and the folders' entries are flushed before `latest` moves (a power cut after it
    leaves a whole checkpoint), and `latest` itself after it."""
    save, synced = saved_once
    tmp = os.path.join(save, ".tmp-step-000002")
    assert os.path.join(tmp, "model-tp01-pp00.safetensors") in synced[1]
    assert synced[0] == [os.path.join(tmp, "model-tp00-pp00.safetensors"), os.path.join(tmp, "meta.json.part"), tmp,
                         save, os.path.join(save, "latest.part"), save]


def test_missing_shard_is_refused_naming_the_file(saved):
    save, _, shard = saved
    os.remove(shard)
    for check in (read_meta, load_config):
        with pytest.raises(TensorparError, match="model-tp01-pp00.safetensors' is missing"):
            check(save)


def test_truncated_shard_is_refused(saved):
    save, _, shard = saved
    with open(shard, "r+b") as f:
        f.truncate(os.path.getsize(shard) // 2)
    # read_meta on the ranks; load_config, which the commands run before starting any, checks the sizes too
    for check in (read_meta, load_config):
        with pytest.raises(TensorparError, match="model-tp01-pp00.safetensors' has .* bytes, expected .*truncated"):
            check(save)


def test_corrupted_or_foreign_shard_is_refused(saved, pools, config_file, tmp_path):
    save, _, shard = saved
    data = bytearray(open(shard, "rb").read())
    data[-5] ^= 0xFF  # same size, one byte flipped
    open(shard, "wb").write(bytes(data))
    with pytest.raises(TensorparError, match="model-tp01-pp00.safetensors' is corrupted"):
        read_meta(save)


def _edit_meta(step_dir, edit):
    path = os.path.join(step_dir, "meta.json")
    meta = json.load(open(path))
    edit(meta)
    json.dump(meta, open(path, "w"))


@pytest.mark.parametrize("edit,error", [
    (lambda m: m["layout"].update(tp=3), "lists no shard file of tp rank 2, pp rank 0 .*layout: tp 3"),
    (lambda m: m["files"].pop("model-tp01-pp00.safetensors"), "lists no shard file of tp rank 1, pp rank 0"),
    (lambda m: m["model"].update(num_heads=8), "tensor 'layers.0.attn.k_proj.weight' rebuilt from the shards gives "
                                               r"this rank \(32, 64\), the model's shard is \(16, 64\)"),
    (lambda m: m.update(version=2), "is of checkpoint format version 2; this tensorpar reads version 1"),
    (lambda m: m.pop("files"), "meta.json' is damaged: its field 'files' is missing or of the wrong type"),
    (lambda m: m.update(tensors=[]), "its field 'tensors' is missing or of the wrong type"),
    (lambda m: m["files"]["model-tp01-pp00.safetensors"].pop("sha256"),
     "its field 'files.model-tp01-pp00.safetensors.sha256' is missing"),
], ids=["layout-tp", "files-entry", "model-heads", "version", "no-files", "tensors-list", "no-sha256"])
def test_a_meta_json_that_does_not_match_its_shards_is_refused(saved, edit, error):
    """meta.json edited by hand (or copied beside another run's shards): one error naming what differs, not a
    KeyError or a size mismatch from inside the load."""
    save, step_dir, _ = saved
    _edit_meta(step_dir, edit)
    meta = json.load(open(os.path.join(step_dir, "meta.json")))
    with pytest.raises(TensorparError, match=error):
        model = Transformer(ModelConfig(**meta["model"]), None, init=False)
        load_checkpoint(save, model)


def test_a_meta_json_that_is_no_json_object_is_refused(saved):
    save, step_dir, _ = saved
    with open(os.path.join(step_dir, "meta.json"), "w") as f:
        f.write("[1, 2]")
    with pytest.raises(TensorparError, match="meta.json' is not a tensorpar checkpoint"):
        read_meta(save)


def test_bad_checkpoints_fail_the_cli_at_once(saved, cli):
    save, _, shard = saved
    os.remove(shard)
    for args in (["train", "--resume", save, "--steps", "4"], ["eval", "--checkpoint", save, "--seq-len", "8"]):
        code, _, err = cli(*args)
        assert code == 2 and "Traceback" not in err, err
        assert "model-tp01-pp00.safetensors' is missing" in err


def test_resume_past_the_end_is_refused(saved, cli):
    save, _, _ = saved
    code, _, err = cli("train", "--resume", save, "--steps", "2")
    assert code == 2 and "is at step 2 and --steps is 2" in err


def _python_loop_saves_its_weights(root: str) -> dict:
    """A Python loop's TP 2 model (the library's layers, torch's SGD) trained two steps, then saved without a tensorpar
    optimizer; returns the dense weights it saved."""
    from harness import mesh
    from tensorpar.checkpoints.sharded import save_checkpoint
    from tensorpar.models import get_config
    from tensorpar.models.build import build_transformer
    from tensorpar.models.state import full_state_dict

    m, cfg = mesh(tp=2), get_config("tiny")
    model = build_transformer(cfg, m, seed=0)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    ids = torch.randint(0, cfg.vocab_size, (2, 17), generator=torch.Generator().manual_seed(0))
    for _ in range(2):
        model(ids[:, :-1], ids[:, 1:]).backward()
        sgd.step()
        sgd.zero_grad()
    save_checkpoint(root, 2, model, None, m, cfg=cfg)
    return full_state_dict(model)


def test_a_python_loop_saves_its_weights_for_any_layout_and_resume_refuses_them(pools, tmp_path, cli):
    """save_checkpoint needed tensorpar's optimizer: a loop with a torch optimizer had no way to save in this
    format. Without one it saves the weights (layout from the mesh), which load at TP 1; `train --resume` refuses
    them, naming --init-from."""
    from tensorpar.models import get_config
    from tensorpar.models.state import full_state_dict

    root = str(tmp_path / "ck")
    trained = pools(2).run(_python_loop_saves_its_weights, root)[0]
    model = Transformer(get_config("tiny"), None, init=False)
    meta = load_checkpoint(root, model)
    assert meta["weights_only"] and meta["layout"]["tp"] == 2 and meta["optimizer_step"] == 0
    loaded, initial = full_state_dict(model), full_state_dict(Transformer(get_config("tiny"), None, seed=0))
    assert loaded.keys() == trained.keys() and all(torch.equal(loaded[n], trained[n]) for n in trained)
    assert any(not torch.equal(trained[n], initial[n]) for n in trained), "SGD moved nothing: a vacuous comparison"
    code, _, err = cli("train", "--resume", root, "--steps", "4")
    assert code == 2 and "holds weights only (saved without an optimizer): start from them with --init-from" in err
