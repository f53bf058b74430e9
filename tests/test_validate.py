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
        (dict(pp=2, virtual_stages=3, dp=1), "pp=2 x virtual stages=3"),
        (dict(pp=2, schedule="interleaved", virtual_stages=2, dp=1, global_batch_size=3, micro_batch_size=1),
         "multiple of the pipeline-parallel size 2"),
    ]
    for overrides, needle in bad:
        args = TrainOptions(model=config_file, **{**BASE, **overrides})
        with pytest.raises(LayoutError, match=needle.replace("*", r"\*")):
            validate(args)


def test_resume_from_a_folder_without_a_checkpoint_starts_from_scratch_and_says_so(config_file, tmp_path):
    from tensorpar.training import validate

    for folder in (tmp_path / "absent", tmp_path):  # absent, and empty
        run = validate(TrainOptions(model=config_file, **{**BASE, "resume": str(folder), "save": str(folder)}))
        assert run.options.resume is None and run.resume_meta is None
        assert run.notes == (f"--resume {folder}: no checkpoint there yet; starting from step 0",)
    # A --resume path that does not exist and is not where the run saves is a typo: refused as before.
    with pytest.raises(TensorparError, match="checkpoint '.*/typo' does not exist"):
        validate(TrainOptions(model=config_file, **{**BASE, "resume": str(tmp_path / "typo")}))

