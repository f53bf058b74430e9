#!/usr/bin/env python
"""The memory levers measured: each one's bytes by where they are and its step time, against the run without it.

    none                 no lever
    optimizer-offload    --optimizer-offload (AdamW's states and the fp32 masters in host memory, the step there)
    activation-offload   --activation-offload (the tensors the layers save for the backward in host memory; the
                         embedding's, the head's and the loss's, which the backward needs first, stay on the device)
    first-4-layers       --activation-offload --activation-offload-layers 4 (only the first 4 layers' saved tensors)
    bf16-states          --optimizer-state-dtype bf16 (AdamW's moments in bf16)
    all                  the three together

Each variant trains `--steps` steps (`tensorpar.training.train`, one rank, in a process of its own) and reports its
peak memory by kind as the run counts it (`memory_mib`: parameters, gradients, optimizer, activations on the
device; host_optimizer, host_activations on the host), on CUDA the allocator's peak (`allocated`), the median
step time after the first and the CPU seconds of the whole run (all threads: on a shared machine the steadier
figure). Printed: a row per variant; the last line is

    LEVER/none device=X.XX host_mib=H step=Y.YY cpu=Z.ZZ ...   (device: the ledger's device total, or on CUDA the
                                        allocator's peak, over the run without levers; step, cpu: time ratios)

With ``--plan GPU`` (a catalog name, or a `tensorpar calibrate` profile .json) each row also shows the planner's
step time for the variant on that device (`tensorpar.planning.offload_time` prices the levers), and the last
line its ratio (``planned=``) beside the measured one. On CUDA the pinned copies to and from the host are timed
first, each way (as `tensorpar calibrate` times them), and a second column (``link planned s``, ``planned_link=``)
plans with that link in place of the catalog's.

    .venv/bin/python bench/memory_levers.py                      # tiny, CPU, about 2 minutes
    .venv/bin/python bench/memory_levers.py --device cuda --model llama-1b --dtype bf16 --seq-len 2048 \\
        --global-batch-size 8 --micro-batch-size 2 --steps 6 --plan h200   # a GPU: what offloading costs and saves
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

import torch

VARIANTS = {"none": {}, "optimizer-offload": {"optimizer_offload": True},
            "activation-offload": {"activation_offload": True},
            "first-4-layers": {"activation_offload": True, "activation_offload_layers": 4},
            "bf16-states": {"optimizer_state_dtype": "bf16"},
            "all": {"optimizer_offload": True, "activation_offload": True, "optimizer_state_dtype": "bf16"}}
DEVICE_KINDS = ("parameters", "gradients", "optimizer", "activations", "gathered")


def measured_host_link(device: str) -> tuple[float, float] | None:
    """On CUDA, bytes/s of 256 MiB pinned copies (to the host, back), as `tensorpar calibrate` measures them."""
    if device != "cuda":
        return None
    from tensorpar.planning.calibration import timer
    from tensorpar.planning.host_calibration import measure_host_link

    dev = torch.device("cuda")
    link = measure_host_link(dev, 256 << 20, timer(dev), copy_bandwidth=0.0)
    return link["device_to_host"], link["host_to_device"]


def planned_step_s(a, name: str, link: tuple[float, float] | None = None) -> float:
    """The planner's step time for variant `name` at these settings on `a.plan` (a catalog GPU or a profile), with
    the host `link` (bytes/s to the host and back, as copies reach them) where given."""
    import dataclasses

    from tensorpar.config.hardware import Link
    from tensorpar.config.memory_levers import MemoryLevers
    from tensorpar.models import get_config
    from tensorpar.planning.calibration import load_profile
    from tensorpar.planning.candidates import Candidate
    from tensorpar.planning.cluster import make_cluster
    from tensorpar.planning.step_time import predict_step_time

    if a.plan.endswith(".json"):
        spec, curve = load_profile(a.plan)
        cluster = make_cluster(spec, 1, curve=curve, link_efficiency=1.0)
    else:
        cluster = make_cluster(a.plan, 1)
    if link is not None:  # the cluster multiplies a link by its efficiency: these are measured already
        out, back = (Link(bandwidth / cluster.link_efficiency, cluster.host_link.latency) for bandwidth in link)
        cluster = dataclasses.replace(cluster, host_link=out, host_link_back=back)
    layout = Candidate.of(micro_batch_size=a.micro_batch_size)
    return predict_step_time(get_config(a.model), layout, cluster, a.seq_len, a.global_batch_size,
                             f"tensorpar-{a.dtype}", levers=MemoryLevers(**VARIANTS[name])).step_time_s


def child(a) -> None:
    from tensorpar.training import TrainOptions, train

    torch.set_num_threads(a.threads)
    levers = VARIANTS[a.child]
    cpu0 = time.process_time()
    s = train(TrainOptions(model=a.model, dtype=a.dtype, seq_len=a.seq_len, global_batch_size=a.global_batch_size,
                           micro_batch_size=a.micro_batch_size, steps=a.steps, warmup_steps=0, device=a.device,
                           val_every=0, val_fraction=0.0, progress=False, metrics=None, out_dir=None, **levers))
    steps = [r["step_time_s"] for r in s["history"]]
    memory = {}
    for r in s["history"]:
        for kind, mib in r["memory_mib"].items():
            memory[kind] = max(mib, memory.get(kind, 0.0))
    print(json.dumps({"step_s": statistics.median(steps[1:] or steps), "cpu_s": time.process_time() - cpu0,
                      "memory": memory,
                      "loss": s["history"][-1]["loss"]}), flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny")
    p.add_argument("--dtype", default="fp32")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--global-batch-size", type=int, default=8)
    p.add_argument("--micro-batch-size", type=int, default=8)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--plan", help="also print the planner's step time on this GPU (catalog name or profile .json)")
    p.add_argument("--child", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        child(a)
        return 0
    print(f"{a.model} {a.dtype}, {a.global_batch_size} x {a.seq_len} tokens a step (micro-batch {a.micro_batch_size}), "
          f"{a.steps} steps, {a.device}, torch {torch.__version__}; peak MiB by kind, median step after the first")
    link = measured_host_link(a.device) if a.plan else None
    linked = link is not None
    if linked:
        print(f"host link measured: {link[0] / 1e9:.1f} GB/s to the host, {link[1] / 1e9:.1f} back (pinned, 256 MiB)")
    print(f"{'variant':20} {'params':>8} {'grads':>8} {'optim':>8} {'activ':>8} {'host opt':>9} {'host act':>9} "
          f"{'allocated':>9} {'step s':>8} {'CPU s':>7} {'loss':>8}" + (f" {'planned s':>9}" if a.plan else "")
          + (f" {'link planned s':>14}" if linked else ""), flush=True)
    results = {}
    for name in a.variants.split(","):
        argv = [sys.executable, __file__, "--child", name] + [f"--{k.replace('_', '-')}={v}" for k, v in vars(a).items()
                                                             if k not in ("child", "variants", "plan")]
        r = results[name] = json.loads(subprocess.run(argv, check=True, capture_output=True, text=True)
                                       .stdout.strip().splitlines()[-1])
        if a.plan:
            r["planned_s"] = planned_step_s(a, name)
        if linked:
            r["link_planned_s"] = planned_step_s(a, name, link)
        m = r["memory"]
        print(f"{name:20} {m['parameters']:8.1f} {m['gradients']:8.1f} {m['optimizer']:8.1f} {m['activations']:8.1f} "
              f"{m.get('host_optimizer', 0):9.1f} {m.get('host_activations', 0):9.1f} "
              f"{m.get('allocated', float('nan')):9.1f} {r['step_s']:8.3f} {r['cpu_s']:7.1f} {r['loss']:8.4f}"
              + (f" {r['planned_s']:9.3f}" if a.plan else "") + (f" {r['link_planned_s']:14.3f}" if linked else ""),
              flush=True)
    device = (lambda m: m["allocated"]) if a.device == "cuda" else (lambda m: sum(m.get(k, 0.0) for k in DEVICE_KINDS))
    base = results.get("none")
    if base is not None:
        print(" ".join(f"{n}/none device={device(r['memory']) / device(base['memory']):.2f} "
                       f"host_mib={r['memory'].get('host_optimizer', 0) + r['memory'].get('host_activations', 0):.0f} "
                       f"step={r['step_s'] / base['step_s']:.2f} cpu={r['cpu_s'] / base['cpu_s']:.2f}"
                       + (f" planned={r['planned_s'] / base['planned_s']:.2f}" if a.plan else "")
                       + (f" planned_link={r['link_planned_s'] / base['link_planned_s']:.2f}" if linked else "")
                       for n, r in results.items() if n != "none"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
