"""The memory levers' options (`tensorpar.config.memory_levers`): what train runs with, and what plan models with
the host they offload to."""

from __future__ import annotations

import dataclasses

from tensorpar.config.choices import OPTIMIZER_STATE_DTYPES
from tensorpar.config.fields import option


@dataclasses.dataclass
class MemoryLeverOptions:
    """Memory levers (`tensorpar.config.memory_levers`): what train runs with and plan models."""

    optimizer_offload: bool = option(False, "keep AdamW's states and the fp32 master weights in host memory and step "
                                            "there (pinned on CUDA)", group="memory")
    activation_offload: bool = option(False, "move the tensors the layers save for the backward to host memory and "
                                             "back (pinned and overlapped on CUDA)", group="memory")
    activation_offload_layers: int | None = option(None, "with --activation-offload: only what the first N layers of "
                                                         "a rank save moves (default: every layer's)", group="memory")
    optimizer_state_dtype: str = option("fp32", "AdamW's moments in this dtype (the master weights stay fp32)",
                                        choices=OPTIMIZER_STATE_DTYPES, group="memory")


@dataclasses.dataclass
class PlanMemoryOptions(MemoryLeverOptions):
    """The memory levers plan models, and the host they offload to: its memory, its link to the GPU and how fast it
    steps an offloaded optimizer."""

    activation_offload_fit: bool = option(False, "with --activation-offload: per layout, move only the first "
                                                 "layers' saved tensors, the fewest that make it fit the GPU (none "
                                                 "where it fits without): each row's --activation-offload-layers",
                                          group="memory")
    host_memory_gib: float | None = option(None, "host memory per GPU the offloading levers may use (default 256: a "
                                                 "DGX H100's 2 TiB over 8 GPUs)", group="memory")
    host_link_bandwidth: float | None = option(None, "nominal GB/s per GPU per direction between the GPU and host "
                                                     "memory, which the offloaded tensors cross; copies reach "
                                                     "--link-efficiency of it (default: the catalog's, PCIe 5.0 x16 "
                                                     "= 64; A100: PCIe 4.0, 32)", group="memory")
    host_link_back_bandwidth: float | None = option(None, "nominal GB/s per GPU from host memory back to the GPU, "
                                                          "where it differs from --host-link-bandwidth (a machine "
                                                          "whose copies back measured slower: default the same)",
                                                    group="memory")
    host_optimizer_bandwidth: float | None = option(None, "GB/s of host-memory traffic per GPU an offloaded AdamW "
                                                          "step reaches, 28 bytes an element (default 32.5: derived "
                                                          "from one H200 run on 8 host threads)", group="memory")
