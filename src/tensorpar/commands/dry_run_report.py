"""What `tensorpar train --dry-run` prints: the rank's bytes as its optimizer counts them next to the planner's
prediction for the same layout, and the collectives of one micro-batch and step."""

from __future__ import annotations

from tensorpar.config.memory_levers import MemoryLevers
from tensorpar.planning.candidates import Candidate
from tensorpar.planning.memory import stage_memory

GiB = 2**30


def planned_candidate(run) -> Candidate:
    """What the planner evaluates for a validated run: its layout, micro-batch size and recomputation."""
    return Candidate(run.layout, run.options.micro_batch_size, run.options.recompute)


def planned_bytes(run, result: dict) -> dict:
    """The planner's parameter, gradient and optimizer bytes for the dry run's rank (its pipeline stage); with LoRA
    the adapters', and the frozen base's apart."""
    o = run.options
    mb = stage_memory(run.cfg, planned_candidate(run), o.seq_len, o.global_batch_size, run.precision.planner_name,
                      stage=result["layout"]["pp_rank"], bucket_bytes=int(o.bucket_mb * 2**20),
                      loss_chunk_tokens=o.loss_chunk_tokens or None, levers=MemoryLevers.of(o), lora=run.lora)
    return {"parameter_bytes": mb.parameters, "gradient_bytes": mb.gradients, "optimizer_bytes": mb.optimizer,
            "host_optimizer_bytes": mb.host_optimizer, "host_activation_bytes": mb.host_activations,
            "frozen_bytes": mb.frozen}


def report(run, result: dict, planned: dict) -> str:
    """The lines `tensorpar train --dry-run` prints."""
    lay, o = result["layout"], run.options
    lines = [f"dry run: rank {lay['rank']} of {lay['world_size']} (tp {lay['tp_rank']}/{o.tp}, "
             f"pp {lay['pp_rank']}/{o.pp}, dp {lay['dp_rank']}/{o.dp}, cp {lay['cp_rank']}/{o.cp}) of "
             f"{o.model}: {result['parameter_count']:,} parameters on this rank"
             + (f" (ZeRO-3 stores 1/{run.layout.shards} of them)" if run.layout.zero == 3 and run.layout.shards > 1
                else ""),
             f"{'bytes':22} {'built (meta)':>16} {'planned':>16} {'planned/built':>14}"]
    rows = [("parameter_bytes", "parameters" if run.lora is None else "parameters (adapters)"),
            ("gradient_bytes", "gradients"), ("optimizer_bytes", "optimizer states")]
    if run.lora is not None:
        rows.append(("frozen_bytes", "frozen (LoRA's base)"))
    if o.optimizer_offload:
        rows.append(("host_optimizer_bytes", "host: optimizer"))
    for key, name in rows:
        built, plan = result[key], planned[key]
        ratio = f"{plan / built:.4f}" if built else "-"
        lines.append(f"{name:22} {built:>16,} {plan:>16,} {ratio:>14}")
    if o.activation_offload:
        lines.append(f"{'host: activations':22} {'(not run)':>16} {planned['host_activation_bytes']:>16,} {'-':>14}")
    lines.append(f"one micro-batch and step (without pipeline sends): {'op':>14} {'group':>12} {'calls':>7} "
                 f"{'GiB':>10}")
    for c in result["collectives"]:
        lines.append(f"{'':51}{c['op']:>14} {c['group']:>12} {c['calls']:>7} {c['bytes'] / GiB:>10.3f}")
    return "\n".join(lines)
