"""Training runs are validated before any process group exists."""

import pytest

from tensorpar.errors import TensorparError
from tensorpar.training import TrainOptions

from layout_runs import BASE


def test_bad_pipeline_layouts_are_refused(config_file):
    from tensorpar.errors import LayoutError
    from tensorpar.training import validate

    bad = [
        (dict(pp=3, dp=1), "8 layers cannot be split evenly into pp=3"),
        (dict(pp=2, schedule="interleaved", virtual_stages=3, dp=1), "pp=2 x virtual stages=3"),
        (dict(pp=2, virtual_stages=3, dp=1), "virtual_stages=3 needs the 'interleaved' schedule"),
        (dict(pp=2, schedule="interleaved", virtual_stages=2, dp=1, global_batch_size=3, micro_batch_size=1),
         "multiple of the pipeline-parallel size 2"),
    ]
    for overrides, needle in bad:
        args = TrainOptions(model=config_file, **{**BASE, **overrides})
        with pytest.raises(LayoutError, match=needle.replace("*", r"\*")):
            validate(args)


def test_bad_pipeline_layer_splits_are_refused(config_file):
    from tensorpar.errors import LayoutError
    from tensorpar.training import validate

    bad = [
        (dict(pp=2, dp=1, pipeline_layers="3,4"), "sums to 7 layers but the model has 8"),
        (dict(pp=2, dp=1, pipeline_layers="2,3,3"), "has 3 entries; it needs one per pipeline stage"),
        (dict(pp=2, dp=1, pipeline_layers="0,8"), "every pipeline stage needs at least one layer"),
        (dict(pp=2, dp=1, pipeline_layers="4;4"), "comma-separated layer counts"),
        (dict(pp=2, dp=1, pipeline_layers="2,6", schedule="interleaved", virtual_stages=2), "--virtual-stages 1"),
        (dict(pp=3, dp=1), r"--pipeline-layers 3,3,2"),
    ]
    for overrides, needle in bad:
        with pytest.raises(LayoutError, match=needle):
            validate(TrainOptions(model=config_file, **{**BASE, **overrides}))
    run = validate(TrainOptions(model=config_file, **{**BASE, "pp": 2, "dp": 1, "pipeline_layers": "1,7"}))
    assert run.options.pipeline_layers == "1,7"


def test_the_proposed_split_is_the_most_balanced_with_light_end_stages():
    from tensorpar.errors import LayoutError
    from tensorpar.layout import PipelineSplit, balanced_split

    assert balanced_split(70, 12) == [5] + [6] * 10 + [5]
    with pytest.raises(LayoutError, match="--pipeline-layers 5,6,6,6,6,6,6,6,6,6,6,5"):
        PipelineSplit(70, 12).stage_layers()
    assert PipelineSplit(20, 4, counts=(4, 6, 6, 4)).stage_layers() == [
        list(range(0, 4)), list(range(4, 10)), list(range(10, 16)), list(range(16, 20))]
    assert PipelineSplit(8, 2, counts=(1, 7)).rank_layers(1) == [list(range(1, 8))]
    assert PipelineSplit(8, 2).stage_layers() == [list(range(4)), list(range(4, 8))]


def test_resume_from_a_folder_without_a_checkpoint_starts_from_scratch_and_says_so(config_file, tmp_path):
    from tensorpar.training import validate

    for folder in (tmp_path / "absent", tmp_path):  # absent, and empty
        run = validate(TrainOptions(model=config_file, **{**BASE, "resume": str(folder), "save": str(folder)}))
        assert run.options.resume is None and run.resume_meta is None
        assert run.notes == (f"--resume {folder}: no checkpoint there yet; starting from step 0",)
    # A --resume path that does not exist and is not where the run saves is a typo: refused as before.
    with pytest.raises(TensorparError, match="checkpoint '.*/typo' does not exist") as refused:
        validate(TrainOptions(model=config_file, **{**BASE, "resume": str(tmp_path / "typo")}))
    assert f"add --save {tmp_path / 'typo'}" in str(refused.value)  # the way to a first start there
    # An existing folder without --save starts too, and says that nothing will be there to resume from.
    run = validate(TrainOptions(model=config_file, **{**BASE, "resume": str(tmp_path)}))
    assert run.options.resume is None
    assert run.notes == (f"--resume {tmp_path}: no checkpoint there yet; starting from step 0 (warning: without "
                         f"--save this run writes no checkpoint, so the same command starts from step 0 again: "
                         f"add --save {tmp_path})",)



def test_a_resumed_run_names_the_checkpoints_model_not_the_model_option(tmp_path):
    """The checkpoint's model trains on: a --model that differs (or the default 'tiny', not given) is said to be
    unused, and the run (summary, out-dir, its checkpoints' options) names the checkpoint's model."""
    import json, os
    from tensorpar.checkpoints.dense_checkpoint import write_dense_checkpoint
    from tensorpar.models import Transformer, get_config
    from tensorpar.models.state import full_state_dict
    from tensorpar.training import validate

    cfg = get_config("tiny-gpt2")
    step_dir = write_dense_checkpoint(str(tmp_path / "ck"), cfg, full_state_dict(Transformer(cfg, None)), step=2)
    meta_path = os.path.join(step_dir, "meta.json")
    meta = json.load(open(meta_path))
    meta["options"] = {"model": "tiny-gpt2"}
    json.dump(meta, open(meta_path, "w"))
    run = validate(TrainOptions(model="tiny", **{**BASE, "steps": 4, "resume": str(tmp_path / "ck")}))
    assert run.options.model == "tiny-gpt2" and run.cfg.family == "gpt2"
    assert run.notes == (f"--resume {tmp_path / 'ck'}: continuing the checkpoint's model 'tiny-gpt2'; --model 'tiny' "
                         f"is not used",)
    run = validate(TrainOptions(model="tiny-gpt2", **{**BASE, "steps": 4, "resume": str(tmp_path / "ck")}))
    assert run.options.model == "tiny-gpt2" and run.notes == ()


def test_training_past_a_rotary_models_positions_is_said(tmp_path):
    """A rotary model trains past its max_position_embeddings (transformers' models run there too), but the
    user hears that those positions extrapolate; within them, nothing is said."""
    import json

    from tensorpar.models import get_config
    from tensorpar.training import validate

    cfg = get_config("tiny").to_dict()
    path = tmp_path / "short.json"
    path.write_text(json.dumps({**cfg, "max_seq_len": 8}))
    past = validate(TrainOptions(model=str(path), **{**BASE, "seq_len": 16}), world_size=1)
    assert past.notes == ("warning: --seq-len 16 is past the model's 8 positions: rotary positions beyond 8 "
                          "extrapolate; to extend the context, raise its max_position_embeddings (max_seq_len in a "
                          "tensorpar config) and its rope scaling",)
    assert validate(TrainOptions(model=str(path), **{**BASE, "seq_len": 8}), world_size=1).notes == ()


def test_a_pipeline_gets_micro_batches_by_default(config_file):
    """Without --micro-batch-size, a pipeline runs one sequence per micro-batch (torchtitan's default), so its stages
    overlap and zbv's 2 x pp - 1 micro-batches are there; without a pipeline, one micro-batch of global / dp."""
    from tensorpar.training import validate

    base = {**BASE, "micro_batch_size": None, "global_batch_size": 8}
    for schedule in ("1f1b", "zbv", "interleaved"):
        run = validate(TrainOptions(model=config_file, **{**base, "pp": 2, "dp": 1, "schedule": schedule,
                                                          "virtual_stages": 2 if schedule == "interleaved" else 1}))
        assert (run.options.micro_batch_size, run.num_micro_batches) == (1, 8)
    run = validate(TrainOptions(model=config_file, **{**base, "dp": 2}), world_size=2)
    assert (run.options.micro_batch_size, run.num_micro_batches) == (4, 1)
