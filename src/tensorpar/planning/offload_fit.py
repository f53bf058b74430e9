"""`plan --activation-offload-fit`: per layout, the fewest layers whose saved tensors must move to host memory for
it to fit the GPU (`MemoryLevers.activation_offload_layers`), instead of every layer's.

Moving the first N layers' tensors frees a layer's activations per layer moved, so a layout's GPU memory falls as
N grows: the smallest N that fits is found by bisection over 1..L (L: the model's layers, which caps a stage's);
N = L is the plain lever (None), which is also what a layout that does not fit even so is reported with. The
caller asks only for a layout over the GPU's memory without offloading (`search.evaluate`: one that fits moves
nothing).
Fewer layers moved expose fewer copies (`offload_time`), so the fewest that fit is also the fastest that fits.
"""

from __future__ import annotations

import dataclasses

from tensorpar.config.memory_levers import MemoryLevers
from tensorpar.planning.memory import layout_memory


def fewest_offloaded_layers(cfg, layout, cluster, seq_len: int, global_batch: int, precision, flash_attention: bool,
                            levers: MemoryLevers, lora=None) -> MemoryLevers:
    """`levers` with the activation offload that `layout`, over `cluster`'s GPU memory without it, needs to fit
    (see the module): the first N layers, or every layer (None)."""

    def fits(candidate: MemoryLevers) -> bool:
        mem = layout_memory(cfg, layout, seq_len, global_batch, precision, flash_attention, candidate, lora)
        return mem.total <= cluster.memory_bytes

    first = dataclasses.replace(levers, activation_offload=True, activation_offload_layers=None)
    low, high = 1, cfg.num_layers
    if not fits(first):
        return first
    while low < high:
        mid = (low + high) // 2
        if fits(dataclasses.replace(first, activation_offload_layers=mid)):
            high = mid
        else:
            low = mid + 1
    return first if low == cfg.num_layers else dataclasses.replace(first, activation_offload_layers=low)
