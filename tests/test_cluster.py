"""The GPU catalog (tensorpar.config.hardware) and clusters over it (tensorpar.planning.cluster)."""

from __future__ import annotations

import pytest

from tensorpar.config import hardware
from tensorpar.errors import TensorparError
from tensorpar.planning import cluster


def test_gpu_catalog_aliases_overrides_and_unknown_names():
    assert hardware.get_gpu("H100-SXM") is hardware.get_gpu("h100-80gb")
    assert hardware.get_gpu("a100-40gb").memory_bytes == 40 * hardware.GiB
    with pytest.raises(TensorparError, match="known GPUs: .*a100-80gb.*h100-80gb"):
        hardware.get_gpu("v100")
    cl = cluster.make_cluster("a100-80gb", 64, intra_bandwidth=200e9, inter_latency=1e-5, mfu_ceiling=0.5,
                               memory_gib=75)
    assert cl.intra.bandwidth == 200e9 and cl.inter.latency == 1e-5 and cl.inter.bandwidth == 25e9
    assert cl.mfu_ceiling == 0.5 and cl.memory_bytes == 75 * hardware.GiB and cl.nodes == 8
    # collectives reach link_efficiency of the nominal bandwidth (NCCL-tests bus bandwidths: 70-90%)
    intra, inter = cl.link_for_span(8), cl.link_for_span(16)
    assert intra.bandwidth == pytest.approx(cl.link_efficiency * 200e9) and intra.latency == cl.intra.latency
    assert inter.bandwidth == pytest.approx(cl.link_efficiency * 25e9) and inter.latency == 1e-5
    with pytest.raises(TensorparError, match="whole nodes"):
        cluster.make_cluster("h100", 12)
