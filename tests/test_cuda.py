"""Checks that need CUDA GPUs: run with TENSORPAR_TEST_CUDA=1 on a GPU machine (conftest.py hides GPUs from
the rest of the suite, which is the CPU/gloo suite); they skip elsewhere.

    TENSORPAR_TEST_CUDA=1 python -m pytest -q tests/test_cuda.py
"""

import json
import os
import pickle
import subprocess
import sys

import pytest
import torch

import tensorpar.training.session as session
from tensorpar.training import TrainOptions

from harness import train
from layout_runs import BASE, assert_same_training, run

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (TENSORPAR_TEST_CUDA=1)")


def _on_cpu(result):
    return {**result, "state": {k: v.float().cpu() for k, v in result["state"].items()}}


@pytest.fixture(scope="module")
def cpu_reference(config_file):
    return run(config_file, device="cpu")


@pytest.fixture(scope="module")
def cpu_reassociated(config_file):
    """The CPU run with micro-batches of 2: which steps and weights float noise decides on the CPU."""
    return run(config_file, device="cpu", micro_batch_size=2)


_gpu_runs: dict = {}


def gpu_reference(model):
    """(one process's run of `model` on the GPU, the same run with its gradient sums in another order: micro-batches
    of 2 instead of 1), computed once per module. Comparisons on the GPU leave out, as `layout_runs.reassociated`
    does on the CPU, what float noise decides: AdamW's first full step moves every weight by about lr whatever the
    size of its gradient, so a gradient at rounding level flips a step's sign (eager and compiled blocks on one GPU
    differ by 1.6e-4 in step 3's grad norm of the 8-layer model for that reason)."""
    if model not in _gpu_runs:
        _gpu_runs[model] = (_on_cpu(run(model, device="cuda")), _on_cpu(run(model, device="cuda", micro_batch_size=2)))
    return _gpu_runs[model]


def test_one_gpu_trains_what_the_cpu_trains(config_file, cpu_reference, cpu_reassociated):
    # fp32 without TF32 (PyTorch's default for matmuls): the same trajectory and weights as the CPU run, but for what
    # the rounding of either device decides (cuBLAS and cuDNN sum in other orders than the CPU's kernels).
    assert not torch.backends.cuda.matmul.allow_tf32
    on_gpu, gpu_floor = gpu_reference(config_file)
    assert_same_training([on_gpu], cpu_reference, floor=[(cpu_reference, cpu_reassociated), (on_gpu, gpu_floor)])


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_half_precision_on_a_gpu_follows_fp32(config_file, cpu_reference, dtype):
    result = run(config_file, device="cuda", dtype=dtype)
    for step, ((loss, _), (ref, _)) in enumerate(zip(result["trajectory"], cpu_reference["trajectory"]), 1):
        assert abs(loss - ref) <= 3e-2 * ref, f"{dtype} step {step}: loss {loss} vs fp32 {ref}"


def test_compiled_blocks_on_a_gpu_train_what_eager_blocks_train(config_file, cpu_reference, cpu_reassociated):
    # --compile: each block through inductor's GPU kernels (fused elementwise chains, reordered reductions). Those
    # reorder the forward's own sums, which a micro-batch split on the GPU does not: on the H200 step 3's grad norm
    # moved by 1.6e-4 compiled (as between the GPU and the CPU) where the GPU's micro-batch split moved it by less
    # than 1e-5. Which steps are at float noise is the trajectory's property (AdamW's first step turning gradients at
    # rounding level into steps of O(lr)), so the floor is the device comparison's: the noise either device shows.
    eager, floor = gpu_reference(config_file)
    assert_same_training([_on_cpu(run(config_file, device="cuda", compile=True))], eager,
                         floor=[(eager, floor), (cpu_reference, cpu_reassociated)])


def test_mfu_divides_by_the_datasheet_peak_of_a_known_gpu():
    from tensorpar.training.mfu import peak_flops

    name = torch.cuda.get_device_name(0)
    peak, source = peak_flops(torch.device("cuda", 0), "bf16")
    if not any(k in name for k in ("H100", "H200", "A100", "B200")):
        pytest.skip(f"{name} is not in the catalog: its peak is measured")
    assert source.endswith("datasheet") and peak > 1e14


def _train(config_file, tmp_path, name, *args, **env):
    metrics = tmp_path / f"{name}.jsonl"
    cmd = [sys.executable, "-m", "tensorpar", "train", "--model", config_file, "--device", "cuda", "--steps", "6",
           "--seed", "5", "--global-batch-size", "8", "--micro-batch-size", "2", "--seq-len", "16",
           "--metrics", str(metrics), "--out-dir", str(tmp_path / name), "--no-progress", "--sample-tokens", "0",
           *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=dict(os.environ, **env))
    return proc, metrics


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (NCCL puts one rank per GPU)")
@pytest.mark.parametrize("layout", [["--tp", "2"], ["--tp", "2", "--sequence-parallel"], ["--pp", "2"],
                                    ["--dp", "2", "--zero", "1"]], ids=["tp2", "tp2-sp", "pp2", "dp2-zero1"])
def test_nccl_layouts_train_what_one_gpu_trains(config_file, tmp_path, layout):
    ref, ref_metrics = _train(config_file, tmp_path, "one", "--tp", "1")
    assert ref.returncode == 0, ref.stderr
    proc, metrics = _train(config_file, tmp_path, "many", *layout)
    assert proc.returncode == 0, proc.stderr
    for a, b in zip(map(json.loads, metrics.read_text().splitlines()), map(json.loads, ref_metrics.read_text().splitlines())):
        assert abs(a["loss"] - b["loss"]) <= 1e-4 * b["loss"], (a, b)


@pytest.mark.skipif(torch.cuda.device_count() != 1, reason="checks the one-GPU refusal")
def test_two_ranks_on_one_gpu_fail_fast_with_a_clear_message(config_file, tmp_path):
    proc, _ = _train(config_file, tmp_path, "two", "--tp", "2")
    assert proc.returncode != 0
    assert "2 processes on this node but 1 GPU visible" in proc.stderr, proc.stderr


def _snapshot_run(config_file, out_dir, huge_allocation_at_step=None):
    """Train on one GPU with --memory-snapshot; with `huge_allocation_at_step`, a forward hook of this test asks
    the allocator for 1 TiB in that step's forward: a real out-of-memory error."""
    build = session.build_model

    def with_hook(run, mesh):
        model, tokenizer = build(run, mesh)
        forwards = [0]

        def hook(*_):
            forwards[0] += 1
            if forwards[0] == huge_allocation_at_step:
                torch.empty(2**40, dtype=torch.uint8, device=mesh.device)

        model.register_forward_pre_hook(hook)
        return model, tokenizer

    session.build_model = with_hook
    try:
        options = {**BASE, "global_batch_size": 2, "micro_batch_size": 2, "return_state": False, "device": "cuda",
                   "memory_snapshot": True, "out_dir": str(out_dir)}
        return train(TrainOptions(model=config_file, **options))
    finally:
        session.build_model = build


def _load_snapshot(out_dir):
    with open(out_dir / "memory" / "rank0.pickle", "rb") as f:
        snapshot = pickle.load(f)
    return [entry["action"] for trace in snapshot["device_traces"] for entry in trace], snapshot


def test_memory_snapshot_holds_the_allocator_history_of_the_peak_step(config_file, tmp_path):
    summary = _snapshot_run(config_file, tmp_path)
    actions, snapshot = _load_snapshot(tmp_path)
    assert "alloc" in actions and "free_completed" in actions and snapshot["segments"]
    frames = [frame["filename"] for trace in snapshot["device_traces"] for e in trace for frame in e.get("frames", [])]
    assert any("tensorpar" in name for name in frames)  # Python stacks: which code allocated
    # Written after a step that set a new peak: what was then allocated is within the run's highest step peak.
    peak = max(r["memory_mib"]["allocated"] for r in summary["history"])
    in_use = sum(s["allocated_size"] for s in snapshot["segments"])
    assert 0 < in_use <= peak * 2**20


def test_memory_snapshot_is_written_on_an_out_of_memory_error(config_file, tmp_path):
    with pytest.raises(torch.cuda.OutOfMemoryError):
        _snapshot_run(config_file, tmp_path, huge_allocation_at_step=3)
    actions, _ = _load_snapshot(tmp_path)
    assert "oom" in actions


def _fp8_gpu():
    from tensorpar.tensor_parallel.fp8_scaling import fp8_unsupported

    return fp8_unsupported("cuda")


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_fp8_layers_on_a_gpu_compute_what_they_compute_on_the_cpu(recipe):
    # The same fp8 values through cuBLASLt's _scaled_mm (dimensions multiples of 16) and the CPU's: outputs and
    # gradients equal up to the fp32 summation order.
    if _fp8_gpu():
        pytest.skip(_fp8_gpu())
    from tensorpar.tensor_parallel.fp8_linear import fp8_linears
    from tensorpar.tensor_parallel.fp8_scaling import Fp8Recipe

    torch.manual_seed(0)
    x, w1, w2 = torch.randn(64, 128), torch.randn(256, 128), torch.randn(128, 128)
    g1, g2 = torch.randn(64, 256), torch.randn(64, 128)
    results = {}
    for device in ("cpu", "cuda"):
        xs, ws = x.to(device).bfloat16().requires_grad_(), [w.to(device).bfloat16().requires_grad_() for w in (w1, w2)]
        ys = fp8_linears(xs, ws, Fp8Recipe(recipe))
        (ys[0].float() * g1.to(device)).sum().add((ys[1].float() * g2.to(device)).sum()).backward()
        results[device] = [t.float().cpu() for t in (*ys, xs.grad, *(w.grad for w in ws))]
    for cpu, gpu in zip(results["cpu"], results["cuda"]):
        assert (cpu - gpu).norm() <= 1e-2 * cpu.norm()  # bf16 outputs: a rounding apart at most


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_fp8_training_on_a_gpu_follows_bf16(config_file, recipe):
    if _fp8_gpu():
        pytest.skip(_fp8_gpu())
    bf16 = run(config_file, device="cuda", dtype="bf16")
    fp8 = run(config_file, device="cuda", dtype="fp8", fp8_recipe=recipe)
    for step, ((loss, _), (ref, _)) in enumerate(zip(fp8["trajectory"], bf16["trajectory"]), 1):
        assert abs(loss - ref) <= 3e-2 * ref, f"fp8 {recipe} step {step}: loss {loss} vs bf16 {ref}"


def test_fp8_is_refused_below_compute_capability_8_9():
    from tensorpar.tensor_parallel.fp8_scaling import fp8_unsupported

    major, minor = torch.cuda.get_device_capability(0)
    why = fp8_unsupported("cuda")
    assert (why is None) == ((major, minor) >= (8, 9)), why


# -- issue 43: attention within documents, grouped experts, memory levers (each mirrors a CPU test) -------------------

def _qkv_documents(device):
    """test_varlen_attention's documents and q / k / v, on `device`."""
    from tensorpar.functional.document_mask import PackedDocuments

    ids = torch.randint(0, 256, (3, 64), generator=torch.Generator().manual_seed(0))
    for row, ends in enumerate([[2, 3, 11, 38, 40], [0, 7, 20, 21, 31, 63], []]):
        ids[row, ends] = 256
    g = torch.Generator().manual_seed(1)
    qkv = [torch.randn(3, h, 64, 16, generator=g).to(device).requires_grad_() for h in (4, 2, 2)]
    return PackedDocuments.from_tokens(ids.to(device), 256), qkv


@pytest.mark.parametrize("kernel", ["varlen", "flex"])
def test_document_attention_kernels_on_a_gpu_equal_the_dense_mask(kernel):
    # mirrors tests/test_varlen_attention.py::test_varlen_equals_the_dense_mask; flex: compiled, with its backward
    from tensorpar.functional.varlen_attention import document_attention

    probe = torch.randn(3, 4, 64, 16, generator=torch.Generator().manual_seed(2)).cuda()
    results = {}
    for name in ("dense", kernel):
        docs, (q, k, v) = _qkv_documents("cuda")
        out = document_attention(q, k, v, docs, name)
        (out * probe).sum().backward()
        results[name] = [t.detach().cpu() for t in (out, q.grad, k.grad, v.grad)]
    for got, ref in zip(results[kernel], results["dense"]):
        assert (got - ref).norm() <= 1e-4 * ref.norm()


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 2e-2)], ids=["fp32", "bf16"])
def test_grouped_experts_on_a_gpu_equal_the_loop(dtype, tol):
    # mirrors tests/test_grouped_experts.py at EP 1; bf16 runs torch._grouped_mm's CUTLASS kernel on sm90+ (fp32:
    # torch's per-group fallback, the loop's own GEMMs)
    from tensorpar.models import Transformer, get_config
    from tensorpar.models.placement import Placement

    cfg = get_config("tiny-moe").replace(num_layers=2)
    ids = torch.randint(0, cfg.vocab_size, (2, 17), generator=torch.Generator().manual_seed(0)).cuda()
    found = {}
    for gemm in ("loop", "grouped"):
        model = Transformer(cfg, Placement.on(None, expert_gemm=gemm, device="cuda"), seed=3)
        for p in model.parameters():  # as training casts them (buffers stay fp32)
            p.data = p.data.to(dtype)
        model.train()
        loss = model(ids[:, :-1], ids[:, 1:])
        loss.backward()
        found[gemm] = [loss.detach().float().cpu()] + [p.grad.float().cpu() for p in model.parameters()]
    for got, ref in zip(found["grouped"], found["loop"]):
        assert (got - ref).norm() <= tol * max(ref.norm(), 1e-6)


@pytest.mark.parametrize("first_layers", [None, 3], ids=["all", "first-3-layers"])
def test_activation_offload_on_a_gpu_trains_bit_for_bit_like_the_run_without_it(config_file, first_layers):
    # mirrors tests/test_memory_levers.py: the saved tensors go to pinned host memory on a side stream and come back
    plain, _ = gpu_reference(config_file)
    offload = _on_cpu(run(config_file, device="cuda", activation_offload=True, activation_offload_layers=first_layers))
    assert offload["trajectory"] == plain["trajectory"]
    assert all(torch.equal(offload["state"][k], v) for k, v in plain["state"].items())


def test_optimizer_offload_and_bf16_moments_on_a_gpu_follow_the_plain_run(config_file):
    # the offloaded step runs torch's CPU AdamW, the plain one its fused CUDA kernel: equal up to float rounding
    plain, floor = gpu_reference(config_file)
    assert_same_training([_on_cpu(run(config_file, device="cuda", optimizer_offload=True))], plain, floor=floor)
    bf16 = run(config_file, device="cuda", optimizer_state_dtype="bf16")
    for step, ((loss, _), (ref, _)) in enumerate(zip(bf16["trajectory"], plain["trajectory"]), 1):
        assert abs(loss - ref) <= 1e-3 * ref, f"step {step}: {loss} vs {ref}"


def test_host_activations_are_pinned_and_come_back_equal():
    from tensorpar.training.activation_offload import HostActivations

    offload = HostActivations("cuda")
    x = torch.randn(1000, device="cuda")
    saved = offload.pack(x[10:20])
    assert saved.storage.host.is_pinned() and offload.bytes.now == x.untyped_storage().nbytes()
    assert torch.equal(offload.unpack(saved), x[10:20])


def test_host_activations_fetch_one_layer_ahead_of_the_backward():
    from tensorpar.training.activation_offload import HostActivations

    offload = HostActivations("cuda", layers=4)
    xs = [torch.full((1 << 18,), float(i), device="cuda") for i in range(8)]  # 1 MiB each: 2 MiB a layer
    saved = [offload.pack(x) for x in xs]
    # the backward unpacks the last saved first; the two saved before it are fetched ahead on the side stream
    assert torch.equal(offload.unpack(saved[7]), xs[7])
    assert [s.storage.fetched is not None for s in saved] == [False] * 5 + [True, True, False]
    assert torch.equal(offload.unpack(saved[6]), xs[6])  # fetched: taken over; one more is fetched
    assert [s.storage.fetched is not None for s in saved] == [False] * 4 + [True, True, False, False]
    for i in reversed(range(6)):
        assert torch.equal(offload.unpack(saved[i]), xs[i])
    assert all(s.storage.fetched is None for s in saved)
    # moving only the first layers, the backward's first unpack (of a tensor kept on the device) fetches the last ones
    # saved before it: with a pipeline, those of its micro-batch, not those of the one whose forward came after
    first = [offload.pack(x) for x in xs[:4]]
    kept_after_first = offload.saved_count()
    later = [offload.pack(x) for x in xs[4:]]
    offload.begin_backward(kept_after_first)  # a window of 2 MiB: 8 MiB over 4 layers
    assert [s.storage.fetched is not None for s in first + later] == [False] * 2 + [True, True] + [False] * 4
# Several ranks on the one GPU: gloo moves their CUDA tensors through host memory (NCCL refuses two ranks on one
# device), so that every parallel code path runs on CUDA tensors with one GPU lent. Each layout's 4 steps and final
# weights equal one process's on the GPU (fp32, no TF32), which equals the CPU's (above).
ONE_GPU_LAYOUTS = [
    dict(tp=2),
    dict(tp=2, sequence_parallel=True),
    dict(cp=2),
    dict(pp=2, micro_batch_size=2, schedule="1f1b"),
    dict(pp=2, micro_batch_size=1, schedule="zbv"),
    dict(dp=2, zero=1),
    dict(dp=2, zero=3),
    dict(tp=2, dp=2, zero=3, sequence_parallel=True),
    dict(tp=2, pp=2, micro_batch_size=2),
    dict(tp=2, cp=2, sequence_parallel=True),
    dict(model="tiny-moe", dp=2, ep=2),
    dict(model="tiny-moe", tp=2, dp=2, ep=2, expert_tp=2),
    # --compile where it failed on the CPU: ZeRO-3's gathers around a compiled block, the experts' grouped GEMM
    dict(dp=2, zero=3, compile=True),
    dict(model="tiny-moe", dp=2, ep=2, compile=True),
]


def on_cuda_to_cpu(model, **settings):
    """`layout_runs.run` on this rank's CUDA device, the final weights returned on the CPU (a worker's results
    travel through a queue)."""
    return _on_cpu(run(model, device="cuda", **settings))


def _ranks(layout):
    return layout.get("tp", 1) * layout.get("cp", 1) * layout.get("pp", 1) * layout.get("dp", 1)


@pytest.mark.parametrize("layout", ONE_GPU_LAYOUTS, ids=["-".join(f"{k}{v}" for k, v in lay.items() if k != "model")
                                                         + ("-moe" if "model" in lay else "") for lay in ONE_GPU_LAYOUTS])
def test_layouts_of_several_ranks_on_one_gpu_train_what_one_gpu_process_trains(pools, config_file, layout):
    layout = dict(layout)
    model = layout.pop("model", config_file)
    results = pools(_ranks(layout)).run(on_cuda_to_cpu, model, **layout)
    reference, floor = gpu_reference(model)
    assert_same_training(results, reference, floor=floor)


@pytest.mark.parametrize("fork", ["1", "0"], ids=["forked-ranks", "new-processes"])
def test_the_command_line_runs_two_ranks_on_one_gpu_with_gloo(config_file, tmp_path, fork):
    """Ranks forked from the launcher's zygote (tensorpar.distributed.zygote) initialise CUDA after the fork, as
    new processes do."""
    ref, ref_metrics = _train(config_file, tmp_path, "one", "--tp", "1")
    assert ref.returncode == 0, ref.stderr
    proc, metrics = _train(config_file, tmp_path, "two", "--tp", "2", "--backend", "gloo", TENSORPAR_FORK_RANKS=fork)
    assert proc.returncode == 0, proc.stderr
    for a, b in zip(map(json.loads, metrics.read_text().splitlines()), map(json.loads, ref_metrics.read_text().splitlines())):
        assert abs(a["loss"] - b["loss"]) <= 1e-4 * b["loss"], (a, b)


def test_an_asynchronous_save_from_a_gpu_resumes_as_the_straight_run(config_file, tmp_path):
    # The shards are copied into pinned host buffers on the device's stream and written by a thread.
    straight, _ = gpu_reference(config_file)
    save = str(tmp_path / "async")
    run(config_file, device="cuda", stop_after=2, save=save, save_every=1, async_save=True)
    resumed = _on_cpu(run(config_file, device="cuda", resume=save))  # the fused AdamW's steps back on the GPU
    assert_same_training([{**resumed, "trajectory": straight["trajectory"][:2] + resumed["trajectory"]}], straight,
                         tol=1e-6)
