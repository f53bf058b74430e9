"""The planner against published training runs: the runs (with the source of every number), the prediction of
each and the rank of its published layout. `python tests/planning_validation.py` prints the table of
docs/validation.md; tests/test_planning_validation.py recomputes it.

How a run is predicted: the published layout's fields (tp, cp, pp, dp and whatever else the source states) are
fixed; what the source does not state (micro-batch size, recomputation, interleaving, ZeRO stage) is left to the
planner, which takes its best feasible choice - frameworks tune those knobs too. The cluster is the catalog GPU
with the global defaults of `planning.cluster` and the documented features of the software that ran
(`SOFTWARE`), the same for every run of that software; nothing is set per run.

Rank: the published mesh (tp, cp, pp) among every mesh of the same GPUs (each at its best choice of the free
knobs, the software's features fixed), by predicted throughput.
"""

from __future__ import annotations

import dataclasses

from tensorpar.models import ModelConfig, get_config
from tensorpar.planning import compute
from tensorpar.planning import search as search_mod
from tensorpar.planning.cluster import make_cluster


def _gpt(hidden, layers, heads, dropout=0.1):
    # Narayanan et al. 2021 / MT-NLG: GPT blocks, vocabulary 51,200 (padded), sequence 2048, tied embeddings
    return ModelConfig(family="gpt2", vocab_size=51200, hidden_size=hidden, num_layers=layers, num_heads=heads,
                       ffn_hidden_size=4 * hidden, max_seq_len=2048, dropout=dropout)


LLAMA2_7B = get_config("llama-8b").replace(vocab_size=32000, num_kv_heads=32, ffn_hidden_size=11008, max_seq_len=4096,
                                           rope_scaling=None)
LLAMA2_13B = LLAMA2_7B.replace(hidden_size=5120, num_layers=40, num_heads=40, num_kv_heads=40, ffn_hidden_size=13824)
LLAMA2_70B = get_config("llama-70b").replace(vocab_size=32000, max_seq_len=4096, rope_scaling=None)

# The features of the software that ran, as its documentation states them (not fitted to any run):
SOFTWARE = {
    # Megatron-LM 2021-22: fp16/bf16 + fp32 master, no flash attention, DP all-reduce after the pipeline flush,
    # no TP overlap, no sequence parallelism or distributed optimizer yet.
    "megatron-2021": dict(precision="mixed-bf16", flash=False, overlap=0.0, tp_overlap=0.0,
                          space=dict(sequence_parallel=(False,), zero=(0,), recompute=("full",))),
    # The same with PyTorch's DistributedDataParallel (`--DDP-impl torch`, what examples/sc21/run_table_1.sh
    # sets without pipeline parallelism): its bucketed all-reduces overlap the backward.
    "megatron-2021-torch-ddp": dict(precision="mixed-bf16", flash=False, overlap=1.0, tp_overlap=0.0,
                                    space=dict(sequence_parallel=(False,), zero=(0,), recompute=("full",))),
    # Megatron-LM 2022 (Korthikanti et al.): as 2021, with sequence parallelism and selective recomputation
    # available; no data parallelism in most runs, and "we do not use any overlapping of gradient all-reduces with
    # back-propagation". Its backward overlaps the TP all-reduce with the weight-gradient GEMMs except under full
    # recomputation, which one cluster-wide TP overlap fraction cannot say; left at 0.
    "megatron-2022": dict(precision="mixed-bf16", flash=False, overlap=0.0, tp_overlap=0.0,
                          space=dict(zero=(0,))),
    # Llama 3 (Meta, 2024): bf16, flash attention, FSDP-style sharding overlapped with compute; TP overlap not
    # stated.
    "llama3": dict(precision="mixed-bf16", flash=True, overlap=1.0, tp_overlap=0.0,
                   space=dict(sequence_parallel=(True,), zero=(1,))),
    # NeMo 24.12 / Megatron-Core with Transformer Engine fp8: --tp-comm-overlap, --overlap-grad-reduce,
    # --overlap-param-gather, the distributed optimizer, sequence parallelism with TP, and the interleaved
    # schedule's p2p overlapped (overlap_p2p_comm: True in NVIDIA/NeMo-Framework-Launcher's gpt3/175b.yaml,
    # llama/llama3_70b.yaml and llama2_70b.yaml; NeMo 2.0's MegatronCommOverlapCallback sets it whenever PP > 1
    # and VP > 1).
    "nemo-fp8": dict(precision="megatron-fp8-params", flash=True, overlap=1.0, tp_overlap=0.8, pp_overlap=1.0,
                     space=dict(zero=(1,), sequence_parallel=(True,))),
    # torchtitan (2024) FSDP2: bf16 parameters, fp32 gradient reduction, all-gathers prefetched behind compute.
    "torchtitan": dict(precision="megatron-bf16", flash=True, overlap=1.0, tp_overlap=0.0,
                       space=dict(zero=(3,))),
}

NARAYANAN = ("Narayanan et al. 2021, 'Efficient Large-Scale Language Model Training on GPU Clusters Using "
             "Megatron-LM', Table 1; micro-batch, virtual stages, recomputation and DDP from the authors' "
             "NVIDIA/Megatron-LM examples/sc21/run_table_1.sh")
MTNLG = ("Smith et al. 2022, 'Using DeepSpeed and Megatron to Train Megatron-Turing NLG 530B', section 2.4 "
         "(quoted in cli99/llm-analysis examples/megatron-turing-nlg/README.md)")
KORTHIKANTI = ("Korthikanti et al. 2022, 'Reducing Activation Recomputation in Large Transformer Models', Tables 3 "
               "and 5 (iteration times, full recomputation and selective recomputation + sequence parallelism) and "
               "section 6 (three interleaved chunks for 175B and 530B; the 530B run at data-parallel size 8)")
LLAMA3 = ("Llama Team 2024, 'The Llama 3 Herd of Models', Table 4 (also Balaji, SC'24 slide, quoted at "
          "glennklockwood.com/garden/llama-3.1)")
NEMO = ("NVIDIA NeMo Framework 24.12 performance summary, pre-training table (FP8, H100) "
        "docs.nvidia.com/nemo-framework/user-guide/24.12/performance/performance_summary.html")
TITAN = "pytorch/torchtitan docs/performance.md, 'Llama 3 performance numbers' (64 A100 80GB, FSDP2)"


@dataclasses.dataclass(frozen=True)
class Run:
    name: str
    cfg: ModelConfig
    gpu: str
    gpus: int
    seq_len: int
    global_batch: int
    software: str
    layout: dict  # published fields of the layout (tp, cp, pp, dp, and any stated knob)
    metric: str  # megatron_tflops | step_s | mfu | tokens_per_gpu
    published: float
    source: str


# Narayanan et al. 2021, Table 1 (weak scaling on Selene's A100 80 GB, sequence 2048): (name, heads, hidden,
# layers, TP, PP, GPUs, batch, TFLOP/s per GPU) from the paper, and (micro-batch, virtual stages) from
# run_table_1.sh (``--num-layers-per-virtual-pipeline-stage`` L gives layers / PP / L chunks; none: 1). Every row
# has full recomputation (``--activations-checkpoint-method uniform``); DDP is PyTorch's without pipeline
# parallelism, Megatron's local one (all-reduce after the flush) with it.
_TABLE_1 = [
    ("1.7B", 24, 2304, 24, 1, 1, 32, 512, 137, 16, 1),
    ("3.6B", 32, 3072, 30, 2, 1, 64, 512, 138, 16, 1),
    ("7.5B", 32, 4096, 36, 4, 1, 128, 512, 142, 16, 1),
    ("18.4B", 48, 6144, 40, 8, 1, 256, 1024, 135, 8, 1),
    ("39.1B", 64, 8192, 48, 8, 2, 512, 1536, 138, 4, 1),
    ("76.1B", 80, 10240, 60, 8, 4, 1024, 1792, 140, 2, 3),
    ("145.6B", 96, 12288, 80, 8, 8, 1536, 2304, 148, 2, 2),
    ("310.1B", 128, 16384, 96, 8, 16, 1920, 2160, 155, 1, 2),
    ("529.6B", 128, 20480, 105, 8, 35, 2520, 2520, 163, 1, 3),
    ("1T", 160, 25600, 128, 8, 64, 3072, 3072, 163, 1, 1),
]

RUNS = [
    Run(f"Megatron-LM GPT {name}", _gpt(hidden, layers, heads), "a100-80gb", gpus, 2048, batch,
        "megatron-2021" if pp > 1 else "megatron-2021-torch-ddp",
        dict(tp=tp, pp=pp, dp=gpus // (tp * pp), cp=1, micro_batch_size=mbs, virtual_stages=v, recompute="full"),
        "megatron_tflops", tflops * 1e12, NARAYANAN)
    for name, heads, hidden, layers, tp, pp, gpus, batch, tflops, mbs, v in _TABLE_1
] + [
    # Korthikanti et al. 2022, Table 3 (heads, hidden, layers, TP, PP, GPUs, batch = GPUs / TP, micro-batch 1 but
    # 22B's 4) and Table 5 (iteration seconds: full recomputation, then selective + sequence parallel); A100 80 GB,
    # sequence 2048, vocabulary 51,200, no data parallelism; 1T (2 layers per stage) cannot take 3 chunks: 1.
    Run(f"Megatron-LM 2022 GPT {name}, {mode}", _gpt(hidden, layers, heads), "a100-80gb", gpus, 2048, batch,
        "megatron-2022", dict(tp=8, pp=pp, dp=1, cp=1, micro_batch_size=mbs, virtual_stages=v,
                              recompute="full" if mode == "full recompute" else "selective",
                              sequence_parallel=mode != "full recompute"), "step_s", seconds, KORTHIKANTI)
    for name, heads, hidden, layers, pp, gpus, batch, mbs, v, full_s, selective_s in [
        ("22B", 64, 6144, 48, 1, 8, 4, 4, 1, 1.42, 1.10),
        ("175B", 96, 12288, 96, 8, 64, 64, 1, 3, 18.13, 13.75),
        ("530B", 128, 20480, 105, 35, 280, 280, 1, 3, 49.05, 37.83),
        ("1T", 160, 25600, 128, 64, 512, 512, 1, 1, 94.42, 71.49),
    ]
    for mode, seconds in (("full recompute", full_s), ("selective + SP", selective_s))
] + [
    Run("Megatron-LM 2022 GPT 530B, selective + SP, DP 8", _gpt(20480, 105, 128), "a100-80gb", 2240, 2048, 2240,
        "megatron-2022", dict(tp=8, pp=35, dp=8, cp=1, micro_batch_size=1, virtual_stages=3, recompute="selective",
                              sequence_parallel=True), "step_s", 39.15, KORTHIKANTI),
    Run("MT-NLG 530B, 2240 GPUs", _gpt(20480, 105, 128), "a100-80gb", 2240, 2048, 1920, "megatron-2021",
        dict(tp=8, pp=35, dp=8, cp=1), "step_s", 60.1, MTNLG),
    Run("MT-NLG 530B, 2800 GPUs", _gpt(20480, 105, 128), "a100-80gb", 2800, 2048, 1920, "megatron-2021",
        dict(tp=8, pp=35, dp=10, cp=1), "step_s", 50.2, MTNLG),
    Run("MT-NLG 530B, 3360 GPUs", _gpt(20480, 105, 128), "a100-80gb", 3360, 2048, 1920, "megatron-2021",
        dict(tp=8, pp=35, dp=12, cp=1), "step_s", 44.4, MTNLG),
    Run("Llama 3 405B, 8192 GPUs", get_config("llama-405b"), "h100-80gb", 8192, 8192, 2048, "llama3",
        dict(tp=8, cp=1, pp=16, dp=64), "mfu", 430 / 989.4, LLAMA3),
    Run("Llama 3 405B, 16384 GPUs", get_config("llama-405b"), "h100-80gb", 16384, 8192, 2048, "llama3",
        dict(tp=8, cp=1, pp=16, dp=128), "mfu", 400 / 989.4, LLAMA3),
    Run("Llama 3 405B, 16384 GPUs, 128K", get_config("llama-405b"), "h100-80gb", 16384, 131072, 128, "llama3",
        dict(tp=8, cp=16, pp=16, dp=8), "mfu", 380 / 989.4, LLAMA3),
    Run("NeMo GPT-3 175B, 128 H100", _gpt(12288, 96, 96, 0.0), "h100-80gb", 128, 2048, 256, "nemo-fp8",
        dict(tp=4, pp=8, cp=1, dp=4, micro_batch_size=1, virtual_stages=6), "tokens_per_gpu", 716, NEMO),
    Run("NeMo GPT-3 175B, 512 H100", _gpt(12288, 96, 96, 0.0), "h100-80gb", 512, 2048, 2048, "nemo-fp8",
        dict(tp=4, pp=8, cp=1, dp=16, micro_batch_size=2, virtual_stages=6), "tokens_per_gpu", 825, NEMO),
    Run("NeMo Llama 3 8B, 8 H100", get_config("llama-8b"), "h100-80gb", 8, 8192, 128, "nemo-fp8",
        dict(tp=1, pp=1, cp=2, dp=4, micro_batch_size=1), "tokens_per_gpu", 12273, NEMO),
    Run("NeMo Llama 3 70B, 64 H100", get_config("llama-70b"), "h100-80gb", 64, 8192, 128, "nemo-fp8",
        dict(tp=4, pp=4, cp=2, dp=2, micro_batch_size=1, virtual_stages=5), "tokens_per_gpu", 1524, NEMO),
    Run("NeMo Llama 2 7B, 8 H100", LLAMA2_7B, "h100-80gb", 8, 4096, 128, "nemo-fp8",
        dict(tp=1, pp=1, cp=1, dp=8, micro_batch_size=1), "tokens_per_gpu", 16934, NEMO),
    Run("NeMo Llama 2 13B, 16 H100", LLAMA2_13B, "h100-80gb", 16, 4096, 128, "nemo-fp8",
        dict(tp=1, pp=4, cp=1, dp=4, micro_batch_size=1, virtual_stages=10), "tokens_per_gpu", 8715, NEMO),
    Run("NeMo Llama 2 70B, 64 H100", LLAMA2_70B, "h100-80gb", 64, 4096, 128, "nemo-fp8",
        dict(tp=4, pp=4, cp=1, dp=4, micro_batch_size=1, virtual_stages=20), "tokens_per_gpu", 1728, NEMO),
    Run("torchtitan Llama 3 8B, 64 A100", get_config("llama-8b"), "a100-80gb", 64, 8192, 64, "torchtitan",
        dict(tp=1, pp=1, cp=1, dp=64, micro_batch_size=1, recompute="selective"), "tokens_per_gpu", 2973, TITAN),
    Run("torchtitan Llama 3 70B, 64 A100", get_config("llama-70b"), "a100-80gb", 64, 8192, 64, "torchtitan",
        dict(tp=1, pp=1, cp=1, dp=64, micro_batch_size=1, recompute="full"), "tokens_per_gpu", 331, TITAN),
]


def cluster_for(run: Run):
    sw = SOFTWARE[run.software]
    return make_cluster(run.gpu, run.gpus, overlap=sw["overlap"], tp_overlap=sw["tp_overlap"],
                        pp_overlap=sw.get("pp_overlap", 0.0))


def _space(run: Run, mesh_fixed: bool) -> dict:
    sw = SOFTWARE[run.software]
    # Ranking the meshes, each takes its best knobs (what a user of the planner gets); the published mesh's
    # prediction keeps the knobs its source states.
    lay = run.layout if mesh_fixed else {k: run.layout[k] for k in ("tp", "pp", "dp", "cp") if k in run.layout}
    space = dict(sw["space"])
    space.setdefault("recompute", ("none", "selective", "full"))
    if "recompute" in lay:
        space["recompute"] = (lay["recompute"],)
    v = lay.get("virtual_stages")
    space["virtual_stages"] = (v,) if v else (1, 2, 3, 4)
    space["schedules"] = (("interleaved",) if v > 1 else ("1f1b",)) if v else ("1f1b", "interleaved")
    if "sequence_parallel" in lay:
        space["sequence_parallel"] = (lay["sequence_parallel"],)
    if "micro_batch_size" in lay:
        space["micro_batch_sizes"] = (lay["micro_batch_size"],)
    else:
        space["max_micro_batch"] = 4
    # Every published run's data parallelism is as stated (none of them HSDP): the planner's HSDP candidates are
    # not these runs.
    space["dp_replicate"] = (run.layout.get("dp_replicate", 1),)
    if mesh_fixed:
        space.update(tp=(lay["tp"],), pp=(lay["pp"],), cp=(lay.get("cp", 1),))
    else:
        space["cp"] = tuple(c for c in (1, 2, 4, 8, 16) if c <= max(1, run.seq_len // 4096) or c == lay.get("cp", 1))
    return space


def _search(run: Run, mesh_fixed: bool):
    sw = SOFTWARE[run.software]
    return search_mod.search(run.cfg, cluster_for(run), run.seq_len, run.global_batch, sw["precision"],
                             flash_attention=sw["flash"], **_space(run, mesh_fixed))


def predicted_metric(run: Run, plan) -> float:
    t = plan.time
    if run.metric == "megatron_tflops":
        return compute.megatron_flops_per_step(run.cfg, run.global_batch, run.seq_len) / (run.gpus * t.step_time_s)
    if run.metric == "step_s":
        return t.step_time_s
    if run.metric == "mfu":
        return t.mfu
    return t.tokens_per_s / run.gpus


def predict(run: Run):
    """(plan of the published layout at the planner's best free knobs, predicted metric, relative error)."""
    plans = [p for p in _search(run, True) if p.candidate.dp == run.layout["dp"]]
    feasible = [p for p in plans if p.feasible]
    best = (feasible or plans)[0]
    pred = predicted_metric(run, best)
    # a shorter step is a better metric for all but step_s; error = predicted / published - 1
    return best, pred, pred / run.published - 1


def mesh_rank(run: Run) -> tuple[int, int]:
    """(1-based rank of the published (tp, cp, pp) among meshes by best predicted throughput, meshes ranked)."""
    best: dict = {}
    for p in _search(run, False):
        if p.feasible:
            key = (p.candidate.tp, p.candidate.cp, p.candidate.pp)
            if key not in best or p.time.tokens_per_s > best[key]:
                best[key] = p.time.tokens_per_s
    order = sorted(best, key=lambda k: -best[k])
    key = (run.layout["tp"], run.layout.get("cp", 1), run.layout["pp"])
    return (order.index(key) + 1 if key in order else 0), len(order)


def _fmt(run: Run, value: float) -> str:
    if run.metric == "megatron_tflops":
        return f"{value / 1e12:.0f} TFLOP/s/GPU"
    if run.metric == "step_s":
        return f"{value:.1f} s/step"
    if run.metric == "mfu":
        return f"{100 * value:.1f}% MFU"
    return f"{value:,.0f} tokens/s/GPU"


def table(rank: bool = True) -> list[dict]:
    rows = []
    for run in RUNS:
        plan, pred, err = predict(run)
        row = {"run": run.name, "gpus": f"{run.gpus} x {run.gpu}", "published layout": run.layout,
               "published": _fmt(run, run.published), "predicted": _fmt(run, pred), "error": err,
               "predicted layout": plan.candidate.label(), "feasible": plan.feasible, "source": run.source}
        if rank:
            row["rank"] = mesh_rank(run)
        rows.append(row)
    return rows


def markdown(rows) -> str:
    lines = ["| run | GPUs | published layout | published | predicted | error | rank of mesh | planner's choice of "
             "the free knobs |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lay = " ".join(f"{k}={v}" for k, v in r["published layout"].items())
        rank = f"{r['rank'][0]} of {r['rank'][1]}" if "rank" in r else ""
        lines.append(f"| {r['run']} | {r['gpus']} | {lay} | {r['published']} | {r['predicted']} | "
                     f"{100 * r['error']:+.1f}% | {rank} | {r['predicted layout']}"
                     f"{'' if r['feasible'] else ' (over memory)'} |")
    return "\n".join(lines)


if __name__ == "__main__":  # pragma: no cover
    import sys
    import time

    t0 = time.perf_counter()
    rows = table(rank="--no-rank" not in sys.argv)
    print(markdown(rows))
    errs = [abs(r["error"]) for r in rows]
    print(f"\n{sum(e <= 0.10 for e in errs)} of {len(rows)} within 10%; median |error| "
          f"{100 * sorted(errs)[len(errs) // 2]:.1f}%; top-3 mesh: {sum(1 <= r.get('rank', (0,))[0] <= 3 for r in rows)}"
          f" ({time.perf_counter() - t0:.0f} s)")
