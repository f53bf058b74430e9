"""The tp x pp x dp rank layout: coordinates, group membership, and layouts that cannot work."""

import os

import pytest
import torch

import tensorpar
from tensorpar.distributed.mesh import group_ranks
from tensorpar.errors import LayoutError
from tensorpar.layout import require, resolve_dp
from tensorpar.layout.rules import fold_problem

from harness import mesh


def test_megatron_rank_order_tp_fastest_then_dp_then_pp():
    groups = group_ranks(tp=2, pp=2, dp=2)
    assert groups["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert groups["dp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert groups["pp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]


def test_expert_groups_fold_expert_tp_fastest_then_ep_then_expert_dp():
    groups = group_ranks(tp=2, pp=2, dp=4, ep=2, expert_tp=2)  # stages of 8 ranks: 0-7 and 8-15
    assert groups["expert_tp"][:4] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert groups["ep"][:4] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert groups["edp"][:4] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert groups["edp"][4:] == [[8, 12], [9, 13], [10, 14], [11, 15]]
    plain = group_ranks(tp=2, pp=1, dp=2, ep=4)  # expert-TP 1: what it was before expert-TP
    assert plain["ep"] == [[0, 1, 2, 3]] and plain["edp"] == [[0], [1], [2], [3]]
    with pytest.raises(LayoutError, match=r"expert_tp=4 x ep=2 = 8 does not fold onto the 4 ranks.*\[1, 2\]"):
        require(fold_problem(2, 1, 2, 2, expert_tp=4))


@pytest.mark.parametrize(
    "world,tp,pp,dp,expected",
    [(4, 2, 1, None, (2, 1, 2)), (4, 4, 1, None, (4, 1, 1)), (8, 2, 2, None, (2, 2, 2)), (4, 1, 4, 1, (1, 4, 1))],
)
def test_resolve_layout(world, tp, pp, dp, expected):
    assert (tp, pp, resolve_dp(world, tp, 1, pp, dp)) == expected


@pytest.mark.parametrize(
    "world,tp,pp,dp,needle",
    [
        (4, 3, 1, None, "tp=3 x pp=1 does not fit world size 4"),
        (4, 2, 1, 3, "tp=2 x pp=1 x dp=3 = 6 processes, but the world has 4"),
        (4, 0, 1, None, "tp must be a positive integer"),
    ],
)
def test_impossible_layouts_name_the_numbers(world, tp, pp, dp, needle):
    with pytest.raises(LayoutError, match=needle.replace("*", r"\*")):
        resolve_dp(world, tp, 1, pp, dp)


def test_world_of_one_without_a_launcher():
    m = tensorpar.init_mesh(tp=1)
    assert (m.world_size, m.tp_size, m.pp_size, m.dp_size, m.tp_rank) == (1, 1, 1, 1, 0)
    assert m.device == torch.device("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(LayoutError):
        tensorpar.init_mesh(tp=2)


def test_a_run_refuses_a_mesh_of_another_layout(config_file):
    """train(options, mesh=...) trains on the caller's mesh only if it is the run's layout."""
    from tensorpar.training import TrainOptions, run_training, validate

    one = tensorpar.init_mesh(tp=1)
    with pytest.raises(LayoutError, match=r"the mesh given has cp 1 \(wanted 2\)"):
        one.check_layout(tp=1, pp=1, dp=1, cp=2)
    with pytest.raises(LayoutError, match=r"ep None \(wanted 2\).*init_mesh\(tp=1, pp=1, dp=1, cp=1, ep=2"):
        one.check_layout(tp=1, pp=1, dp=1, ep=2)
    run = validate(TrainOptions(model=config_file, tp=2, steps=1, seq_len=16, global_batch_size=2, progress=False,
                                device="cpu"), world_size=2)
    with pytest.raises(LayoutError, match=r"the mesh given has tp 1 \(wanted 2\)"):
        run_training(run, mesh=one)


def test_more_ranks_than_gpus_on_a_node_is_refused_before_the_rendezvous(monkeypatch):
    # NCCL would refuse two ranks on one GPU only once every rank has reached init_process_group.
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    with pytest.raises(LayoutError, match="2 processes on this node but 1 GPU visible: NCCL needs one GPU per "
                                          "process. Run at most 1 process per node, or pass --device cpu"):
        tensorpar.init_mesh(tp=2, device="cuda")


def test_nccl_on_a_cpu_run_is_refused_before_any_rank_starts(cli):
    code, _, err = cli("train", "--tp", "2", "--device", "cpu", "--backend", "nccl", "--steps", "1")
    assert code == 2 and "--backend nccl needs CUDA devices, and this run's device is cpu" in err, err


def check_membership(tp, pp, dp):
    m = mesh(tp=tp, pp=pp, dp=dp)
    seen = {}
    for name in ("tp", "pp", "dp"):
        g = getattr(m, f"{name}_group")
        seen[name] = (g.all_gather_object(m.rank), g.ranks, getattr(m, f"{name}_rank"), getattr(m, f"{name}_size"))
    return m.rank, seen


@pytest.mark.parametrize("tp,pp,dp", [(2, 1, 2), (2, 2, 1), (1, 2, 2), (4, 1, 1), (1, 1, 4)])
def test_groups_hold_the_ranks_the_layout_says(pools, tp, pp, dp):
    expected = group_ranks(tp, pp, dp)
    for rank, seen in pools(4).run(check_membership, tp, pp, dp):
        for name, (gathered, ranks, group_rank, size) in seen.items():
            mine = next(g for g in expected[name] if rank in g)
            assert gathered == mine == ranks, (name, gathered, mine)
            assert group_rank == mine.index(rank) and size == len(mine)
        # coordinates agree with rank = pp*(dp*tp) + dp*tp + tp
        assert rank == seen["pp"][2] * dp * tp + seen["dp"][2] * tp + seen["tp"][2]


def check_meshes_leave_no_threads(n: int):
    import torch

    import tensorpar

    def threads():
        return len(os.listdir(f"/proc/{os.getpid()}/task"))

    before = threads()
    for _ in range(n):
        m = tensorpar.init_mesh(tp=2, dp=1, timeout=30)
        m.tp_group.all_reduce(torch.ones(3))
        m.destroy()
    return before, threads()


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads through /proc")
def test_a_mesh_in_a_running_world_destroys_the_groups_it_created(pools):
    """Runs inside one set of processes (torchrun's caller, a test's process pool) must not pile up gloo threads."""
    for before, after in pools(2).run(check_meshes_leave_no_threads, 5):
        assert after <= before, f"{after - before} threads left behind by 5 meshes"


@pytest.mark.parametrize("command", [["train", "--steps", "1"], ["demo", "--tp", "2"]])
def test_a_device_this_machine_lacks_is_refused_before_any_rank_starts(cli, monkeypatch, command):
    """`--device cuda` without a visible GPU (or a CPU-only torch), and a device torch does not know, were tracebacks
    from torch.cuda.set_device or torch.device in the ranks (train: in its checks)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    code, _, err = cli(*command, "--device", "cuda")
    assert code == 2 and "--device cuda: no CUDA device is visible to this process" in err, err
    assert "drop --device to run on the CPU" in err and len(err.strip().splitlines()) == 1, err
    code, _, err = cli(*command, "--device", "gpu")
    assert code == 2 and "--device gpu: not a torch device; use cpu, cuda or cuda:N" in err, err
    assert len(err.strip().splitlines()) == 1, err


def test_build_transformer_refuses_a_layout_the_mesh_was_not_built_for():
    """A layout of other sizes than the mesh's built half a model (pp=2 on a world of one: the first stage's layers,
    returning hidden states where logits were expected) without a word."""
    from tensorpar.layout import ParallelLayout
    from tensorpar.models import get_config
    from tensorpar.models.build import build_transformer

    one, cfg = tensorpar.init_mesh(tp=1), get_config("tiny")
    with pytest.raises(LayoutError, match=r"the mesh given has pp 1 \(wanted 2\)"):
        build_transformer(cfg, one, ParallelLayout(pp=2))
    with pytest.raises(LayoutError, match=r"the mesh given has tp 1 \(wanted 2\)"):
        build_transformer(cfg, one, ParallelLayout(tp=2))
    assert build_transformer(cfg, one, ParallelLayout(zero=1)).cfg is cfg  # what the mesh does not fix is free


def test_init_mesh_names_a_device_it_cannot_use(monkeypatch):
    """init_mesh(device="gpu") raised torch's RuntimeError listing every device type, and device="cuda" on a
    machine without CUDA an AttributeError from deep inside torch (the command line checked both, Python did not)."""
    with pytest.raises(LayoutError, match=r"device 'gpu' is not a torch device; use cpu, cuda or cuda:N"):
        tensorpar.init_mesh(device="gpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(LayoutError, match=r"device cuda:0: no CUDA device is visible to this process"):
        tensorpar.init_mesh(device="cuda")


def test_build_transformer_leaves_the_callers_random_state_as_it_was():
    """build_transformer seeded torch's global generator with its `seed`: random data a caller drew after building
    a model repeated what torch.manual_seed(0) gives, whatever the caller had seeded."""
    from tensorpar.models import get_config
    from tensorpar.models.build import build_transformer

    one, cfg = tensorpar.init_mesh(tp=1), get_config("tiny")
    torch.manual_seed(5)
    expected = torch.rand(4)
    torch.manual_seed(5)
    first = build_transformer(cfg, one, seed=0)
    assert torch.equal(torch.rand(4), expected)
    second = build_transformer(cfg, one, seed=0)  # the same weights from the same seed, whatever the state
    assert all(torch.equal(a, b) for a, b in zip(first.parameters(), second.parameters()))
