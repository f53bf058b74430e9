"""The training loop and what surrounds it: validating a run, building it on each rank, the step loop, evaluation,
metrics and the summary. `train(TrainOptions(...))` is the Python entry point."""

from tensorpar.config.options import TrainOptions
from tensorpar.training.trainer import run_training, train
from tensorpar.training.validate import PreparedRun, validate

__all__ = ["TrainOptions", "train", "run_training", "validate", "PreparedRun"]
