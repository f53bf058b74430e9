"""`tensorpar eval` reports the same loss at any layout, context parallelism included."""

import json

import numpy as np
import pytest
import torch

from tensorpar.commands.eval import evaluate_checkpoint
from tensorpar.config.options import EvalOptions
from tensorpar.config.precision import Precision
from tensorpar.distributed.mesh import init_mesh
from tensorpar.errors import TensorparError
from tensorpar.models import get_config
from tensorpar.models.build import build_transformer
from tensorpar.training.evaluate import evaluate

from test_cli import tensorpar
from test_sharded import run


def evaluate_in_worker(**options) -> dict:
    """`tensorpar eval`'s work on a pool's ranks (what each rank of the command runs after validation)."""
    return evaluate_checkpoint(EvalOptions(device="cpu", **options))


def eval_command(*args) -> dict:
    proc, _ = tensorpar("eval", *args)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_eval_loss_is_the_same_at_any_tp_and_cp(pools, config_file, tmp_path):
    save = str(tmp_path / "ckpt")
    pools(1).run(run, config_file, steps=2, save=save)
    data = tmp_path / "tokens.npy"
    np.save(data, np.random.default_rng(0).integers(0, 257, size=10 * 17 + 3).astype(np.int32))
    losses = {}
    for tp, cp in ((1, 1), (2, 1), (2, 2), (1, 4)):
        if (tp, cp) == (2, 1):  # the command's smoke test from a shell; the other layouts on the shared pools
            result = eval_command("--checkpoint", save, "--data", str(data), "--seq-len", "16", "--tp", "2",
                                  "--batch-size", "4")
        else:
            result = pools(tp * cp).run(evaluate_in_worker, checkpoint=save, data=str(data), seq_len=16, tp=tp,
                                        cp=cp, batch_size=4)[0]
        assert result["tokens"] == 10 * 16
        losses[(tp, cp)] = result["loss"]
    reference = losses[(1, 1)]
    assert all(abs(loss - reference) <= 1e-6 * reference for loss in losses.values()), losses
    # --dtype fp8: bf16 autocast with the parallel linears' GEMMs in fp8, the same at TP 2 as at TP 1 (the scales
    # agree across TP) and within 1% of fp32 (one fp8 step of e4m3 is 6% of a value, averaged over many)
    fp8 = [pools(tp).run(evaluate_in_worker, checkpoint=save, data=str(data), seq_len=16, tp=tp, batch_size=4,
                         dtype="fp8")[0]["loss"] for tp in (1, 2)]
    bf16 = pools(1).run(evaluate_in_worker, checkpoint=save, data=str(data), seq_len=16, batch_size=4,
                        dtype="bf16")[0]["loss"]
    assert abs(fp8[1] - fp8[0]) <= 1e-3 * fp8[0] and abs(fp8[0] - reference) <= 1e-2 * reference, (fp8, reference)
    assert fp8[0] != bf16, "--dtype fp8 computed what bf16 autocast does"


def test_eval_of_a_one_source_mix_toml_reads_that_source(pools, tmp_path):
    """`--data mix.toml` naming one source (or "1 PATH") evaluates that source; the .toml file itself was read as
    a text file (16 tokens of TOML instead of the data)."""
    from tensorpar.checkpoints.dense_checkpoint import write_dense_checkpoint
    from tensorpar.models import Transformer, get_config
    from tensorpar.models.state import full_state_dict

    cfg = get_config("tiny").replace(hidden_size=32, ffn_hidden_size=64, num_layers=1)
    save = write_dense_checkpoint(str(tmp_path / "ck"), cfg, full_state_dict(Transformer(cfg, None)))
    data = tmp_path / "tokens.npy"
    np.save(data, np.random.default_rng(0).integers(0, 257, size=6 * 17).astype(np.int32))
    (tmp_path / "mix.toml").write_text('[mixture]\n"tokens.npy" = 1.0\n')
    results = [pools(1).run(evaluate_in_worker, checkpoint=save, data=spec, seq_len=16)[0]
               for spec in (str(data), str(tmp_path / "mix.toml"), f"1 {data}")]
    assert results[0]["tokens"] == 6 * 16 and results[1] == results[0] == results[2], results


def test_evaluate_from_python_names_windows_it_cannot_take():
    """`evaluate` took a list, a NumPy array or 1-d ids into a TypeError / IndexError deep inside, divided by a
    batch size of 0, and reported a loss of 0.0 for no windows at all."""
    model = build_transformer(get_config("tiny"), init_mesh(tp=1))
    windows = torch.randint(0, 257, (3, 9))
    for bad, size, needle in (
            ([[1, 2, 3]], 1, r"integer tensor \[N, L \+ 1\] with L >= 1 \(or a Batch\), got a list"),
            (np.zeros((2, 5), dtype=np.int64), 1, r"got a ndarray \(torch.as_tensor\(\) it\)"),
            (torch.arange(10), 1, r"got a 1-d torch.int64 tensor of shape \[10\]"),
            (windows.float(), 1, "got a 2-d torch.float32 tensor"),
            (windows, 0, "batch_size must be a positive integer, got 0"),
            (windows[:0], 1, "no windows to evaluate"),
            (windows + 300, 1, r"outside the model's vocabulary \[0, 257\)")):
        with pytest.raises(TensorparError, match=needle):
            evaluate(model, bad, size, "cpu", Precision())
    assert evaluate(model, windows.int(), 2, "cpu", Precision()) == pytest.approx(
        evaluate(model, windows, 3, "cpu", Precision()), rel=1e-5)
