"""The peak MFU divides by: a GPU's figure from the catalog, else a measured matmul."""

import pytest

from harness import mesh  # noqa: F401  (imported so workers share the harness module)


@pytest.mark.parametrize("device_name,key", [("NVIDIA H100 80GB HBM3", "h100-80gb"), ("NVIDIA H200", "h200"),
                                             ("NVIDIA A100-SXM4-40GB", "a100-40gb"), ("NVIDIA A100-SXM4-80GB", "a100-80gb")])
def test_mfu_peak_of_a_gpu_comes_from_the_planner_catalog(monkeypatch, device_name, key):
    import torch

    from tensorpar.config.hardware import GPUS
    from tensorpar.training.mfu import peak_flops

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: device_name)
    for dtype in ("bf16", "fp32"):
        assert peak_flops(torch.device("cuda", 0), dtype) == (GPUS[key].peak(dtype), f"{key} datasheet")
