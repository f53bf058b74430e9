"""Every dimension plans: uneven stages found automatically, context parallelism, expert parallelism, zero-bubble
schedules; and `plan --json` rows carry the new fields and every old one."""

from __future__ import annotations

import json

from tensorpar.models import get_config
from tensorpar.planning import cluster
from tensorpar.planning import search as search_mod
from tensorpar.planning.candidates import Candidate
from tensorpar.planning.step_time import predict_step_time

OLD_FIELDS = {"tp", "pp", "dp", "zero", "sequence_parallel", "micro_batch_size", "recompute", "virtual_stages",
              "feasible", "reason", "memory", "step_time_s", "tokens_per_s", "mfu"}
NEW_FIELDS = {"cp", "ep", "schedule", "pipeline_layers"}


def _main(*args):
    from tensorpar.cli import main

    return main(["plan", *args])


def test_70_layers_plan_on_12_uneven_stages():
    cfg = get_config("llama-70b").replace(num_layers=70)
    cl = cluster.make_cluster("h100", 96)
    plans = search_mod.search(cfg, cl, 4096, 96, "megatron-bf16", tp=(8,), pp=(12,), max_micro_batch=1,
                              sequence_parallel=(True,))
    best = next(p for p in plans if p.feasible)
    assert best.candidate.pp == 12 and best.candidate.pipeline_layers == (5,) + (6,) * 10 + (5,)
    assert sum(best.candidate.pipeline_layers) == 70


def test_cp2_ep8_and_zero_bubble_plan(capsys):
    assert _main("--model", "llama-8b", "--gpus", "16", "--gpu", "h100", "--seq-len", "32768",
                 "--global-batch-size", "16", "--cp", "2", "--tp", "4", "--json", "--top", "3") == 0
    rows = json.loads(capsys.readouterr().out)
    assert rows[0]["feasible"] and rows[0]["cp"] == 2
    assert set(rows[0]) >= OLD_FIELDS | NEW_FIELDS
    assert _main("--model", "mixtral-8x7b", "--gpus", "16", "--gpu", "h100", "--seq-len", "4096",
                 "--global-batch-size", "64", "--ep", "8", "--json", "--top", "2") == 0
    rows = json.loads(capsys.readouterr().out)
    assert rows[0]["feasible"] and rows[0]["ep"] == 8 and set(rows[0]) >= OLD_FIELDS | NEW_FIELDS
    assert _main("--model", "llama-8b", "--gpus", "16", "--gpu", "h100", "--seq-len", "4096",
                 "--global-batch-size", "64", "--pp", "4", "--schedule", "zbv", "--json", "--top", "1") == 0
    rows = json.loads(capsys.readouterr().out)
    assert rows[0]["schedule"] == "zbv" and rows[0]["pp"] == 4
    # train's --virtual-stages stays 1 under zbv; the V's two chunks per rank are the table's v
    assert (rows[0]["virtual_stages"], rows[0]["chunks_per_rank"]) == (1, 2)


def test_zero_bubble_bubbles_are_below_1f1b():
    cfg, cl = get_config("llama-8b"), cluster.make_cluster("h100", 32)
    times = {s: predict_step_time(cfg, Candidate.of(tp=1, pp=4, dp=8, micro_batch_size=1, schedule=s), cl, 4096, 64,
                                  "megatron-bf16") for s in ("1f1b", "zb-h1", "zbv")}
    assert times["zbv"].bubble_s < times["zb-h1"].bubble_s < times["1f1b"].bubble_s
    # without TP traffic ZB-H1's bubble is about a third of 1F1B's (T_F = T_B = T_W)
    assert 0.2 < times["zb-h1"].bubble_s / times["1f1b"].bubble_s < 0.5
