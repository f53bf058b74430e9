"""Processes and groups: the rank layout (`mesh`), counted collectives with timeouts (`comm`), the launcher
(`launch`), how a parameter is laid out over the groups (`sharding`), and collective algorithms and their
simulation (`collective_algorithms`, `collective_simulation`). The collectives each parallel dimension owns, as
autograd conjugates, live in that dimension's package (`tensorpar.tensor_parallel.mappings`, ...)."""

from tensorpar.distributed.comm import CommStats, Group, as_group
from tensorpar.distributed.mesh import Mesh, group_ranks, init_mesh, resolve_layout, world_from_env

__all__ = [
    "CommStats", "Group", "as_group", "Mesh", "init_mesh", "group_ranks", "resolve_layout", "world_from_env",
]
