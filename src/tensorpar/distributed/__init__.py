"""Rank layout, counted collectives and the autograd conjugates of tensor/sequence parallelism."""

from tensorpar.distributed.comm import CommStats, Group, as_group
from tensorpar.distributed.mesh import Mesh, group_ranks, init_mesh, resolve_layout, world_from_env
from tensorpar.distributed.ops import (
    all_to_all_ep,
    copy_to_tp,
    gather_from_sp,
    gather_from_tp,
    mean_from_cp,
    reduce_from_tp,
    reduce_scatter_to_sp,
    scatter_to_sp,
    scatter_to_tp,
)

__all__ = [
    "CommStats", "Group", "as_group", "Mesh", "init_mesh", "group_ranks", "resolve_layout", "world_from_env",
    "copy_to_tp", "reduce_from_tp", "gather_from_tp", "scatter_to_tp",
    "gather_from_sp", "reduce_scatter_to_sp", "scatter_to_sp", "mean_from_cp", "all_to_all_ep",
]
