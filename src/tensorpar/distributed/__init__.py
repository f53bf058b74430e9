"""Processes and groups: the rank layout (`mesh`), counted collectives with timeouts (`comm`), the launcher
(`launch`), how a parameter is laid out over the groups (`sharding`), and collective algorithms and their
simulation (`collective_algorithms`, `collective_simulation`). The collectives each parallel dimension owns, as
autograd conjugates, live in that dimension's package (`tensorpar.tensor_parallel.mappings`, ...)."""

from tensorpar.distributed.comm import CommStats, Group, as_group
from tensorpar.distributed.mesh import Mesh, build_mesh, group_ranks, init_mesh, world_from_env

__all__ = [
    "CommStats", "Group", "as_group", "Mesh", "build_mesh", "init_mesh", "group_ranks", "world_from_env",
]
