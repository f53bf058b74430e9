"""`tensorpar eval` reports the same loss at any layout, context parallelism included."""

import json

import numpy as np

from test_cli import tensorpar
from test_sharded import run


def test_eval_loss_is_the_same_at_any_tp_and_cp(pools, config_file, tmp_path):
    save = str(tmp_path / "ckpt")
    pools(1).run(run, config_file, steps=2, save=save)
    data = tmp_path / "tokens.npy"
    np.save(data, np.random.default_rng(0).integers(0, 257, size=10 * 17 + 3).astype(np.int32))
    losses = {}
    for tp, cp in ((1, 1), (2, 2), (1, 4)):
        proc, _ = tensorpar("eval", "--checkpoint", save, "--data", str(data), "--seq-len", "16", "--tp", str(tp),
                            "--cp", str(cp), "--batch-size", "4")
        assert proc.returncode == 0, proc.stderr
        result = json.loads(proc.stdout.strip().splitlines()[-1])
        assert result["tokens"] == 10 * 16
        losses[(tp, cp)] = result["loss"]
    reference = losses[(1, 1)]
    assert all(abs(loss - reference) <= 1e-6 * reference for loss in losses.values()), losses
