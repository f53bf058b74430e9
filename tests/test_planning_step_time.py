"""The planner's step-time model: bubble, FLOPs and MFU."""

from __future__ import annotations

import pytest

from tensorpar.models import get_config
from tensorpar.planning import cluster, step_time
from tensorpar.planning.candidates import Candidate

from planning_cases import CONFIGS, GPT2_SHAPE, WORLD  # noqa: F401


def test_step_time_model_bubble_flops_and_mfu():
    cfg = get_config("llama-8b")
    cl = cluster.make_cluster("h100-80gb", 64)
    for v, expected in ((1, 3 / (32 + 3)), (2, 3 / (64 + 3))):
        t = step_time.predict_step_time(cfg, Candidate.of(tp=8, pp=4, dp=2, micro_batch_size=1, virtual_stages=v),
                                        cl, 4096, 64, "mixed-bf16")
        assert t.num_micro_batches == 32 and t.bubble_fraction == pytest.approx(expected)
    one = cluster.make_cluster("h100-80gb", 1)
    small = get_config("llama-1b")
    t = step_time.predict_step_time(small, Candidate.of(), one, 2048, 4, "mixed-bf16")
    from tensorpar.models.flops import train_flops_per_token

    assert t.model_flops == pytest.approx(train_flops_per_token(small, 2048) * 4 * 2048)
    assert t.tp_comm_s == t.dp_comm_s == t.bubble_s == 0
    # the shape model: below the device's best GEMM efficiency (0.803 on H100), and the flat model when asked
    assert 0.3 < t.mfu < 0.803
    flat = cluster.make_cluster("h100-80gb", 1, mfu_ceiling=0.55)
    tf = step_time.predict_step_time(small, Candidate.of(), flat, 2048, 4, "mixed-bf16")
    assert tf.mfu == pytest.approx(flat.mfu_ceiling * tf.compute_s / tf.step_time_s)
    # recomputation costs time, TP over nodes costs more than within
    full = step_time.predict_step_time(small, Candidate.of(recompute="full"), one, 2048, 4, "mixed-bf16")
    assert full.recompute_s > 0 and full.step_time_s > t.step_time_s
    intra = step_time.predict_step_time(cfg, Candidate.of(tp=8, dp=2), cluster.make_cluster("h100", 16), 4096, 32)
    inter = step_time.predict_step_time(cfg, Candidate.of(tp=8, dp=2), cluster.make_cluster("h100", 16, gpus_per_node=4),
                                        4096, 32)
    assert inter.tp_comm_s > 5 * intra.tp_comm_s


def test_pp_overlap_hides_only_the_interleaved_schedules_sends():
    cfg = get_config("llama-8b")
    exposed, hidden = (cluster.make_cluster("h100-80gb", 64, pp_overlap=f) for f in (0.0, 1.0))
    for v in (1, 2):
        lay = Candidate.of(tp=8, pp=4, dp=2, micro_batch_size=1, virtual_stages=v)
        a, b = (step_time.predict_step_time(cfg, lay, c, 4096, 64, "mixed-bf16") for c in (exposed, hidden))
        assert a.pp_comm_s > 0
        if v == 1:  # Megatron-Core overlaps p2p only in the interleaved schedule
            assert b.pp_comm_s == a.pp_comm_s
        else:
            assert b.pp_comm_s == 0 and b.step_time_s < a.step_time_s
    with pytest.raises(Exception, match="p2p overlap must be in"):
        cluster.make_cluster("h100-80gb", 8, pp_overlap=1.5)
