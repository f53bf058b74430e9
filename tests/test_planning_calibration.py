"""The device curves (GEMM efficiency by shape) and `tensorpar calibrate` / `plan --hardware`."""

from __future__ import annotations

import json
import types

import pytest
import torch

from tensorpar.config.hardware import get_gpu
from tensorpar.errors import TensorparError
from tensorpar.planning import calibration
from tensorpar.planning.devices import CURVES, curve_for, gemm_time


@pytest.mark.parametrize("gpu", ["a100-80gb", "h100-80gb", "h200", "b200", "mi300x"])
def test_gemm_curve_large_gemms_reach_the_devices_best_and_small_ones_fall_far_below(gpu):
    spec, curve = get_gpu(gpu), curve_for(gpu)
    peak, hbm = spec.peak("bf16"), spec.hbm_bandwidth

    def eff(m, n, k):
        return 2.0 * m * n * k / gemm_time(m, n, k, peak, hbm, curve) / peak

    big = eff(16384, 16384, 16384)
    assert curve.efficiency("bf16") * 0.9 < big <= curve.efficiency("bf16")
    assert eff(4096, 4096, 128) < 0.6 * big  # short k: every tile's prologue and epilogue
    assert eff(128, 128, 4096) < 0.1 * big  # one wave of a few tiles: most SMs idle
    assert eff(16, 16384, 16384) < 0.2 * big  # skinny: memory-bound
    assert curve.source  # every curve says where it came from


def test_every_curve_names_its_source_and_unknown_devices_are_refused():
    assert all(c.source for c in CURVES.values())
    with pytest.raises(TensorparError, match="tensorpar calibrate"):
        curve_for("tpu-v5")


def test_fit_link_recovers_alpha_and_beta():
    alpha, beta = 30e-6, 2e9
    samples = [(s, b, s * alpha + b / beta) for s in (1, 2, 6) for b in (1e3, 1e5, 1e7)]
    link = calibration._fit_link(samples)
    assert link.latency == pytest.approx(alpha, rel=1e-6) and link.bandwidth == pytest.approx(beta, rel=1e-6)


def test_calibrate_writes_a_profile_that_plan_hardware_uses(tmp_path, capsys):
    prof = calibration.calibrate("cpu", dtypes=("fp32",), shapes=[(32, 32, 32), (128, 128, 128), (256, 64, 128)],
                                 measure_comm=False)
    assert prof["peak_flops"]["fp32"] > 0 and prof["hbm_bandwidth"] > 0 and len(prof["gemms"]["fp32"]) == 3
    assert len(prof["curves"]["fp32"]["attention_efficiency"]) == 2
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(prof))
    spec, curve = calibration.load_profile(str(path))
    assert spec.peak("fp32") == prof["peak_flops"]["fp32"]
    assert curve.efficiency("fp32") == prof["curves"]["fp32"]["gemm_efficiency"] <= 1.0
    # the host, for the offloading levers: a CPU's copies stay in its memory (one copy, both "directions"), its
    # AdamW steps there
    link = prof["host_link"]
    assert link["device_to_host"] == link["host_to_device"] == link["bandwidth"] > 0
    assert prof["host_optimizer_bandwidth"] > 0
    assert spec.host_link.bandwidth == prof["host_link"]["bandwidth"]
    assert spec.host_optimizer_bandwidth == prof["host_optimizer_bandwidth"]
    assert spec.host_link_back.bandwidth == prof["host_link"]["bandwidth"]
    cuda = tmp_path / "cuda.json"  # a GPU's link measured each way (the lent H200's copies): each direction its own
    cuda.write_text(json.dumps({**prof, "device": "cuda", "host_link": {**link, "device_to_host": 53e9,
                                                                          "host_to_device": 35e9}}))
    spec_cuda = calibration.load_profile(str(cuda))[0]
    assert (spec_cuda.host_link.bandwidth, spec_cuda.host_link_back.bandwidth) == (53e9, 35e9)
    older = tmp_path / "older.json"  # written before the host was measured: derived from the CPU's own bandwidth
    older.write_text(json.dumps({k: v for k, v in prof.items() if not k.startswith("host_")}))
    spec_older = calibration.load_profile(str(older))[0]
    assert spec_older.host_link.bandwidth == prof["hbm_bandwidth"] / 2
    assert spec_older.host_optimizer_bandwidth == prof["hbm_bandwidth"]
    older.write_text(json.dumps({**json.loads(older.read_text()), "device": "cuda"}))  # a GPU's: PCIe 5.0 x 0.8
    assert calibration.load_profile(str(older))[0].host_link.bandwidth == pytest.approx(64e9 * 0.8)
    from tensorpar.cli import main

    assert main(["plan", "--model", "tiny", "--gpus", "2", "--gpus-per-node", "2", "--hardware", str(path),
                 "--seq-len", "64", "--global-batch-size", "4", "--precision", "tensorpar-fp32", "--json",
                 "--top", "1"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert rows[0]["feasible"] and rows[0]["step_time_s"] > 0
    assert spec.peak_stand_ins == {"bf16": "fp32", "tf32": "fp32", "fp8": "fp32"}
    assert main(["plan", "--model", "tiny", "--gpus", "2", "--gpus-per-node", "2", "--hardware", str(path),
                 "--seq-len", "64", "--global-batch-size", "4", "--top", "1"]) == 0  # bf16, which fp32 stands in for
    assert "(bf16: fp32's measured rate, bf16 not calibrated)" in capsys.readouterr().out
    assert main(["plan", "--model", "tiny", "--gpus", "2", "--hardware", str(tmp_path / "missing.json"),
                 "--seq-len", "64", "--global-batch-size", "4"]) == 2
    assert "tensorpar calibrate --out" in capsys.readouterr().err


def test_reduce_scatter_is_fitted_and_priced_as_a_ring_on_gloo_too():
    # tensorpar's gloo reduce-scatter is an all-to-all + local sum (not gloo's own, a whole all-reduce of a clone):
    # it moves (n-1)/n of its input once, as NCCL's ring does, so it costs half an all-reduce on both libraries
    from tensorpar.config.hardware import GPUSpec, Link
    from tensorpar.planning.cluster import make_cluster
    from tensorpar.planning.collective_cost import Collective, collectives_time
    from tensorpar.planning.candidates import Candidate

    assert calibration._steps_and_bytes("reduce_scatter", 1000, 2) == (1, 500)
    assert calibration._steps_and_bytes("all_reduce", 1000, 2) == (2, 1000)
    link = Link(1e9, 1e-3)
    layout = Candidate.of(tp=2, sequence_parallel=True)
    rs, ar = [Collective("reduce_scatter", "tp", 1 << 20)], [Collective("all_reduce", "tp", 1 << 20)]
    for lib in ("gloo", "nccl"):
        spec = GPUSpec(f"cpu-{lib}", 1 << 30, {"fp32": 1e11, "bf16": 1e11}, 1e10, link, link, "test", lib)
        cluster = make_cluster(spec, 2, gpus_per_node=2, curve=curve_for("cpu"), link_efficiency=1.0)
        assert collectives_time(rs, cluster, layout) == pytest.approx(collectives_time(ar, cluster, layout) / 2), lib


def test_gloo_collectives_do_not_hide_behind_compute_by_default():
    # gloo's transfers and reductions run on the cores the ranks compute on: no data-parallel overlap unless asked
    from tensorpar.config.hardware import GPUSpec, Link
    from tensorpar.planning.cluster import DEFAULT_OVERLAP, make_cluster

    link = Link(1e9, 1e-3)
    specs = {lib: GPUSpec(f"cpu-{lib}", 1 << 30, {"fp32": 1e11}, 1e10, link, link, "test", lib) for lib in ("gloo", "nccl")}
    assert make_cluster(specs["gloo"], 2, gpus_per_node=2, curve=curve_for("cpu")).overlap == 0.0
    assert make_cluster(specs["gloo"], 2, gpus_per_node=2, curve=curve_for("cpu"), overlap=0.3).overlap == 0.3
    assert make_cluster(specs["nccl"], 2, gpus_per_node=2, curve=curve_for("cpu")).overlap == DEFAULT_OVERLAP


def test_fit_curve_recovers_the_level_below_the_best_measurement():
    from tensorpar.planning.devices import DeviceCurve, gemm_time

    truth = DeviceCurve("truth", {"fp32": 0.8, "bf16": 0.8}, 2, 64, 64, 16.0, 0.5, 5e-6, 1.0)
    peak, hbm = 100e9, 20e9
    shapes = [(m, n, k) for m in (64, 256, 1024) for n in (64, 256, 1024) for k in (64, 256, 1024)]
    points = [{"m": m, "n": n, "k": k, "seconds": gemm_time(m, n, k, peak, hbm, truth, "fp32")} for m, n, k in shapes]
    fit = calibration.fit_curve("fit", points, peak, hbm, 2, "fp32")
    assert fit.efficiency("fp32") == pytest.approx(0.8)
    assert (fit.tile_m, fit.k_overhead, fit.wave_quantization, fit.launch_s) == (64, 16.0, 0.5, 5e-6)


def test_an_unmeasured_dtype_takes_the_peak_and_level_it_is_aliased_to(tmp_path):
    prof = calibration.calibrate("cpu", dtypes=("fp32",), shapes=[(32, 32, 32), (128, 128, 128)], measure_comm=False)
    prof["peak_flops"]["bf16"] = prof["peak_flops"]["fp32"] / 4
    prof["curves"]["bf16"] = {**prof["curves"]["fp32"], "gemm_efficiency": 0.5}
    prof["curves"]["fp32"]["gemm_efficiency"] = 0.9
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(prof))
    spec, curve = calibration.load_profile(str(path))
    assert (spec.peak("tf32"), curve.efficiency("tf32")) == (spec.peak("fp32"), 0.9)
    assert (spec.peak("fp8"), curve.efficiency("fp8")) == (spec.peak("bf16"), 0.5)


@pytest.mark.skipif(not calibration.fp8_supported(torch.device("cpu")), reason="this PyTorch has no CPU _scaled_mm")
def test_fp8_gemms_and_a_sustained_run_are_measured_and_the_kept_rate_scales_the_level(tmp_path):
    # fp8 through torch._scaled_mm (on CPU too, so this runs here); --sustain runs the best shape back to back
    prof = calibration.calibrate("cpu", dtypes=("fp32", "fp8"), shapes=[(32, 32, 32), (64, 64, 64)],
                                 measure_comm=False, sustain_s=0.3)
    assert prof["peak_flops"]["fp8"] > 0 and len(prof["gemms"]["fp8"]) == 2
    assert "attention_efficiency" not in prof["curves"]["fp8"]  # fp8 linears run attention in bf16
    kept = prof["sustained"]["fp8"]
    assert kept["seconds"] >= 0.3 and len(kept["windows"]) >= 10
    assert kept["swept_flops_per_s"] == max(p["flops_per_s"] for p in prof["gemms"]["fp8"])
    prof["sustained"]["fp8"]["ratio"] = 0.8
    prof["sustained"]["fp32"]["ratio"] = 1.0
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(prof))
    spec, curve = calibration.load_profile(str(path))
    assert curve.efficiency("fp8") == pytest.approx(0.8 * prof["curves"]["fp8"]["gemm_efficiency"])
    assert curve.efficiency("fp32") == prof["curves"]["fp32"]["gemm_efficiency"]
    assert spec.peak("fp8") == prof["peak_flops"]["fp8"]


def test_calibrate_rejects_an_unknown_dtype_and_a_sustained_run_over_several_processes():
    with pytest.raises(TensorparError, match="unknown dtype.*fp4"):
        calibration.calibrate("cpu", dtypes=("fp4",), measure_comm=False)
    with pytest.raises(TensorparError, match="--sustain measures one process"):
        calibration.calibrate("cpu", ranks=2, sustain_s=1.0)
    with pytest.raises(TensorparError, match="--sustain must be"):
        calibration.calibrate("cpu", sustain_s=-1.0, measure_comm=False)
    with pytest.raises(TensorparError, match="together with bf16"):
        calibration.calibrate("cpu", dtypes=("fp8",), measure_comm=False)


def test_a_gemm_that_slows_under_load_keeps_the_share_of_its_swept_rate(monkeypatch):
    # a stand-in GEMM on a clock of its own (a loaded machine stretches real sleeps): 1 ms per call for its first
    # 0.15 s, then 2 ms (a GPU whose clock has dropped by half)
    clock = [0.0]

    def slowing(device, dtype, m, n, k):
        def call():
            clock[0] += 0.001 if clock[0] < 0.15 else 0.002
        return call

    monkeypatch.setattr(calibration, "gemm_fn", slowing)
    monkeypatch.setattr(calibration, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    swept = 2.0 * 64 ** 3 / 0.001
    kept = calibration.measure_sustained(torch.device("cpu"), torch.float32, (64, 64, 64), 0.6, swept)
    assert kept["first_flops_per_s"] == pytest.approx(swept) and kept["seconds"] >= 0.6
    assert kept["ratio"] == pytest.approx(0.5)
    assert kept["ratio"] == pytest.approx(kept["last_flops_per_s"] / swept)
