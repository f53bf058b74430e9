"""`--memory-snapshot` (CUDA): the caching allocator records its history (every allocation and free, with its Python
stack) from the first step, and each rank writes ``torch.cuda.memory._snapshot()`` to OUT_DIR/memory/rank{r}.pickle
after a step that set a new memory peak, and when a step runs out of memory. The file therefore always holds the
rank's highest moment: the peak step's, or the failed allocation's. Drag it into https://pytorch.org/memory_viz.
"""

from __future__ import annotations

import os
import pickle

import torch

# The allocator's history keeps the last this many events (torchtitan's figure): a few steps of a large model.
MAX_ENTRIES = 100_000


class MemorySnapshot:
    """This rank's allocator history while `active`; `after_step` and `out_of_memory` write the snapshot."""

    def __init__(self, options, mesh):
        self.active = bool(options.memory_snapshot) and mesh.device.type == "cuda"
        self.path = os.path.join(options.out_dir or ".", "memory", f"rank{mesh.rank}.pickle")
        self.device, self.peak_mib = mesh.device, 0.0
        if self.active:
            # Python frames only: C++ frames make every snapshot slow to symbolize.
            torch.cuda.memory._record_memory_history(max_entries=MAX_ENTRIES, stacks="python", device=self.device)

    def after_step(self, memory_mib: dict) -> None:
        """Write the snapshot if the step's allocator peak (`memory_mib["allocated"]`) is the highest so far."""
        if self.active and memory_mib.get("allocated", 0.0) > self.peak_mib:
            self.peak_mib = memory_mib["allocated"]
            self.dump()

    def out_of_memory(self) -> None:
        if self.active:
            self.dump()

    def dump(self) -> str:
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        tmp = f"{self.path}.tmp-{os.getpid()}"
        with open(tmp, "wb") as f:
            pickle.dump(torch.cuda.memory._snapshot(self.device), f)
        os.replace(tmp, self.path)
        return self.path

    def close(self) -> None:
        if self.active:
            torch.cuda.memory._record_memory_history(enabled=None, device=self.device)
