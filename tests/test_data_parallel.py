"""Data parallelism and ZeRO-1/2/3: every gradient byte communicated once per step, ZeRO's reduce-scatter
and all-gather volumes, ZeRO-1 optimizer state 1/dp.
"""

import pytest

from layout_runs import param_bytes, run


def test_dp_communicates_every_gradient_byte_once_per_step(pools, config_file):
    # 4 micro-batches per DP rank: gradients must not be communicated per micro-batch
    results = pools(4).run(run, config_file, dp=4, steps=1, warmup_steps=0, global_batch_size=16, micro_batch_size=1)
    for r in results:
        calls, nbytes = r["comm"]["all_reduce/dp"]
        assert nbytes == param_bytes() + 4  # every gradient byte once, plus the logged loss (1 fp32)
        assert not any(key.endswith("/tp") or key.endswith("/pp") for key in r["comm"])


@pytest.mark.parametrize("zero", [1, 2])
def test_zero_reduce_scatters_gradients_and_all_gathers_parameters_once_per_step(pools, config_file, zero):
    """ZeRO-1: one reduce-scatter per bucket and step. ZeRO-2 frees each bucket's full gradients as soon as they
    are reduce-scattered, so with 2 micro-batches per rank it reduce-scatters each bucket exactly twice."""
    per_step = 2 if zero == 2 else 1
    results = pools(4).run(run, config_file, dp=4, zero=zero, steps=1, warmup_steps=0, global_batch_size=16, micro_batch_size=2)
    for r in results:
        rs_calls, rs_bytes = r["comm"]["reduce_scatter/dp"]
        ag_calls, ag_bytes = r["comm"]["all_gather/dp"]
        assert rs_calls == per_step * ag_calls  # one all-gather per bucket
        # the bucket is padded to a multiple of dp: at most dp - 1 extra elements per bucket
        assert param_bytes() <= ag_bytes <= param_bytes() + 4 * 3 * ag_calls
        assert rs_bytes == per_step * ag_bytes
        assert r["comm"]["all_reduce/dp"] == (2, 8)  # the grad-norm and the logged loss scalars


def test_zero1_optimizer_state_is_one_dp_th(pools, config_file):
    unsharded = pools(1).run(run, config_file, steps=1, warmup_steps=0)[0]["optimizer_state_bytes"]
    assert unsharded == 2 * param_bytes()  # AdamW: two fp32 moments per parameter
    for r in pools(4).run(run, config_file, dp=4, zero=1, steps=1, warmup_steps=0):
        sharded = r["optimizer_state_bytes"]
        assert unsharded / 4 <= sharded <= unsharded / 4 + 2 * 4 * 3  # padding: < dp elements per bucket
