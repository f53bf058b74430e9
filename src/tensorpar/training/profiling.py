"""`--profile-steps A:B`: torch.profiler over training steps A to B on the chosen ranks, one Chrome / Perfetto trace
per rank (OUT_DIR/profile/rank{r}.json.gz), with tensorpar's collectives ("all_reduce/tp", ...) and the pipeline's
actions ("pipeline F mb3 chunk0", ...) as named ranges. Open a trace in https://ui.perfetto.dev or chrome://tracing.
"""

from __future__ import annotations

import gzip
import os
import shutil

import torch

from tensorpar.errors import TensorparError


def parse_profile_steps(spec: str | None, steps: int) -> tuple[int, int] | None:
    """'A:B' -> (A, B), 1-based and inclusive, within the run's `steps`; None for None."""
    if spec is None:
        return None
    try:
        first, last = (int(x) for x in spec.split(":"))
    except ValueError:
        raise TensorparError(f"--profile-steps takes A:B (steps A to B, e.g. 2:3), got {spec!r}") from None
    if not 1 <= first <= last <= steps:
        raise TensorparError(f"--profile-steps {spec}: need 1 <= A <= B <= --steps ({steps})")
    return first, last


def resumed_past_profile_note(options, resume_meta: dict | None) -> list[str]:
    """A note when --profile-steps lies wholly before the step a run resumes at (no trace is written), else none."""
    profile = parse_profile_steps(options.profile_steps, options.steps)
    resumed_at = (resume_meta or {}).get("step", 0)
    if profile is None or profile[1] > resumed_at:
        return []
    return [f"warning: --profile-steps {options.profile_steps} ends before step {resumed_at + 1}, where this resumed "
            f"run starts: no profile is written"]


def parse_profile_ranks(spec: str | None, world: int) -> list[int] | None:
    """'0,1' -> [0, 1] (each below the world size); None for every rank."""
    if spec is None:
        return None
    try:
        ranks = sorted({int(x) for x in spec.split(",")})
    except ValueError:
        raise TensorparError(f"--profile-ranks takes comma-separated ranks, e.g. 0,1; got {spec!r}") from None
    if ranks[0] < 0 or ranks[-1] >= world:
        raise TensorparError(f"--profile-ranks {spec}: the ranks of this run are 0 to {world - 1}")
    return ranks


class StepProfiler:
    """Starts torch.profiler before step A and writes this rank's trace after step B (0-based steps in the calls).
    While it runs, `stats.profiling` makes every collective a named range."""

    def __init__(self, options, mesh):
        steps = parse_profile_steps(options.profile_steps, options.steps)
        ranks = parse_profile_ranks(options.profile_ranks, mesh.world_size)
        self.active = steps is not None and (ranks is None or mesh.rank in ranks) and options.out_dir is not None
        self.first, self.last = (steps[0] - 1, steps[1] - 1) if steps else (0, -1)
        self.path = os.path.join(options.out_dir or ".", "profile", f"rank{mesh.rank}.json.gz")
        self.stats, self.device, self._profile = mesh.stats, mesh.device, None

    def begin(self, step: int) -> None:
        """Before 0-based `step`: start at the range's first step, or at the first one a resumed run trains."""
        if self.active and self._profile is None and self.first <= step <= self.last:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self._profile = torch.profiler.profile(activities=activities, record_shapes=True)
            self._profile.__enter__()
            self.stats.profiling = True

    def end(self, step: int) -> None:
        if self._profile is not None and step == self.last:
            self.close()

    def close(self) -> None:
        """Stop profiling (also when the run ends or stops early) and write the trace."""
        if self._profile is None:
            return
        self.stats.profiling = False
        profile, self._profile = self._profile, None
        profile.__exit__(None, None, None)
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        plain = self.path[: -len(".gz")]
        profile.export_chrome_trace(plain)
        with open(plain, "rb") as src, gzip.open(self.path, "wb") as dst:
            shutil.copyfileobj(src, dst)
        os.remove(plain)
