"""Which node each rank runs on, and whether a tensor-parallel group stays inside one.

torchrun numbers the ranks node by node (node g of G holds ranks g*L .. g*L + L - 1 for L processes per
node, in its environment GROUP_RANK, GROUP_WORLD_SIZE, LOCAL_WORLD_SIZE), and so does a Slurm step with
Slurm's default block distribution (see `slurm`). The mesh puts TP innermost (a TP group is tp consecutive
ranks, see `mesh`), so every TP group stays inside a node exactly when tp divides L.

A TP group across nodes is warned about, not refused: the run is still correct, only slow (TP all-reduces
several times per layer, over the inter-node network then), and what torchrun calls a node is not always
the fast-link domain (a GB200 NVL72 rack links 72 GPUs over NVLink across its 4-GPU trays; a test cluster
may have one GPU per node). Megatron-LM likewise leaves this to the user.
"""

from __future__ import annotations

import dataclasses
import math
import os
import socket


@dataclasses.dataclass(frozen=True)
class NodeLayout:
    """This process's node among the world's: its index, the number of nodes, processes per node, host name."""

    node_rank: int = 0
    num_nodes: int = 1
    local_world_size: int = 1
    host: str = ""

    @classmethod
    def from_env(cls, env=None) -> "NodeLayout":
        """From a launcher's environment (torchrun's, or a Slurm step's once `slurm.adopt_slurm_step` ran): one
        node holding the whole world where it says nothing."""
        env = os.environ if env is None else env
        world = int(env.get("WORLD_SIZE", "1"))
        local = int(env.get("LOCAL_WORLD_SIZE", world))
        nodes = int(env.get("GROUP_WORLD_SIZE", math.ceil(world / max(1, local))))
        return cls(int(env.get("GROUP_RANK", "0")), nodes, local, socket.gethostname())

    @property
    def multi_node(self) -> bool:
        return self.num_nodes > 1

    def node_of(self, rank: int) -> int:
        """The node that holds global rank `rank` (ranks numbered node by node, L per node)."""
        return rank // self.local_world_size

    def describe(self, rank: int) -> str:
        """'rank 2 on node 1 (host gpu07)', naming the node only when there are several."""
        if not self.multi_node:
            return f"rank {rank}"
        return f"rank {rank} on node {self.node_rank}" + (f" ({self.host})" if self.host else "")


def tp_across_nodes(tp: int, layout: NodeLayout) -> str | None:
    """A warning when some tensor-parallel group of `tp` consecutive ranks would span two nodes, else None."""
    per_node = layout.local_world_size
    if not layout.multi_node or per_node % tp == 0:
        return None
    divisors = [d for d in range(1, per_node + 1) if per_node % d == 0]
    if tp > per_node:
        where = f"every tensor-parallel group spans {math.ceil(tp / per_node)} nodes"
    else:
        where = "some tensor-parallel groups span two nodes"
    return (f"warning: --tp {tp} with {per_node} processes per node ({layout.num_nodes} nodes): {where}, and TP "
            f"all-reduces several times per layer over the inter-node network. Keep TP inside a node: --tp "
            f"{' or '.join(map(str, divisors))}, with --pp / --dp / --cp across the nodes")
