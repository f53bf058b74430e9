"""The validation tables of docs/planner.md: `python tests/planning_report.py` prints them."""

from __future__ import annotations


from tensorpar.planning import memory, precision_recipes
from tensorpar.planning import search as search_mod
from tensorpar.planning.candidates import Candidate

from planning_cases import CONFIGS, WORLD
from test_planning_communication import (
    COMM_CASES,
    PIPELINE_CASES,
    check_model_comm_and_params,
    check_pipeline_step_comm,
    check_training_step_comm,
)
from test_planning_memory import (
    ACTIVATION_CASES,
    CHUNKS,
    check_activations,
    check_parameter_memory,
)
from test_planning_search import (
    ERA_SPACE,
    FULL_SPACE,
    PUBLISHED,
    mesh_rank,
    published_prediction,
)


def _cells(counted, predicted) -> str:
    return ", ".join(f"{op} {g}: {counted.get((op, g), 0):,}" for op, g in sorted(set(counted) | set(predicted)))


def _report() -> None:  # pragma: no cover - run as a script
    from harness import Pools

    pools = Pools()
    try:
        print("## Communication: predicted vs counted bytes per (op, group), one micro-batch (B=2, S=16)\n")
        print("| tp | model | SP | recompute | dtype | (op, group): counted = predicted | equal |")
        print("|---|---|---|---|---|---|---|")
        for tp, config, sp, rc, bf16 in COMM_CASES:
            counted, predicted, _, _ = pools(WORLD).run(check_model_comm_and_params, tp, config, sp, rc, bf16)[0]
            cells = _cells(counted, predicted)
            print(f"| {tp} | {config} | {'on' if sp else 'off'} | {rc} | {'bf16' if bf16 else 'fp32'} | {cells} | "
                  f"{'yes' if counted == predicted else 'NO'} |")
        print("\n| training step, tp=2 x dp=2, tiny-gpt2 + SP, 2 micro-batches | counted = predicted | equal |")
        print("|---|---|---|")
        for zero in (0, 1, 2):
            counted, predicted = pools(WORLD).run(check_training_step_comm, zero, 2)[0]
            cells = _cells(counted, predicted)
            print(f"| ZeRO-{zero} | {cells} | {'yes' if counted == predicted else 'NO'} |")

        print("\n| pipelined step, tiny-gpt2 (4 layers), 4 micro-batches | rank | counted = predicted | equal |")
        print("|---|---|---|---|")
        for tp, pp, dp, schedule, v, zero, sp in PIPELINE_CASES:
            for rank, (counted, predicted, *_rest) in enumerate(pools(WORLD).run(
                    check_pipeline_step_comm, tp, pp, dp, schedule, v, zero, sp)):
                if rank % (tp * dp) == 0:
                    label = f"tp={tp} pp={pp} dp={dp} {schedule}{f' v={v}' if v > 1 else ''} ZeRO-{zero}"
                    label += " SP" if sp else ""
                    print(f"| {label} | {rank} | {_cells(counted, predicted)} | "
                          f"{'yes' if counted == predicted else 'NO'} |")
        print("\n## Parameters, gradients, AdamW states per rank (bytes): predicted vs real tensors\n")
        print("| model | tp | parameters (pred / real) | gradients (pred / real) | AdamW states (pred / real) |")
        print("|---|---|---|---|---|")
        prec = precision_recipes.PRECISIONS["tensorpar-fp32"]
        for config in ("tiny", "gpt2-124m-2l"):
            for tp in (1, 2, 4):
                mb = memory.stage_memory(CONFIGS[config], Candidate.of(tp=tp), 8, 1, prec)
                real = check_parameter_memory(tp, config) if tp == 1 else pools(WORLD).run(check_parameter_memory, tp,
                                                                                          config)[0]
                print(f"| {config} | {tp} | {mb.parameters:,} / {real[0]:,} | {mb.gradients:,} / {real[1]:,} | "
                      f"{mb.optimizer:,} / {real[2]:,} |")

        print("\n## Activations of one micro-batch (B=2, S=32), bytes: predicted vs measured\n")
        print("| tp | model | SP | recompute | dtype | loss | predicted | measured | method | error "
              "| Playbook formula (bf16) |")
        print("|---|---|---|---|---|---|---|---|---|---|---|")
        for (tp, config, sp, rc, dtype), chunk in zip(ACTIVATION_CASES, CHUNKS):
            cfg = CONFIGS[config]
            mb = memory.stage_memory(cfg, Candidate.of(tp=tp, sequence_parallel=sp, micro_batch_size=2, recompute=rc), 32, 2,
                                     f"tensorpar-{dtype}", loss_chunk_tokens=chunk)
            pred = mb.activations + mb.weight_copies
            method = "hooks" if rc == "none" else "live"
            args = (tp, config, sp, rc, dtype, method, True, chunk)
            got = check_activations(*args) if tp == 1 else pools(WORLD).run(check_activations, *args)[0]
            pb = memory.stage_memory(cfg, Candidate.of(tp=tp, sequence_parallel=sp, micro_batch_size=2, recompute=rc), 32, 2,
                                     "mixed-bf16").activations
            loss = "fused" if chunk else "logits"
            print(f"| {tp} | {config} | {'on' if sp else 'off'} | {rc} | {dtype} | {loss} | {pred:,} | "
                  f"{got:,} | {method} | {100 * (pred - got) / got:+.3f}% | {pb:,} |")
    finally:
        pools.close()

    print("\n## Published runs (Narayanan et al. 2021) vs predicted\n")
    print("| run | layout | schedule | published TFLOP/s/GPU | predicted | error | predicted step s | memory GiB |")
    print("|---|---|---|---|---|---|---|---|")
    for name, cfg, gpus, batch, published, layout in PUBLISHED:
        for v in (2, 1):
            lay = layout.replace(virtual_stages=v)
            plan, pred, _ = published_prediction(cfg, gpus, batch, lay)
            print(f"| {name} | TP{lay.tp} PP{lay.pp} DP{lay.dp} mbs 1 full recompute | "
                  f"{'interleaved v=2' if v == 2 else '1F1B'} | {published / 1e12:.0f} | {pred / 1e12:.1f} | "
                  f"{100 * (pred / published - 1):+.1f}% | {plan.time.step_time_s:.1f} | "
                  f"{plan.memory.gib()['total']:.1f} |")
    print("\n| run | space | feasible layouts | rank of their layout (MFU) | rank of their (tp, pp) | "
          "planner's best (MFU, GiB) |")
    print("|---|---|---|---|---|---|")
    for name, cfg, gpus, batch, published, layout in PUBLISHED:
        theirs, _, cl = published_prediction(cfg, gpus, batch, layout)
        for label, space in (("2021 features", ERA_SPACE), ("all features", FULL_SPACE)):
            plans = search_mod.search(cfg, cl, 2048, batch, "mixed-bf16", flash_attention=False, **space)
            feasible = [p for p in plans if p.feasible]
            rank, _ = search_mod.find(plans, **layout.as_dict())
            shape, count = mesh_rank(plans, layout)
            best = feasible[0]
            print(f"| {name} | {label} | {len(feasible)} | {rank + 1} (top {100 * (rank + 1) / len(feasible):.1f}%; "
                  f"{100 * theirs.time.mfu:.1f}%) | {shape + 1} of {count} | {best.candidate.label()} "
                  f"({100 * best.time.mfu:.1f}%, {best.memory.gib()['total']:.1f}) |")


if __name__ == "__main__":
    _report()
