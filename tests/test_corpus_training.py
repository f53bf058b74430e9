"""Training from every source kind, mixtures resumed exactly (also at another TP size), and --val-data."""

import json
import os

import numpy as np
import pytest

from tensorpar.checkpoints.sharded import read_meta
from tensorpar.data import ByteTokenizer, IndexedWriter, TokenStream
from tensorpar.training import TrainOptions
from tensorpar.training.session import warn_if_data_changed

from harness import train

from corpora import DOCS, byte_stream, write_hf_dataset, write_jsonl, write_jsonl_folder, write_parquet_folder

BASE = dict(steps=20, seed=11, global_batch_size=8, micro_batch_size=4, seq_len=16, lr=3e-3, warmup_steps=1,
            val_every=0, val_fraction=0.0, progress=False, metrics=None, out_dir=None, device="cpu")


def run(config_file, **overrides):
    summary = train(TrainOptions(model=config_file, **{**BASE, **overrides}))
    return {"losses": [(r["step"], r["loss"]) for r in summary["history"]],
            "val": [(r["step"], r.get("val_loss")) for r in summary["history"]],
            "final_val_loss": summary["final_val_loss"], "loss_plot": summary.get("loss_plot")}


@pytest.fixture(scope="module")
def corpora(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpora")
    megatron = IndexedWriter(str(root / "other_text_document"), np.uint16)
    for d in reversed(DOCS):  # a second source with other samples: the documents in reverse order
        megatron.add_document(list(d.encode()) + [ByteTokenizer.eos_id])
    np.save(root / "tokens.npy", byte_stream())
    return {
        "jsonl-folder": write_jsonl_folder(root / "jsonl"),
        "jsonl-gz": write_jsonl(root / "docs.jsonl.gz", gz=True),
        "parquet-folder": write_parquet_folder(root / "parquet"),
        "hf-dataset": write_hf_dataset(root / "hf"),
        "npy": str(root / "tokens.npy"),
        "megatron": megatron.finish(),
        "cache": str(root / "cache"),
    }


def test_every_source_kind_trains_on_the_same_batches(pools, config_file, corpora):
    """The same documents as JSONL, gzipped JSONL, Parquet, a saved dataset and token ids: identical losses."""
    kinds = ["jsonl-folder", "jsonl-gz", "parquet-folder", "hf-dataset", "npy"]
    results = {k: pools(1).run(run, config_file, steps=3, data=corpora[k], data_cache=corpora["cache"])[0]["losses"]
               for k in kinds}
    for k in kinds:
        assert results[k] == results["jsonl-folder"], k
    megatron = pools(1).run(run, config_file, steps=3, data=corpora["megatron"])[0]["losses"]
    assert megatron != results["jsonl-folder"] and len(megatron) == 3  # other documents, other batches


@pytest.fixture(scope="module")
def mixture_runs(pools, config_file, corpora, tmp_path_factory):
    """A 0.7 / 0.3 mixture: 20 steps straight, and 10 steps saved; at TP 1 and TP 2."""
    save = str(tmp_path_factory.mktemp("mix") / "ckpt")
    data = f"0.7 {corpora['jsonl-gz']} 0.3 {corpora['megatron']}"
    common = dict(data=data, data_cache=corpora["cache"])
    straight = {tp: pools(tp).run(run, config_file, tp=tp, **common)[0]["losses"] for tp in (1, 2)}
    first = pools(1).run(run, config_file, stop_after=10, save=save, **common)[0]["losses"]
    return straight, first, os.path.join(save, "step-000010"), common


@pytest.mark.parametrize("tp", [1, 2])
def test_a_mixture_resumed_at_step_10_sees_the_same_batches(pools, config_file, mixture_runs, tp):
    straight, first, checkpoint, common = mixture_runs
    assert first == straight[1][:10]
    resumed = pools(tp).run(run, config_file, tp=tp, resume=checkpoint, **common)[0]["losses"]
    assert [s for s, _ in resumed] == list(range(11, 21))
    # The same batches as the uninterrupted run at this TP size (from the same weights at step 10 up to the
    # float rounding of the other layout's first 10 steps).
    for (step, loss), (_, ref) in zip(resumed, straight[tp][10:]):
        assert abs(loss - ref) <= 1e-6 * ref, f"tp {tp} step {step}: {loss} vs {ref}"


def test_the_checkpoint_records_the_position_in_every_source(mixture_runs, corpora, capsys):
    _, _, checkpoint, common = mixture_runs
    data = read_meta(checkpoint)[1]["train"]["data_sources"]
    assert data["spec"] == common["data"]
    assert [s["samples_drawn"] for s in data["sources"]] == [56, 24]  # 80 samples, 0.7 / 0.3
    assert [s["format"] for s in data["sources"]] == ["jsonl", "megatron"]
    assert [s["documents"] for s in data["sources"]] == [len(DOCS)] * 2
    warn_if_data_changed(data, [(0.7, TokenStream("x", "npy", byte_stream())),
                                 (0.3, TokenStream("y", "npy", byte_stream()[::-1].copy()))], "0.7 x 0.3 y")
    assert "training data differs from the checkpoint's" in capsys.readouterr().err
    same = [(s["weight"], TokenStream(s["path"], s["format"], np.zeros(0))) for s in data["sources"]]
    same[0] = (0.7, TokenStream(corpora["jsonl-gz"], "jsonl", byte_stream()))
    same[1] = (0.3, TokenStream(corpora["megatron"], "megatron", byte_stream(list(reversed(DOCS)))))
    warn_if_data_changed(data, same, common["data"])
    assert capsys.readouterr().err == ""


def test_val_data_gives_validation_loss_every_k_steps(pools, config_file, corpora, tmp_path):
    out = tmp_path / "run"
    # --val-data holds the validation windows: BASE's val_fraction (refused beside it) back to its default
    result = pools(1).run(run, config_file, steps=4, data=corpora["jsonl-gz"], val_data=corpora["parquet-folder"],
                          val_fraction=TrainOptions().val_fraction, eval_every=2, val_windows=4,
                          data_cache=corpora["cache"], out_dir=str(out),
                          metrics=str(out / "metrics.jsonl"))[0]
    assert [s for s, v in result["val"] if v is not None] == [2, 4]
    assert result["final_val_loss"] == result["val"][-1][1] and result["final_val_loss"] > 0
    assert [json.loads(line).get("val_loss") is not None for line in open(out / "metrics.jsonl")] == \
        [False, True, False, True]
    assert result["loss_plot"] == str(out / "loss.png") and os.path.exists(out / "loss.png")
