"""Run as the tasks of a Slurm job step: `srun tensorpar train ...`, one task per GPU, no wrapper script.

srun starts every task itself, so a step is a world already launched, as torchrun's is: `adopt_slurm_step`
gives each task torchrun's environment from srun's (RANK from SLURM_PROCID, WORLD_SIZE from
SLURM_STEP_NUM_TASKS, LOCAL_RANK from SLURM_LOCALID, LOCAL_WORLD_SIZE from the step's tasks per node,
GROUP_RANK / GROUP_WORLD_SIZE from SLURM_NODEID and the step's nodes, MASTER_ADDR the first host of the step's
node list), and tensorpar then runs as under torchrun. Task 0 runs on that first host under Slurm's default
(block) distribution, and hosts the rendezvous there.

Only a real step counts: srun sets SLURM_STEP_ID (0, 1, ...), an `salloc` shell or the batch script itself does
not (or is Slurm's special batch / interactive / extern step), though both carry SLURM_PROCID and SLURM_NTASKS.
A step of one task is one process (tensorpar may start local ones itself), and a task that already has RANK
was started by a launcher of its own (torchrun under srun, one per node). TENSORPAR_SLURM=0 turns this off.
MASTER_ADDR and MASTER_PORT already set win; the port defaults to 15000 + the job id's last four digits,
as PyTorch Lightning does, so that the tasks agree on it without talking, plus 10000 x (the step id mod 5), so
that steps of one job running side by side on the same first node (`srun ... &` twice) do not meet.
"""

from __future__ import annotations

import os
import re

from tensorpar.errors import TensorparError

_SPECIAL_STEP = 0xFFFFFFF0  # Slurm numbers its batch, extern and interactive steps from here up
DEFAULT_PORT = 29500


def expand_nodelist(text: str) -> list[str]:
    """The host names of a Slurm node list: 'gpu[01-03,07],cpu3' -> gpu01 gpu02 gpu03 gpu07 cpu3 (what
    `scontrol show hostnames` prints), zero padding kept; several bracket groups in one name multiply out."""
    hosts = []
    for item in _split_outside_brackets(text.strip(), text):
        hosts.extend(_expand_name(item, text))
    return hosts


def _split_outside_brackets(text: str, whole: str) -> list[str]:
    items, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += {"[": 1, "]": -1}.get(ch, 0)
        if depth not in (0, 1):
            raise TensorparError(f"cannot read the Slurm node list {whole!r}: unbalanced brackets")
        if ch == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    items.append(text[start:])
    if depth or not all(items):
        raise TensorparError(f"cannot read the Slurm node list {whole!r}: "
                             f"{'unbalanced brackets' if depth else 'an empty name'}")
    return items


def _expand_name(name: str, whole: str) -> list[str]:
    m = re.fullmatch(r"([^\[\]]*)\[([^\[\]]*)\](.*)", name)
    if m is None:
        return [name]
    head, ranges, rest = m.groups()
    out = []
    for part in ranges.split(","):
        lo, dash, hi = part.partition("-")
        if not lo.isdigit() or (dash and not hi.isdigit()) or (dash and int(hi) < int(lo)):
            raise TensorparError(f"cannot read the Slurm node list {whole!r}: {part!r} is not a number or a "
                                 f"range like 01-04")
        for n in range(int(lo), int(hi if dash else lo) + 1):
            out.extend(f"{head}{n:0{len(lo)}d}{tail}" for tail in _expand_name(rest, whole))
    return out


def tasks_per_node(text: str) -> list[int]:
    """Slurm's tasks-per-node list, one count per node: '2(x3),1' -> [2, 2, 2, 1]."""
    counts = []
    for part in text.split(","):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if m is None:
            raise TensorparError(f"cannot read Slurm's tasks per node {text!r}: expected a list like 2(x3),1")
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    return counts


def in_slurm_step(env) -> bool:
    """Whether this process is one task of a multi-task srun step that nothing else launched (see above)."""
    step = env.get("SLURM_STEP_ID") or env.get("SLURM_STEPID") or ""
    tasks = env.get("SLURM_STEP_NUM_TASKS") or env.get("SLURM_NTASKS") or "1"
    return ("SLURM_PROCID" in env and "RANK" not in env and env.get("TENSORPAR_SLURM") != "0"
            and step.isdigit() and int(step) < _SPECIAL_STEP and tasks.isdigit() and int(tasks) > 1)


def default_port(env) -> int:
    job = env.get("SLURM_JOB_ID", "")
    step = env.get("SLURM_STEP_ID") or env.get("SLURM_STEPID") or "0"
    offset = 10000 * (int(step) % 5) if step.isdigit() else 0  # ports 15000-64999
    return 15000 + int(job[-4:]) + offset if job.isdigit() else DEFAULT_PORT


def slurm_world(env) -> dict[str, str] | None:
    """torchrun's variables for this task of a Slurm step (None outside one)."""
    if not in_slurm_step(env):
        return None
    world = int(env.get("SLURM_STEP_NUM_TASKS") or env["SLURM_NTASKS"])
    rank, node = int(env["SLURM_PROCID"]), int(env.get("SLURM_NODEID", "0"))
    counts_text = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
    if counts_text:
        counts = tasks_per_node(counts_text)
    else:  # a homogeneous step: --ntasks-per-node, or the tasks spread evenly over the step's nodes
        nodes = int(env.get("SLURM_STEP_NUM_NODES") or env.get("SLURM_NNODES") or "1")
        counts = [int(env.get("SLURM_NTASKS_PER_NODE") or world // nodes)] * nodes
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if not env.get("MASTER_ADDR") and not nodelist:
        raise TensorparError("a Slurm step without a node list (SLURM_STEP_NODELIST, SLURM_JOB_NODELIST): set "
                             "MASTER_ADDR to the host of task 0")
    if not 0 <= rank < world or not 0 <= node < len(counts) or sum(counts) != world:
        raise TensorparError(f"inconsistent Slurm step: task {rank} on node {node} of a step of {world} tasks with "
                             f"tasks per node {counts}")
    return {
        "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": env.get("SLURM_LOCALID", "0"),
        "LOCAL_WORLD_SIZE": str(counts[node]), "GROUP_RANK": str(node), "GROUP_WORLD_SIZE": str(len(counts)),
        "MASTER_ADDR": env.get("MASTER_ADDR") or expand_nodelist(nodelist)[0],
        "MASTER_PORT": env.get("MASTER_PORT") or str(default_port(env)),
    }


def task_threads(env, cpus: int, machine_cpus: int) -> int:
    """The CPU threads a task of a Slurm step computes with, where OMP_NUM_THREADS does not say (as torchrun sets it
    for its workers): --cpus-per-task's; else, for tasks bound to `cpus` cores of their own (fewer than the node's
    `machine_cpus`), those; else, unbound tasks sharing the node, its cores split between the node's tasks."""
    if env.get("SLURM_CPUS_PER_TASK", "").isdigit():
        return max(1, int(env["SLURM_CPUS_PER_TASK"]))
    if cpus < machine_cpus:
        return cpus
    return max(1, cpus // int(env.get("LOCAL_WORLD_SIZE") or 1))


def adopt_slurm_step(environ) -> bool:
    """In a task of a Slurm step: set torchrun's variables in `environ` (os.environ, by the command line, before
    anything reads RANK), and OMP_NUM_THREADS unless set (`task_threads`). Whether it did."""
    world = slurm_world(environ)
    if world is not None:
        environ.update(world)
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        environ.setdefault("OMP_NUM_THREADS", str(task_threads(environ, cpus, os.cpu_count() or cpus)))
    return world is not None
