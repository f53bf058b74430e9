"""The parallel layout of a run as one value (`ParallelLayout`), every rule it must satisfy (`rules`), and the
pipeline split (`stages`): what training, eval, generate, the dry run, the planner and the checkpoints share."""

from tensorpar.layout.parallel_layout import ParallelLayout, resolve_dp
from tensorpar.layout.problem import Problem, divide, require
from tensorpar.layout.stages import PipelineSplit, balanced_split, parse_pipeline_layers

__all__ = ["ParallelLayout", "Problem", "PipelineSplit", "balanced_split", "divide", "parse_pipeline_layers",
           "require", "resolve_dp"]
