"""The process mesh: which rank does what in a tp x cp x dp x pp layout.

Ranks are laid out as Megatron-Core orders them: TP varies fastest, then CP, then DP, then PP::

    global_rank = ((pp_rank * dp + dp_rank) * cp + cp_rank) * tp + tp_rank

so the ranks of one TP group are contiguous (on one node, sharing the fast links), a context-parallel
ring is the next closest, and a pipeline stage is a block of tp * cp * dp consecutive ranks. Parameter
gradients are averaged over DP x CP (`dp_cp_group`: the ranks that hold the same parameters and see
different tokens); with cp = 1 that group is the DP group itself.

Mixture-of-experts runs fold the same tp x cp x dp ranks of a pipeline stage differently for their
expert layers ("parallel folding", as Megatron-Core does): expert-TP fastest, then EP, then
expert-DP. In the stage's n = tp * cp * dp ranks (in rank order), an expert-TP group is etp
consecutive ranks (which split each expert's MLP between them), an expert-parallel group is ep ranks
etp apart within a block of etp * ep consecutive ranks (each holding its own experts: the block holds
them all), and an expert-data-parallel group is the n / (etp * ep) ranks etp * ep apart, whose members
hold the same expert shards and over which expert gradients are summed. EP may therefore exceed DP: at
tp 2 x dp 2, ep 4 spans the TP and the DP ranks; at tp 2 x dp 2 with ep 2 x etp 2, the expert-TP
groups are the TP groups and EP runs over DP.
"""

from __future__ import annotations

import dataclasses
import gc
import os
from datetime import timedelta

import torch
import torch.distributed as dist

from tensorpar.distributed.comm import CommStats, Group
from tensorpar.distributed.launch import SPAWNED_ENV
from tensorpar.distributed.nodes import NodeLayout
from tensorpar.errors import LayoutError, TensorparError
from tensorpar.layout import ParallelLayout, require, resolve_dp
from tensorpar.layout.rules import fold_problem, hsdp_problem

DEFAULT_TIMEOUT_S = float(os.environ.get("TENSORPAR_TIMEOUT", "300"))


def world_from_env() -> tuple[int, int, int]:
    """(world_size, rank, local_rank) of this process: from torch.distributed, a launcher's environment, or 1/0/0."""
    if dist.is_available() and dist.is_initialized():
        local = int(os.environ.get("LOCAL_RANK", dist.get_rank()))
        return dist.get_world_size(), dist.get_rank(), local
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local = int(os.environ.get("LOCAL_RANK", str(rank)))
    return world, rank, local


def rank_grid(tp: int, pp: int, dp: int, cp: int = 1) -> torch.Tensor:
    """Global ranks arranged as [pp, dp, cp, tp]: grid[p, d, c, t] is the rank with those coordinates."""
    return torch.arange(tp * pp * dp * cp).reshape(pp, dp, cp, tp)


def group_ranks(tp: int, pp: int, dp: int, cp: int = 1, ep: int | None = None,
                expert_tp: int = 1, dp_replicate: int = 1) -> dict[str, list[list[int]]]:
    """Every group of each dimension, as lists of global ranks ("dp_cp" only when cp > 1; the expert groups
    "expert_tp", "ep" and "edp" only when `ep` is given, for a mixture-of-experts model; "dp_shard" and
    "dp_replicate" only when `dp_replicate` > 1: HSDP, see `hsdp_groups`)."""
    g = rank_grid(tp, pp, dp, cp)
    groups = {
        "tp": [g[p, d, c, :].tolist() for p in range(pp) for d in range(dp) for c in range(cp)],
        "cp": [g[p, d, :, t].tolist() for p in range(pp) for d in range(dp) for t in range(tp)],
        "dp": [g[p, :, c, t].tolist() for p in range(pp) for c in range(cp) for t in range(tp)],
        "pp": [g[:, d, c, t].tolist() for d in range(dp) for c in range(cp) for t in range(tp)],
        # The first and last pipeline stage, which both hold a tied embedding.
        "embed": [sorted({int(g[0, d, c, t]), int(g[pp - 1, d, c, t])})
                  for d in range(dp) for c in range(cp) for t in range(tp)],
    }
    if cp > 1:
        groups["dp_cp"] = [g[p, :, :, t].flatten().tolist() for p in range(pp) for t in range(tp)]
    if ep is not None:
        stages = [g[p].flatten().tolist() for p in range(pp)]  # a stage's ranks in rank order
        block = expert_tp * ep  # the ranks holding every expert once
        groups["expert_tp"] = [stage[i : i + expert_tp] for stage in stages for i in range(0, len(stage), expert_tp)]
        groups["ep"] = [stage[i + t : i + block : expert_tp] for stage in stages
                        for i in range(0, len(stage), block) for t in range(expert_tp)]
        groups["edp"] = [stage[j::block] for stage in stages for j in range(block)]
    if dp_replicate > 1:
        groups.update(hsdp_groups(g, dp_replicate))
    return groups


def hsdp_groups(g: torch.Tensor, replicas: int) -> dict[str, list[list[int]]]:
    """HSDP's two groups over the rank grid `g` [pp, dp, cp, tp]: the DP ranks split into `replicas` replicas of
    dp / replicas consecutive DP ranks each (consecutive ranks: one node's, where the mesh has them). "dp_shard":
    one replica's ranks (with their CP ranks), over which ZeRO shards; "dp_replicate": the ranks that hold the
    same shard in every replica, over which the shards' gradients are all-reduced."""
    pp, dp, cp, tp = g.shape
    shards = dp // replicas
    return {
        "dp_shard": [g[p, r * shards : (r + 1) * shards, :, t].flatten().tolist()
                     for p in range(pp) for t in range(tp) for r in range(replicas)],
        "dp_replicate": [g[p, s::shards, c, t].tolist()
                         for p in range(pp) for t in range(tp) for c in range(cp) for s in range(shards)],
    }


@dataclasses.dataclass
class Mesh:
    """A tp x cp x dp x pp layout of the running processes, with one counted `Group` per dimension."""

    tp_group: Group
    pp_group: Group
    dp_group: Group
    embed_group: Group
    world_group: Group
    rank: int
    world_size: int
    device: torch.device
    backend: str | None
    stats: CommStats
    owns_process_group: bool = False
    owns_subgroups: bool = False  # the per-dimension groups were created for this mesh (init_mesh)
    cp_group: Group | None = None  # None: a group of this rank alone (see __post_init__)
    dp_cp_group: Group | None = None  # None: the DP group
    ep_group: Group | None = None  # None: a group of this rank alone
    expert_dp_group: Group | None = None  # None: no expert groups (a dense model)
    expert_tp_group: Group | None = None  # None: a group of this rank alone
    dp_shard_group: Group | None = None  # None: the DP x CP group (no HSDP): what ZeRO shards over
    dp_replicate_group: Group | None = None  # None: a group of this rank alone: HSDP's replicas of each shard
    layout: ParallelLayout | None = None  # what `build_mesh` laid out (its sizes; zero, schedule and SP as given)

    def __post_init__(self):
        if self.cp_group is None:
            self.cp_group = Group("cp", [self.rank], None, self.stats, self.rank)
        if self.dp_cp_group is None:
            self.dp_cp_group = self.dp_group
        if self.ep_group is None:
            self.ep_group = Group("ep", [self.rank], None, self.stats, self.rank)
        if self.expert_tp_group is None:
            self.expert_tp_group = Group("expert_tp", [self.rank], None, self.stats, self.rank)
        if self.dp_shard_group is None:
            self.dp_shard_group = self.dp_cp_group
        if self.dp_replicate_group is None:
            self.dp_replicate_group = Group("dp_replicate", [self.rank], None, self.stats, self.rank)

    tp_size = property(lambda self: self.tp_group.size)
    tp_rank = property(lambda self: self.tp_group.rank)
    pp_size = property(lambda self: self.pp_group.size)
    pp_rank = property(lambda self: self.pp_group.rank)
    dp_size = property(lambda self: self.dp_group.size)
    dp_rank = property(lambda self: self.dp_group.rank)
    cp_size = property(lambda self: self.cp_group.size)
    cp_rank = property(lambda self: self.cp_group.rank)
    ep_size = property(lambda self: self.ep_group.size)
    ep_rank = property(lambda self: self.ep_group.rank)
    expert_tp_size = property(lambda self: self.expert_tp_group.size)
    expert_tp_rank = property(lambda self: self.expert_tp_group.rank)

    def __repr__(self) -> str:
        return (
            f"Mesh(rank={self.rank}/{self.world_size}, tp={self.tp_rank}/{self.tp_size}, "
            f"cp={self.cp_rank}/{self.cp_size}, pp={self.pp_rank}/{self.pp_size}, dp={self.dp_rank}/{self.dp_size}, "
            f"ep={self.ep_rank}/{self.ep_size}, expert_tp={self.expert_tp_rank}/{self.expert_tp_size}, device={self.device})"
        )

    def check_layout(self, tp: int, pp: int, dp: int, cp: int = 1, ep: int | None = None, expert_tp: int = 1,
                     dp_replicate: int = 1) -> None:
        """Refuse to run a layout on a mesh built for another: a caller that passes its own mesh (to create the
        process groups once for several runs) must pass the one the run's options describe."""
        want = {"tp": tp, "pp": pp, "dp": dp, "cp": cp, "dp_replicate": dp_replicate}
        have = {"tp": self.tp_size, "pp": self.pp_size, "dp": self.dp_size, "cp": self.cp_size,
                "dp_replicate": self.dp_replicate_group.size}
        if ep is not None:  # a mixture-of-experts run needs the expert groups
            want.update(ep=ep, expert_tp=expert_tp)
            have.update(ep=self.ep_size if self.expert_dp_group is not None else None,
                        expert_tp=self.expert_tp_size)
        wrong = [f"{k} {have[k]} (wanted {want[k]})" for k in want if have[k] != want[k]]
        if wrong:
            raise LayoutError(f"the mesh given has {', '.join(wrong)}: build it with the run's layout "
                              f"(init_mesh(tp={tp}, pp={pp}, dp={dp}, cp={cp}"
                              + (f", ep={ep}, expert_tp={expert_tp}" if ep is not None else "")
                              + (f", dp_replicate={dp_replicate}" if dp_replicate > 1 else "") + "))")

    def check_run(self, layout: ParallelLayout, moe: bool) -> None:
        """`check_layout` of a run's layout (`moe`: the model has experts, so the mesh needs expert groups)."""
        self.check_layout(layout.tp, layout.pp, layout.dp, layout.cp, layout.expert_parallel(moe),
                          layout.expert_tp if moe else 1, layout.dp_replicate)

    def destroy(self) -> None:
        """Tear down the process groups this mesh created: all of them if it started the world, else its
        per-dimension groups.

        The Groups drop their torch process groups here, so that gloo's worker threads are joined now rather
        than by the interpreter's final garbage collection, where a thread torn down mid-exit aborts the
        process (SIGABRT, "terminate called without an active exception") after a run that succeeded."""
        groups = (self.tp_group, self.cp_group, self.pp_group, self.dp_group, self.dp_cp_group, self.embed_group,
                  self.world_group, self.ep_group, self.expert_dp_group, self.expert_tp_group)
        if self.owns_process_group and dist.is_initialized():
            dist.destroy_process_group()
        elif self.owns_subgroups and dist.is_initialized():
            # The world was there before this mesh (torchrun's caller, a test's process pool): only the groups
            # it created go, or every run in the same processes would leave gloo's threads and sockets behind.
            for pg in {id(g.pg): g.pg for g in groups if g is not None and g.pg is not None}.values():
                if pg is not dist.group.WORLD:
                    dist.destroy_process_group(pg)
        else:
            return
        for group in groups:
            if group is not None:
                group.pg = None
        gc.collect()
        self.owns_process_group = self.owns_subgroups = False


def _pick_device(local_rank: int, device: str | torch.device | None) -> torch.device:
    if device is not None:
        try:
            device = torch.device(device)
        except (RuntimeError, TypeError):
            raise LayoutError(f"device {device!r} is not a torch device; use cpu, cuda or cuda:N") from None
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", local_rank % max(1, torch.cuda.device_count()))
        return device
    if torch.cuda.is_available():
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device("cpu")


def check_gpus_per_process(device: torch.device, backend: str | None, world: int) -> None:
    """NCCL refuses two ranks on one GPU ("Duplicate GPU detected"), and only after every rank has
    reached the rendezvous: say so before it, naming the counts and the ways out."""
    if device.type != "cuda" or world == 1 or (backend is not None and backend != "nccl"):
        return
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    gpus = torch.cuda.device_count()
    if gpus == 1 and "SLURM_GPUS_PER_TASK" in os.environ:  # srun --gpus-per-task: each task sees its own GPU
        return
    if local_world > gpus:
        raise LayoutError(
            f"{local_world} processes on this node but {gpus} GPU{'s' if gpus != 1 else ''} visible: NCCL needs "
            f"one GPU per process. Run at most {gpus} process{'es' if gpus != 1 else ''} per node, or pass "
            f"--device cpu (gloo), or --backend gloo to share the GPU for testing (collectives through host memory)")


def _require_visible_cuda(device: torch.device, named: str, fix: str) -> None:
    """A LayoutError, `named` and its `fix` in it, for a CUDA device where this process sees none."""
    if device.type == "cuda" and not torch.cuda.is_available():
        build = "" if torch.version.cuda else ", a CPU-only build"
        raise LayoutError(f"{named}: no CUDA device is visible to this process (torch {torch.__version__}{build}); "
                          f"{fix}")


def check_backend(device: str | torch.device | None, backend: str | None) -> None:
    """Before any rank starts: refuse a `--device` that is not a torch device or that this machine does not have
    (CUDA), and `--backend nccl` for a run on another device than CUDA (NCCL moves CUDA tensors only)."""
    try:
        resolved = _pick_device(0, device)
    except LayoutError:
        raise LayoutError(f"--device {device}: not a torch device; use cpu, cuda or cuda:N") from None
    _require_visible_cuda(resolved, f"--device {device}", "drop --device to run on the CPU")
    if backend == "nccl" and resolved.type != "cuda":
        raise LayoutError(f"--backend nccl needs CUDA devices, and this run's device is {resolved.type}: drop "
                          f"--backend (gloo is the default there)")


def init_mesh(
    tp: int = 1,
    pp: int = 1,
    dp: int | None = None,
    *,
    cp: int = 1,
    ep: int | None = None,
    expert_tp: int = 1,
    dp_replicate: int = 1,
    device: str | torch.device | None = None,
    backend: str | None = None,
    timeout: float | timedelta | None = None,
    stats: CommStats | None = None,
) -> Mesh:
    """Lay tp x cp x dp x pp over the running world and create one process group per dimension: `build_mesh` of
    the layout these sizes make (`dp` defaults to what the others leave of the world).

    `ep` (mixture-of-experts models only; None for dense ones, which then create no expert groups): the
    expert-parallel size, folded onto each stage's tp x cp x dp ranks (see the module docstring), with
    `expert_tp` ranks splitting each expert's MLP. `dp_replicate` (HSDP): the DP ranks form that many replicas;
    ZeRO shards within a replica (``dp_shard_group``) and all-reduces each shard's gradients across the replicas
    (``dp_replicate_group``).
    """
    world, _, _ = world_from_env()
    if ep is None and expert_tp != 1:
        raise LayoutError(f"expert_tp={expert_tp} needs expert groups: pass ep= (a mixture-of-experts model)")
    layout = ParallelLayout(tp=tp, cp=cp, pp=pp, dp=resolve_dp(world, tp, cp, pp, dp), dp_replicate=dp_replicate,
                            ep=ep or 1, expert_tp=expert_tp)
    return build_mesh(layout, moe=ep is not None, device=device, backend=backend, timeout=timeout, stats=stats)


def build_mesh(layout: ParallelLayout, *, moe: bool = False, device: str | torch.device | None = None,
               backend: str | None = None, timeout: float | timedelta | None = None,
               stats: CommStats | None = None) -> Mesh:
    """The process groups of `layout` over the running world (`moe`: with the expert groups a mixture-of-experts
    model needs).

    The world comes from an initialised torch.distributed, from a launcher's environment
    (torchrun's RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT), or is a single process.
    The layout is checked before any process group is created, so a layout that cannot work
    fails at once on every rank. The backend is NCCL for CUDA devices and gloo otherwise.
    """
    world, rank, local_rank = world_from_env()
    resolve_dp(world, layout.tp, layout.cp, layout.pp, layout.dp)
    ep = layout.expert_parallel(moe)
    require(hsdp_problem(layout.dp, layout.dp_replicate, layout.ep if moe else 1))
    if moe:
        require(fold_problem(layout.tp, layout.cp, layout.dp, layout.ep, layout.expert_tp))
    device = _pick_device(local_rank, device)
    if not dist.is_initialized():
        check_gpus_per_process(device, backend, world)
    _require_visible_cuda(device, f"device {device}", "use device='cpu'")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    timeout = _as_timedelta(timeout)
    stats = stats if stats is not None else CommStats()
    stats.flight.rank, stats.flight.world_size = rank, world
    backend, owns = _init_world(world, rank, device, backend, timeout)
    ranks = group_ranks(layout.tp, layout.pp, layout.dp, layout.cp, ep, layout.expert_tp if moe else 1,
                        layout.dp_replicate)
    groups = _create_groups(ranks, rank, world, stats, timeout, backend)
    mesh = _mesh_of(groups, rank, world, device, backend, stats, owns)
    mesh.layout = layout
    return mesh


def _mesh_of(groups: dict[str, Group], rank: int, world: int, device: torch.device, backend: str | None,
             stats: CommStats, owns_process_group: bool) -> Mesh:
    """The Mesh of the groups `_create_groups` made for this rank."""
    return Mesh(
        tp_group=groups["tp"],
        pp_group=groups["pp"],
        dp_group=groups["dp"],
        embed_group=groups["embed"],
        world_group=groups["world"],
        rank=rank,
        world_size=world,
        device=device,
        backend=backend,
        stats=stats,
        owns_process_group=owns_process_group,
        owns_subgroups=True,
        cp_group=groups["cp"],
        dp_cp_group=groups.get("dp_cp"),
        ep_group=groups.get("ep"),
        expert_dp_group=groups.get("edp"),
        expert_tp_group=groups.get("expert_tp"),
        dp_shard_group=groups.get("dp_shard"),
        dp_replicate_group=groups.get("dp_replicate"),
    )


def _as_timedelta(timeout: float | timedelta | None) -> timedelta:
    """The process groups' timeout as a timedelta: seconds as given, or DEFAULT_TIMEOUT_S when None."""
    if timeout is None:
        timeout = DEFAULT_TIMEOUT_S
    if not isinstance(timeout, timedelta):
        timeout = timedelta(seconds=float(timeout))
    return timeout


def _init_world(world: int, rank: int, device: torch.device, backend: str | None,
                timeout: timedelta) -> tuple[str | None, bool]:
    """(backend, whether this call created the default process group): starts torch.distributed for a world of
    several processes that has not started it yet (NCCL for CUDA devices, gloo otherwise, unless `backend` says)."""
    if world > 1 and not dist.is_initialized():
        backend = backend or ("nccl" if device.type == "cuda" else "gloo")
        if backend == "nccl":  # PyTorch's own NCCL flight recorder beside tensorpar's, dumped on a timeout
            os.environ.setdefault("TORCH_NCCL_TRACE_BUFFER_SIZE", "2000")
            os.environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
        _rendezvous(backend, rank, world, timeout)
        return backend, True
    if dist.is_initialized():
        backend = backend or dist.get_backend()
    return backend, False


def _rendezvous(backend: str, rank: int, world: int, timeout: timedelta) -> None:
    """init_process_group through the launcher's MASTER_ADDR / MASTER_PORT (env://), its failures in one line: an
    unset variable, rank 0's port taken by another process, rank 0's store unreachable."""
    missing = [name for name in ("MASTER_ADDR", "MASTER_PORT") if not os.environ.get(name)]
    if missing:
        raise TensorparError(f"a world of {world} processes (RANK, WORLD_SIZE set) needs {' and '.join(missing)}: the "
                             f"host and port of rank 0's rendezvous, as torchrun sets them")
    where = f"MASTER_ADDR {os.environ['MASTER_ADDR']} MASTER_PORT {os.environ['MASTER_PORT']}"
    try:
        dist.init_process_group(backend=backend, rank=rank, world_size=world, timeout=timeout)
    except (dist.DistNetworkError, dist.DistStoreError) as e:
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        if "EADDRINUSE" in reason or "address already in use" in reason:
            way = ("another process took the port the launcher chose: run the command again"
                   if os.environ.get(SPAWNED_ENV) else "set MASTER_PORT to a free one")
            raise TensorparError(f"cannot host the rendezvous at {where}: another process listens on the "
                                 f"port; {way} ({reason})") from None
        raise TensorparError(f"the rendezvous at {where} failed: {reason}") from None


def _create_groups(ranks_by_name: dict[str, list[list[int]]], rank: int, world: int, stats: CommStats,
                   timeout: timedelta, backend: str | None) -> dict[str, Group]:
    """This rank's Group of each dimension in `ranks_by_name` (as `group_ranks` returns them), plus "embed" (this
    rank alone on a middle pipeline stage) and "world"."""
    groups = {}
    for name, all_ranks in ranks_by_name.items():
        for ranks in all_ranks:
            # new_group is collective over the whole world: every rank creates every group, in the same order.
            pg = dist.new_group(ranks, timeout=timeout, backend=backend) if len(ranks) > 1 else None
            if rank in ranks:
                groups[name] = Group(name, ranks, pg, stats, rank, timeout)
    # Middle pipeline stages hold no embedding: their embed group is themselves alone.
    groups.setdefault("embed", Group("embed", [rank], None, stats, rank, timeout))
    world_pg = dist.group.WORLD if world > 1 else None
    groups["world"] = Group("world", list(range(world)), world_pg, stats, rank, timeout)
    nodes = NodeLayout.from_env()
    if nodes.multi_node and world > 1:  # a failed collective names the nodes it waited on
        numbered = nodes.node_of(rank) == nodes.node_rank  # node by node, as many ranks on each (else unknown)
        for group in groups.values():
            group.where = nodes.describe(rank)
            group.nodes = f" on nodes {[nodes.node_of(r) for r in group.ranks]}" if numbered else ""
    return groups
