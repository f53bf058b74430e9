"""HSDP (--dp-replicate): ZeRO sharded within replicas, the shards' gradients all-reduced across them. Trajectories
and weights equal one process; the groups and the bytes each moves are the ones the layout says."""

import pytest

from tensorpar.distributed.mesh import group_ranks

from layout_runs import assert_same_training, reference, run

from conftest import TINY8  # noqa: F401  (the config file fixture's model)

SETTINGS = dict(seed=3, seq_len=16, micro_batch_size=1)


def test_hsdp_groups_split_dp_into_replicas_of_consecutive_ranks():
    groups = group_ranks(tp=2, pp=1, dp=4, dp_replicate=2)
    assert groups["dp_shard"] == [[0, 2], [4, 6], [1, 3], [5, 7]]  # a replica: consecutive DP ranks (a node's)
    assert groups["dp_replicate"] == [[0, 4], [2, 6], [1, 5], [3, 7]]  # the same shard in each replica
    for shard in groups["dp_shard"]:  # every DP group is split into whole replicas
        assert any(set(shard) <= set(dp) for dp in groups["dp"])


@pytest.mark.parametrize("layout", [dict(dp=4, zero=1), dict(dp=4, zero=3), dict(dp=4, zero=2),
                                    dict(tp=2, dp=4, zero=3, sequence_parallel=True)],
                         ids=["dp4-zero1", "dp4-zero3", "dp4-zero2", "tp2-dp4-zero3-sp"])
def test_hsdp_trains_like_one_process(pools, config_file, layout):
    """dp 4 as 2 replicas x 2 shards: every step's loss and grad norm and the final weights of one process (1e-4),
    with collectives on both HSDP groups."""
    world = layout.get("tp", 1) * layout["dp"]
    results = pools(world).run(run, config_file, **SETTINGS, **layout, dp_replicate=2)
    assert_same_training(results, reference(pools, config_file, **SETTINGS))
    comm = results[0]["comm"]
    assert any(k.endswith("/dp_shard") for k in comm) and any(k.endswith("/dp_replicate") for k in comm), comm


@pytest.mark.parametrize("zero", [1, 2, 3])
def test_hsdp_of_a_moe_model_trains_like_one_process(pools, zero):
    """tiny-moe (ep 1) at dp 4 as 2 replicas x 2 shards: the routed experts' buckets (ZeRO-3: units) are sharded
    over the whole expert-DP group, so their gradients are summed once, never again across the replicas (ZeRO-1
    and 2 once doubled them)."""
    results = pools(4).run(run, "tiny-moe", **SETTINGS, dp=4, zero=zero, dp_replicate=2)
    assert_same_training(results, reference(pools, "tiny-moe", **SETTINGS))


def test_hsdp_that_cannot_run_is_refused_before_any_rank(cli):
    code, _, err = cli("train", "--dp", "4", "--zero", "1", "--dp-replicate", "3", "--steps", "1")
    assert code != 0 and "--dp-replicate 3 must divide the data-parallel size 4" in err and "[1, 2, 4]" in err, err
    code, _, err = cli("train", "--dp", "4", "--dp-replicate", "2", "--steps", "1")
    assert code != 0 and "--zero 0 shards nothing" in err, err


def check_hsdp_step_comm(zero):
    """One training step of tiny-gpt2 at dp 4 as 2 replicas x 2 shards: the bytes counted per (op, group)."""
    import torch

    from tensorpar.data_parallel import data_parallel_optimizer
    from tensorpar.models import Transformer, get_config
    from tensorpar.planning import collective_cost, communication
    from tensorpar.planning.candidates import Candidate

    from harness import mesh

    cfg = get_config("tiny-gpt2")
    m = mesh(tp=1, dp=4, dp_replicate=2)
    model = Transformer(cfg, m, seed=1)
    model.train()
    stage = {} if zero == 3 else {"bucket_bytes": 64 * 1024}
    opt = data_parallel_optimizer(model, m, lr=1e-3, weight_decay=0.1, zero=zero, **stage)
    torch.manual_seed(m.dp_rank)
    B, S, micro_batches = 2, 16, 2
    m.stats.reset()
    opt.begin_step(micro_batches)
    for _ in range(micro_batches):
        ids = torch.randint(0, cfg.vocab_size, (B, S))
        (model(ids, ids.roll(-1, 1)) / micro_batches).backward()
    opt.finish_backward()
    opt.clip_and_step(1.0)
    m.dp_group.all_reduce(torch.zeros(()))  # the trainer's loss average
    counted = {k: c.bytes for k, c in m.stats.snapshot().items()}
    layout = Candidate.of(dp=4, micro_batch_size=B, zero=zero, dp_replicate=2)
    colls = communication.step_collectives(cfg, layout, S, micro_batches, bucket_bytes=64 * 1024)
    return counted, collective_cost.sum_bytes(colls)


@pytest.mark.parametrize("zero", [1, 3])
def test_hsdp_step_comm_equals_the_planners(pools, zero):
    for rank, (counted, predicted) in enumerate(pools(4).run(check_hsdp_step_comm, zero)):
        assert counted == predicted, f"rank {rank}: counted {counted} != predicted {predicted}"
        assert ("all_reduce", "dp_replicate") in counted and ("reduce_scatter", "dp_shard") in counted


def test_an_hsdp_checkpoint_resumes_at_another_layout(pools, config_file, tmp_path):
    """Checkpoints are dense: an HSDP run's (one writer per replica's shards) continues at dp 2 ZeRO-1 as the
    straight run does."""
    import os

    save = str(tmp_path / "ckpt")
    straight = reference(pools, config_file, **SETTINGS)["trajectory"]
    pools(4).run(run, config_file, **SETTINGS, dp=4, zero=3, dp_replicate=2, save=save, stop_after=2)
    resumed = pools(2).run(run, config_file, **SETTINGS, dp=2, zero=1, resume=os.path.join(save, "step-000002"))[0]
    for (loss, gn), (ref, ref_gn) in zip(resumed["trajectory"], straight[2:], strict=True):
        assert abs(loss - ref) <= 1e-4 * ref and abs(gn - ref_gn) <= 1e-4 * ref_gn, (loss, ref)
