"""`tensorpar plan`: the layout table, JSON and pictures, its errors, and schedule mode."""

from __future__ import annotations

import json
import subprocess
import sys
from types import SimpleNamespace

import pytest

from tensorpar.commands import plan as plan_command
from tensorpar.commands.plan import run_schedule_command


def _main(*args):
    from tensorpar.cli import main

    return main(["plan", *args])


def test_plan_command_text_json_and_pngs(capsys, tmp_path):
    base = ["--model", "llama-8b", "--gpus", "16", "--gpu", "h100-80gb", "--seq-len", "4096",
            "--global-batch-size", "256"]
    assert _main(*base, "--top", "3", "--png", str(tmp_path / "plan.png")) == 0
    out = capsys.readouterr().out
    assert "searched" in out and "feasible" in out and "tokens/s" in out and "exceed the GPU memory" in out
    assert (tmp_path / "plan.png").stat().st_size > 0 and (tmp_path / "plan-heatmap.png").stat().st_size > 0
    assert _main(*base, "--json", "--top", "2", "--inter-bandwidth", "25", "--mfu-ceiling", "0.5") == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["feasible"] for r in rows] == [True, True, False, False]
    assert rows[0]["tokens_per_s"] >= rows[1]["tokens_per_s"] and rows[2]["reason"].startswith("exceeds memory")
    assert set(rows[0]["memory"]) >= {"parameters", "gradients", "optimizer", "activations", "total"}


def test_plan_command_errors_and_schedule_mode(capsys, monkeypatch):
    assert _main("--model", "tiny") == 2
    assert "plan needs --gpus, --gpu, --seq-len, --global-batch-size" in capsys.readouterr().err
    assert _main("--model", "tiny", "--gpus", "2", "--gpu", "tpu", "--seq-len", "8", "--global-batch-size", "2") == 2
    assert "unknown GPU 'tpu'; known GPUs:" in capsys.readouterr().err
    seen = {}
    monkeypatch.setattr(plan_command, "run_schedule_command", lambda args: seen.update(vars(args)) or 0)
    assert _main("--schedule", "interleaved", "--pp", "4", "--microbatches", "8", "--virtual-stages", "2") == 0
    assert _main("--schedule", "1f1b", "--pp", "4") == 2
    assert "--schedule 1f1b needs --microbatches" in capsys.readouterr().err
    assert (seen["schedule"], seen["pp"], seen["microbatches"], seen["virtual_stages"]) == ("interleaved", 4, 8, 2)


def test_python_m_tensorpar_plan():
    proc = subprocess.run([sys.executable, "-m", "tensorpar", "plan", "--model", "tiny", "--gpus", "8", "--gpu", "a100",
                           "--seq-len", "256", "--global-batch-size", "32", "--top", "2"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("\n") > 5 and "a100-80gb" in proc.stdout


def test_run_schedule_command(tmp_path, capsys, monkeypatch):
    args = SimpleNamespace(schedule="interleaved", pp=4, microbatches=8, virtual_stages=2,
                           png=str(tmp_path / "i.png"), json=True)
    assert run_schedule_command(args) == 0
    rec = json.loads(capsys.readouterr().out)
    assert rec["schedule"] == "interleaved" and rec["pp"] == 4 and rec["virtual_stages"] == 2
    assert rec["bubble_fraction"] == pytest.approx(3 / 19) and rec["theoretical_bubble"] == 3 / 19
    assert rec["peak_in_flight"] == [11, 9, 7, 5]
    assert (tmp_path / "i.png").stat().st_size > 0
    monkeypatch.chdir(tmp_path)
    args = SimpleNamespace(schedule="1f1b", pp=2, microbatches=4, virtual_stages=None, png=None, json=False)
    assert run_schedule_command(args) == 0
    out = capsys.readouterr().out
    assert "rank 0 |" in out and "rank 1 |" in out and "bubble fraction" in out
    assert "runs/schedule-1f1b-pp2-m4.png" in out
    assert (tmp_path / "runs" / "schedule-1f1b-pp2-m4.png").stat().st_size > 0


def test_plan_precision_choices_are_the_planners_recipes():
    from tensorpar.config.choices import PLAN_PRECISIONS
    from tensorpar.planning.precision_recipes import PRECISIONS

    assert tuple(PRECISIONS) == PLAN_PRECISIONS


def test_plan_pp_overlap_hides_the_interleaved_sends(capsys):
    base = ["--model", "llama-8b", "--gpus", "64", "--gpu", "h100-80gb", "--seq-len", "4096",
            "--global-batch-size", "64", "--tp", "8", "--pp", "4", "--schedule", "interleaved", "--virtual-stages", "2",
            "--json", "--top", "1"]
    rows = {}
    for f in ("0", "1"):
        assert _main(*base, "--pp-overlap", f) == 0
        rows[f] = json.loads(capsys.readouterr().out)[0]
    assert rows["0"]["virtual_stages"] == rows["1"]["virtual_stages"] == 2
    assert rows["1"]["step_time_s"] < rows["0"]["step_time_s"]
    assert _main(*base, "--pp-overlap", "1.5") == 2
    assert "the pipeline p2p overlap must be in [0, 1], got 1.5" in capsys.readouterr().err


FAMILY_PRESETS = ["qwen2.5-7b", "qwen3-8b", "qwen3-30b-a3b", "mistral-7b", "gemma2-9b", "gemma3-12b", "phi3-mini",
                  "olmo2-7b"]


def test_the_families_published_shapes_are_planned(capsys):
    """Each family's preset plans at TP 4 x PP 2 on 16 GPUs; the FLOPs the planner counts know Gemma 2's and Mistral's
    windows (fewer attended keys than the same model without them)."""
    from tensorpar.models import get_config
    from tensorpar.models.flops import train_flops_per_token

    for model in FAMILY_PRESETS:
        assert _main("--model", model, "--gpus", "16", "--gpu", "h100-80gb", "--seq-len", "8192", "--global-batch-size",
                     "64", "--tp", "4", "--pp", "2", "--json") == 0, model
        rows = json.loads(capsys.readouterr().out)
        assert any(r["feasible"] for r in rows), (model, rows[:1])
    for model, window in (("mistral-7b", 4096), ("gemma2-9b", 4096)):
        cfg = get_config(model)
        full = cfg.replace(sliding_window=None, layer_types=None)
        attention = lambda c: train_flops_per_token(c, 8192) - train_flops_per_token(c, 0)  # noqa: E731
        sliding = sum(cfg.attention_window(i) is not None for i in range(cfg.num_layers))
        saved = (8192 - window) / 8192 * sliding / cfg.num_layers
        assert attention(cfg) == pytest.approx(attention(full) * (1 - saved)), model


def test_the_table_names_the_pipeline_layers_that_uneven_layouts_train_with(capsys, cli):
    """A layout whose pp x v does not divide the layers is planned with uneven stages; `tensorpar train` refuses it
    without --pipeline-layers, so the text table (which has no column for them) says which counts each row needs,
    and the trainer's refusal of the same layout proposes the same counts (zbv: one per virtual stage)."""
    assert _main("--model", "llama-70b", "--gpus", "96", "--gpu", "h100", "--seq-len", "8192",
                 "--global-batch-size", "384", "--tp", "1", "--pp", "6", "--cp", "1", "--zero", "2",
                 "--recompute", "full", "--schedule", "zbv", "--top", "2", "--sequence-parallel", "off") == 0
    out = capsys.readouterr().out
    assert "uneven stages: #1, #2 train with --pipeline-layers 6,6,7,7,7,7,7,7,7,7,6,6" in out
    # the rows spell the schedule as --schedule takes it, and v is the chunks per rank zbv runs
    rows = [row for row in map(str.split, out.splitlines()) if row[:1] in (["1"], ["2"]) and row[1].isdigit()]
    assert [row[5:7] for row in rows] == [["2", "zbv"], ["2", "zbv"]], rows
    code, _, err = cli("train", "--model", "llama-70b", "--pp", "6", "--dp", "16", "--schedule", "zbv",
                       "--seq-len", "8192", "--global-batch-size", "384", "--micro-batch-size", "1",
                       "--dry-run", "--world-size", "96")
    assert code == 2 and "or give uneven stages with --pipeline-layers 6,6,7,7,7,7,7,7,7,7,6,6" in err
